"""Chapter 13, reference answers: walking a DFA, the token mask of one state, masking the logits
(and the probability way of doing it, renormalized), and OpenAI's logit_bias."""

from __future__ import annotations

import torch
from torch import Tensor

START = 0  # every DFA of this chapter starts in state 0


def dfa_step(transitions: dict[int, dict[str, int]], state: int, text: str) -> int | None:
    """Follow one edge per character; None as soon as there is no edge to follow."""
    for char in text:
        next_state = transitions.get(state, {}).get(char)  # a state with no way on has no row
        if next_state is None:
            return None  # fell off: no continuation of this text can match
        state = next_state
    return state


def accepts(transitions: dict[int, dict[str, int]], accepting: set[int], text: str) -> bool:
    """The whole text from the start, and the walk must end in an accepting state."""
    end = dfa_step(transitions, START, text)
    return end is not None and end in accepting


def token_mask(transitions: dict[int, dict[str, int]], accepting: set[int], state: int,
               vocab: list[str], eos_id: int) -> list[bool]:
    """A token may come next when ALL its characters can be read from `state`; EOS when the text
    so far already matches in full."""
    allowed = []
    for token_id, text in enumerate(vocab):
        if token_id == eos_id:
            allowed.append(state in accepting)  # EOS ends the text: only where it matches
        else:  # an empty token would be allowed forever without making any progress
            allowed.append(text != "" and dfa_step(transitions, state, text) is not None)
    return allowed


def constrain(logits: Tensor, allowed: list[bool]) -> Tensor:
    """Every disallowed logit to -inf, in a new tensor. [..., V] -> [..., V]."""
    mask = torch.tensor(allowed, dtype=torch.bool, device=logits.device)  # [V]
    if mask.shape != logits.shape[-1:]:
        raise ValueError(f"allowed must hold one bool per token (V = {logits.shape[-1]}), got "
                         f"{len(allowed)}")
    if not mask.any():
        raise ValueError("allowed is all False: no token may come next, and softmax of all -inf "
                         "is nan; the grammar is stuck (a bug in the grammar or the vocab)")
    return logits.masked_fill(~mask, float("-inf"))  # [..., V]: the mask broadcasts over rows


def apply_temperature_then_mask(logits: Tensor, allowed: list[bool],
                                temperature: float) -> Tensor:
    """The probability way: softmax(logits / t), zero the disallowed, renormalize. [..., V]."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (0 means greedy: an argmax, "
                         "no distribution)")
    mask = torch.tensor(allowed, dtype=torch.bool, device=logits.device)  # [V]
    probs = torch.softmax(logits / temperature, dim=-1)  # [..., V]
    kept = probs * mask  # [..., V], the disallowed at 0: the rest sums to less than 1
    return kept / kept.sum(dim=-1, keepdim=True)  # the allowed tokens share all the mass


def logit_bias(logits: Tensor, bias: dict[int, float]) -> Tensor:
    """Each listed token's logit plus its bias, in a new tensor. [V] -> [V]."""
    out = logits.clone()
    for token, value in bias.items():
        out[token] += value  # a logit + b multiplies the token's odds by e^b
    return out

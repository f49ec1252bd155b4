"""Chapter 01, reference answers: the sampling filters and the naive generation loop.

Every filter takes logits of shape [V] (one row) or [B, V] (a batch) and returns a new tensor of
the same shape in which the dropped tokens have the logit -inf (softmax then gives them 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

NEG_INF = float("-inf")  # a dropped token's logit: exp(-inf) = 0, so softmax renormalizes the rest


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide the logits by the temperature (> 0): below 1 sharpens, above 1 flattens."""
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th);
    0, -1 or k >= V: keep all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth_largest, NEG_INF)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least p,
    and every token tied with the last one kept (the boundary), whatever order a sort puts ties in.

    Sorted probabilities 0.4 0.3 0.3 with p = 0.5: mass before each 0.0 0.4 0.7, so the first 0.3
    crosses p and is the boundary; the other 0.3 is just as likely, so it stays too.
    """
    if p >= 1.0:  # skip the arithmetic: float rounding could drop tokens of tiny probability
        return logits.clone()
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [..., V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [..., V]
    # mass of the more likely tokens
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # [..., 1]: the boundary token is the last one
    n_keep = (mass_before < p).sum(dim=-1, keepdim=True)
    boundary = sorted_logits.gather(-1, n_keep - 1)  # [..., 1], the boundary token's logit
    return logits.masked_fill(logits < boundary, NEG_INF)  # comparing values keeps every tie


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # [..., 1]
    return logits.masked_fill(probs < threshold, NEG_INF)


def naive_generate(next_token_logits_fn: Callable[[list[int]], torch.Tensor],
                   prompt_ids: Sequence[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Greedy decoding with no cache: every step, the model reads the whole sequence again."""
    ids = list(prompt_ids)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        logits = next_token_logits_fn(list(ids))  # [V], the scores for the token after ids[-1]
        token = int(torch.argmax(logits))
        ids.append(token)
        new_ids.append(token)
        if token == eos_id:
            break
    return new_ids

"""Chapter 01 exercises: the sampling filters and the naive generation loop.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch01

Every filter takes logits of shape [V] (one row) or [B, V] (a batch, each row on its own) and
returns a NEW tensor of the same shape (do not modify the input) in which every dropped token has
the logit -inf, so that softmax gives it probability 0 and renormalizes the others. The engine's
versions live in engine/sampling.py; try not to peek until the checks pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def temperature_scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide the logits by the temperature (> 0): below 1 sharpens, above 1 flattens."""
    raise NotImplementedError("one line: divide, and return a new tensor (no in-place `/=`)")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); 0, -1 or k >= V: keep all."""
    raise NotImplementedError(
        "find the k-th largest value of each row with torch.topk(...).values[..., -1:], "
        "then masked_fill every logit below it with -inf")


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least p."""
    raise NotImplementedError(
        "softmax, sort descending, cumsum; a token stays if the tokens MORE likely than it add up "
        "to less than p (so the one that crosses p stays); scatter the mask back to vocabulary "
        "order; p = 1.0 keeps everything")


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p times the top token's probability."""
    raise NotImplementedError("softmax, take each row's max with keepdim=True, compare, masked_fill")


def naive_generate(next_token_logits_fn: Callable[[list[int]], torch.Tensor], prompt_ids: Sequence[int],
                   max_new_tokens: int, eos_id: int) -> list[int]:
    """Greedy decoding with no cache, returning only the new token ids (eos included if produced).

    Every step: call next_token_logits_fn on the WHOLE sequence so far (prompt + new tokens) to get
    logits [V], append their argmax, stop after eos_id or after max_new_tokens tokens.
    """
    raise NotImplementedError(
        "keep a list ids = prompt + new tokens; loop max_new_tokens times: "
        "logits = next_token_logits_fn(ids); token = int(logits.argmax()); append; break on eos_id")

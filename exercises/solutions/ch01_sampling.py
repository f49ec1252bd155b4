"""Chapter 01, reference answers: the sampling filters and the naive generation loop.

Every filter takes logits of shape [V] (one row) or [B, V] (a batch) and returns a new tensor of
the same shape in which the dropped tokens have the logit -inf (softmax then gives them 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

NEG_INF = float("-inf")  # a dropped token's logit: exp(-inf) = 0, so softmax renormalizes the rest


def temperature_scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide the logits by the temperature (> 0): below 1 sharpens, above 1 flattens."""
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); 0, -1 or k >= V: keep all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth_largest, NEG_INF)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least p."""
    if p >= 1.0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [..., V] each
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more likely tokens
    drop_sorted = mass_before >= p  # the token that crosses p has mass_before < p: it stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, NEG_INF)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # [..., 1]
    return logits.masked_fill(probs < threshold, NEG_INF)


def naive_generate(next_token_logits_fn: Callable[[list[int]], torch.Tensor], prompt_ids: Sequence[int],
                   max_new_tokens: int, eos_id: int) -> list[int]:
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

"""Chapter 12, reference answers: the rejection rule, the residual, greedy verification, the
expected tokens per step and the k that pays best, and rolling back a block table."""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import Tensor


def accept_guess(p_guess: float, q_guess: float, u: float) -> bool:
    """Keep the guess when u < p / q: a fraction min(1, p / q) of [0, 1). We write u * q < p,
    which says the same without dividing, and is False for p = 0 even at u = 0."""
    return u * q_guess < p_guess


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """max(0, p - q) / its sum. [V], [V] -> [V]."""
    rest = torch.clamp(p - q, min=0.0)  # [V], the mass the target wants and q did not offer
    total = rest.sum()  # the probability that a guess is rejected
    if total <= 0:
        raise ValueError("p and q: max(0, p - q) is all zero (p == q?), so no guess is ever "
                         "rejected and there is no residual to draw from")
    return rest / total


def greedy_verify(target_argmax: Sequence[int], guesses: Sequence[int]) -> list[int]:
    """The agreeing prefix, then the target's token (a correction, or the bonus)."""
    if len(target_argmax) != len(guesses) + 1:
        raise ValueError(f"target_argmax must hold k + 1 = {len(guesses) + 1} tokens (one per "
                         f"row of the verify step) for {len(guesses)} guesses, got "
                         f"{len(target_argmax)}")
    emitted = []
    for guess, target in zip(guesses, target_argmax, strict=False):
        emitted.append(target)  # the target's own token: the guess itself when they agree
        if guess != target:
            return emitted  # the first disagreement ends the step
    emitted.append(target_argmax[-1])  # every guess kept: the bonus token, from the last row
    return emitted


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k = (1 - alpha^(k + 1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0 (the guesses per step), got {k!r}")
    if alpha == 1.0:  # the formula's 0 / 0: every guess kept, then the bonus token
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, cost_of_k: Mapping[int, float]) -> int:
    """The k with the most expected tokens per second of its step; ties go to the smaller k."""
    if not cost_of_k or not all(cost > 0 for cost in cost_of_k.values()):
        raise ValueError(f"cost_of_k must map at least one k to a step time > 0 s, got "
                         f"{dict(cost_of_k)!r}")
    best, best_rate = None, -math.inf
    for k in sorted(cost_of_k):
        rate = expected_tokens_per_step(alpha, k) / cost_of_k[k]  # tokens per second
        if rate > best_rate:  # strictly better: a tie keeps the smaller k
            best, best_rate = k, rate
    return best


def rollback_block_table(table: Sequence[int], refcounts: MutableMapping[int, int],
                         num_tokens: int, n: int,
                         block_size: int) -> tuple[list[int], list[int]]:
    """Keep the blocks that still hold a token; each one that leaves loses our reference."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= num_tokens:
        raise ValueError(f"n must be an integer in 0..{num_tokens} (the tokens the sequence "
                         f"holds), got {n!r}")
    keep = (num_tokens - n + block_size - 1) // block_size  # ceil: a partly filled block stays
    freed = []
    for block in table[keep:]:
        refcounts[block] -= 1  # our table lets go of it
        if refcounts[block] == 0:  # nobody else holds it: back to the free list
            freed.append(block)
    return list(table[:keep]), freed

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


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide the logits by the temperature (> 0): below 1 sharpens, above 1 flattens."""
    raise NotImplementedError(
        "which arithmetic on the logits makes t = 2 flatten the distribution and t = 0.5 sharpen "
        "it? And does the caller get their logits back unchanged?")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th);
    0, -1 or k >= V: keep all."""
    raise NotImplementedError(
        "what is the k-th largest logit of each row, and which tokens lie strictly below it? What "
        "about the tokens tied with it, and the values of k that mean 'off'?")


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least p.

    The token whose probability carries the running total to p or past it is the *boundary*: it
    stays, and so does every token exactly as likely as it (so the answer never depends on the
    order a sort puts tied tokens in). p = 1.0 keeps everything.
    """
    raise NotImplementedError(
        "in probabilities sorted from most to least likely, at which token does the running total "
        "first reach p? Which other tokens are exactly as likely as that one, wherever the sort "
        "put them?")


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p times the top token's probability."""
    raise NotImplementedError(
        "the threshold is min_p times which probability? And how many thresholds does a batch of "
        "B rows need?")


def naive_generate(next_token_logits_fn: Callable[[list[int]], torch.Tensor],
                   prompt_ids: Sequence[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Greedy decoding with no cache, returning only the new token ids (eos included if produced).

    Every step: call next_token_logits_fn on the WHOLE sequence so far (prompt + new tokens) to get
    logits [V], append the most likely token, stop after eos_id or after max_new_tokens tokens.
    Leave the caller's prompt_ids as they were.
    """
    raise NotImplementedError(
        "what makes greedy decoding give the same answer on every run? Each step, what must the "
        "model see, whose list may you grow, and when exactly do you stop?")

"""Chapter 09 exercises: the serving metrics by hand,
from the raw numbers a server or a client records.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch09

One request, on one clock (seconds): it arrived, then its tokens came at `token_times`
[t0, t1, ..., t(n-1)]. TTFT is t0 - arrival. What a streaming reader feels after that:

    token:     t0        t1   t2             t3
               |---------|----|--------------|
    ITL:       <- t1-t0 -><t2-t1><-- t3-t2 --->      n - 1 gaps, one per token after the first
    TPOT:      (t3 - t0) / 3 = the mean of the gaps  (not / 4: the first token has no gap before it)

Percentiles are NEAREST RANK ones, as engine/companions/metrics.py computes them: the P-th
percentile of n values is the ceil(P / 100 * n)-th smallest value, always one that was really
observed (no interpolation).
"""

from __future__ import annotations

import math  # noqa: F401
from collections.abc import Mapping, Sequence


def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """The gap before each token after the first (seconds): n token times give n - 1 gaps.

    inter_token_latencies([1.0, 1.5, 1.6, 2.6]) == [0.5, 0.1, 1.0] (up to float rounding);
    [] for one token.
    """
    raise NotImplementedError(
        "n token times have how many gaps between neighbours, and which time do you subtract from "
        "which?")


def time_per_output_token(token_times: Sequence[float]) -> float:
    """TPOT: (last token time - first token time) / (n - 1), the mean of the inter-token gaps.

    math.nan when there are fewer than 2 tokens (one token has no gap, so no pace).
    """
    raise NotImplementedError(
        "how many gaps follow the first token, and how long do they last together? What is the "
        "pace of a single token?")


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) by nearest rank: sort, take the ceil(q / 100 * n)-th
    smallest (1-based). nearest_rank([4, 1, 3, 2], 50) == 2; P99 of 20 values is their maximum.
    math.nan for no values; a ValueError naming q when q is outside (0, 100]."""
    raise NotImplementedError(
        "after sorting, which rank holds the q-th percentile by nearest rank, and how does a "
        "1-based rank become a Python index? Which q make no sense, and what of no values?")


def goodput(requests: Sequence[Mapping], ttft_slo_ms: float, tpot_slo_ms: float,
            duration_s: float) -> float:
    """Requests per second of a `duration_s` run that were served within BOTH limits.

    requests: one dict per request,
    {"ttft_ms": float, "tpot_ms": float or None, "finish_reason": "stop", "length" or "abort"}. A
    request counts when it was not aborted, its TTFT is at most ttft_slo_ms and its TPOT at most
    tpot_slo_ms; a one-token answer has tpot_ms None and is judged by its TTFT alone. A limit met
    exactly is met. ValueError naming duration_s unless it is > 0.
    """
    raise NotImplementedError(
        "which requests count: an aborted one? a one-token answer with no TPOT? one that meets a "
        "limit exactly? And goodput is a count per what?")

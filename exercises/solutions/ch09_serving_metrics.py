"""Chapter 09 reference answers: inter-token latencies and TPOT from token timestamps, the
nearest-rank percentile, and goodput from a table of requests."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """The gap before each token after the first (seconds): n token times give n - 1 gaps."""
    times = [float(t) for t in token_times]
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def time_per_output_token(token_times: Sequence[float]) -> float:
    """TPOT = (last token - first token) / (n - 1): the mean gap after the first token;
    nan below 2 tokens."""
    n = len(token_times)
    if n < 2:
        return math.nan  # one token has no gap: its pace is not defined
    return (token_times[-1] - token_times[0]) / (n - 1)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-th percentile by nearest rank: the ceil(q / 100 * n)-th smallest value (1-based)."""
    if not 0 < q <= 100:
        raise ValueError(f"q={q!r} must be in (0, 100], e.g. 50 or 99")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = math.ceil(q / 100 * len(ordered))  # 1-based: the rank-th smallest value
    return ordered[max(rank, 1) - 1]


def goodput(requests: Sequence[Mapping], ttft_slo_ms: float, tpot_slo_ms: float,
            duration_s: float) -> float:
    """Requests per second of the run that met BOTH limits; aborted requests never count, and a
    one-token answer (tpot_ms None) is judged by its TTFT alone."""
    if not duration_s > 0:
        raise ValueError(f"duration_s={duration_s!r} must be > 0 seconds")
    met = 0
    for r in requests:
        if r["finish_reason"] == "abort":
            continue
        fast_start = r["ttft_ms"] <= ttft_slo_ms
        steady_pace = r["tpot_ms"] is None or r["tpot_ms"] <= tpot_slo_ms
        if fast_start and steady_pace:
            met += 1
    return met / duration_s

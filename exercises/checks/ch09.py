"""Checks for chapter 09: inter-token latencies and TPOT from token timestamps, the nearest-rank
percentile, and goodput from a table of requests.

Each `check_<claim>(mod)` runs against the student's `exercises/ch09_serving_metrics.py` or the
reference in `exercises/solutions/`. The oracles are numbers worked by hand and
engine/companions/metrics.py itself (`RequestTiming.itl_s`, `RequestTiming.tpot_s`, `nearest_rank`,
`goodput` with an `SLO`).
"""

from __future__ import annotations

import math
import random

from engine.companions.metrics import SLO, RequestTiming
from engine.companions.metrics import goodput as engine_goodput
from engine.companions.metrics import nearest_rank as engine_nearest_rank
from exercises.checks import raises_naming

SEED = 9
ATOL = 1e-9  # sums and differences of a few float seconds
HAND_TIMES = [1.0, 1.5, 1.6, 2.6]  # four tokens: gaps 0.5, 0.1, 1.0; TPOT = 1.6 / 3
TRIALS = 50


def _close(got, want, what: str) -> None:
    assert isinstance(got, int | float), f"{what}: expected a number, got {type(got).__name__}"
    assert abs(got - want) <= ATOL, f"{what}: got {got!r}, expected {want!r}"


def _close_list(got, want, what: str) -> None:
    assert isinstance(got, list), f"{what}: expected a list, got {type(got).__name__}"
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}: {want}"
    for g, w in zip(got, want, strict=True):
        _close(g, w, what)


def _random_token_times(rng: random.Random) -> list[float]:
    """A request's token times: a first token after a while, then gaps with the odd stall."""
    now, times = rng.uniform(0.05, 2.0), []
    for _ in range(rng.randint(1, 30)):
        times.append(now)
        now += rng.expovariate(50.0) + (0.5 if rng.random() < 0.05 else 0.0)
    return times


# ---- inter-token latencies and TPOT --------------------------------------------------------------


def check_inter_token_latencies_are_the_gaps_between_consecutive_tokens(mod) -> None:
    _close_list(mod.inter_token_latencies(HAND_TIMES), [0.5, 0.1, 1.0],
                f"inter_token_latencies({HAND_TIMES})")
    _close_list(mod.inter_token_latencies([3.0]), [],
                "inter_token_latencies([3.0]) (one token: no gap)")


def check_inter_token_latencies_match_the_engine(mod) -> None:
    rng = random.Random(SEED)
    for _ in range(TRIALS):
        times = _random_token_times(rng)
        want = RequestTiming("r", 0.0, times).itl_s
        _close_list(mod.inter_token_latencies(times), want,
                    f"inter_token_latencies of {len(times)} tokens")


def check_tpot_divides_the_decode_time_by_the_gaps_not_the_tokens(mod) -> None:
    _close(mod.time_per_output_token(HAND_TIMES), 1.6 / 3,
           f"time_per_output_token({HAND_TIMES}) (1.6 s over 3 gaps; "
           "dividing by 4 tokens gives 0.4)")
    _close(mod.time_per_output_token([5.0, 5.25]), 0.25, "time_per_output_token([5.0, 5.25])")


def check_tpot_of_a_single_token_is_nan(mod) -> None:
    got = mod.time_per_output_token([0.7])
    assert isinstance(got, float) and math.isnan(got), (
        f"time_per_output_token([0.7]) = {got!r}: one token has no pace, return math.nan "
        "(0 would look perfect)")


def check_tpot_is_the_mean_of_the_inter_token_latencies(mod) -> None:
    rng = random.Random(SEED + 1)
    for _ in range(TRIALS):
        times = _random_token_times(rng)
        if len(times) < 2:
            continue
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        _close(mod.time_per_output_token(times), sum(gaps) / len(gaps),
               f"time_per_output_token of {len(times)} tokens (the mean gap, stalls included)")


def check_tpot_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 2)
    for _ in range(TRIALS):
        times = _random_token_times(rng)
        want = RequestTiming("r", 0.0, times, finish_time=times[-1]).tpot_s
        got = mod.time_per_output_token(times)
        if math.isnan(want):
            assert isinstance(got, float) and math.isnan(got), (
                f"time_per_output_token({times}) = {got!r}, expected nan")
        else:
            _close(got, want, f"time_per_output_token of {len(times)} tokens")


# ---- percentiles ---------------------------------------------------------------------------------


def check_nearest_rank_by_hand(mod) -> None:
    cases = [([4, 1, 3, 2], 50, 2), ([4, 1, 3, 2], 75, 3), ([4, 1, 3, 2], 76, 4),
             ([10, 20, 30, 40], 25, 10), (list(range(1, 21)), 99, 20), (list(range(1, 21)), 95, 19),
             (list(range(1, 101)), 99, 99), ([7.5], 1, 7.5), ([3, 1, 2], 100, 3)]
    for values, q, want in cases:
        _close(mod.nearest_rank(values, q), want,
               f"nearest_rank({values if len(values) < 6 else '...'}, {q})")


def check_nearest_rank_is_always_an_observed_value(mod) -> None:
    rng = random.Random(SEED + 3)
    for _ in range(TRIALS):
        values = [rng.lognormvariate(0, 1) for _ in range(rng.randint(1, 40))]
        for q in (10, 50, 90, 95, 99):
            got = mod.nearest_rank(values, q)
            assert got in values, (
                f"nearest_rank(..., {q}) = {got!r} is not one of the values (no interpolation)")


def check_nearest_rank_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 4)
    for _ in range(TRIALS):
        values = [round(rng.uniform(0, 5), 3) for _ in range(rng.randint(1, 250))]
        for q in (1, 25, 50, 90, 95, 99, 99.9, 100):
            _close(mod.nearest_rank(list(values), q), engine_nearest_rank(values, q),
                   f"nearest_rank of {len(values)} values at q={q}")


def check_nearest_rank_refuses_q_outside_0_to_100(mod) -> None:
    for q in (0, -5, 100.5):
        raises_naming("q", lambda q=q: mod.nearest_rank([1.0, 2.0], q),
                      f"nearest_rank([1, 2], {q})")
    got = mod.nearest_rank([], 50)
    assert isinstance(got, float) and math.isnan(got), (
        f"nearest_rank([], 50) = {got!r}, expected nan")


# ---- goodput -------------------------------------------------------------------------------------


def _row(ttft_ms, tpot_ms, reason="stop") -> dict:
    return {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "finish_reason": reason}


def check_goodput_counts_only_requests_within_both_limits(mod) -> None:
    table = [_row(100, 20), _row(900, 20), _row(100, 90), _row(700, 70), _row(150, 30, "length")]
    # SLO: TTFT <= 200 ms and TPOT <= 50 ms.
    # Met: rows 0 and 4; row 1 misses TTFT, row 2 TPOT, row 3 both.
    _close(mod.goodput(table, 200, 50, 2.0), 2 / 2.0, "goodput of the 5-request table over 2 s")


def check_goodput_is_per_second_of_the_run(mod) -> None:
    table = [_row(100, 20)] * 6 + [_row(500, 20)] * 2
    _close(mod.goodput(table, 200, 50, 4.0), 6 / 4.0,
           "goodput: 6 of 8 requests met the SLO in a 4 s run")
    raises_naming("duration_s", lambda: mod.goodput(table, 200, 50, 0.0),
                  "goodput(..., duration_s=0)")


def check_goodput_judges_a_one_token_answer_by_its_ttft(mod) -> None:
    table = [_row(100, None), _row(300, None), _row(100, 20)]
    _close(mod.goodput(table, 200, 50, 1.0), 2.0, "goodput with one-token answers (tpot_ms None)")


def check_goodput_never_counts_an_aborted_request(mod) -> None:
    table = [_row(50, 10, "abort"), _row(50, 10, "stop"), _row(50, None, "abort")]
    _close(mod.goodput(table, 200, 50, 1.0), 1.0,
           "goodput with aborted requests (they are never good)")


def check_goodput_counts_a_limit_met_exactly(mod) -> None:
    table = [_row(200, 50), _row(200.001, 50), _row(200, 50.001)]
    _close(mod.goodput(table, 200, 50, 1.0), 1.0,
           "goodput: TTFT exactly 200 ms and TPOT exactly 50 ms is met")


def check_goodput_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 5)
    for _ in range(TRIALS):
        table, timings = [], []
        for i in range(rng.randint(1, 30)):
            ttft, gap, n = rng.uniform(0.01, 1.0), rng.uniform(0.005, 0.1), rng.randint(1, 8)
            reason = rng.choice(["stop", "length", "abort"])
            times = [ttft + k * gap for k in range(n)]
            timing = RequestTiming(str(i), 0.0, times, finish_time=times[-1], finish_reason=reason)
            timings.append(timing)
            table.append(_row(timing.ttft_s * 1e3, None if n < 2 else timing.tpot_s * 1e3, reason))
        want = engine_goodput(timings, SLO(ttft_s=0.4, tpot_s=0.05), 10.0).per_s
        _close(mod.goodput(table, 400, 50, 10.0), want,
               f"goodput of {len(table)} random requests over 10 s")

"""Checks for chapter 10: a token bucket, the Retry-After header, the queue caps' decision, the
max_num_queued_tokens for a TTFT target, and the two halves of a run the troubleshooting
order compares.

Each `check_<claim>(mod)` runs against the student's `exercises/ch10_overload.py` or the reference
in `exercises/solutions/`. The oracles are numbers worked by hand and the engine itself:
engine/serving/admission.py (`TokenBucket`, `Admission` with `AdmissionLimits`),
engine/serving/server.py (`OpenAIError`'s Retry-After header) and engine/serving/diagnose.py
(`arrival_halves`). Every clock here is a fake one, far from the wall clock's reading.
"""

from __future__ import annotations

import math
import random

from engine.serving.admission import Admission, AdmissionLimits, Load, Rejected
from engine.serving.admission import TokenBucket as EngineTokenBucket
from engine.serving.diagnose import RequestSplit
from engine.serving.diagnose import arrival_halves as engine_arrival_halves
from engine.serving.server import OpenAIError
from exercises.checks import raises_naming

SEED = 10
ATOL = 1e-9  # sums and products of a few float seconds
TRIALS = 50
# a fake clock's start, nowhere near time.monotonic(): a bucket must use `now`
FAKE_EPOCH = 1_000_000.0


def _close(got, want, what: str) -> None:
    assert isinstance(got, int | float) and not isinstance(got, bool), \
        f"{what}: expected a number, got {type(got).__name__}"
    if math.isinf(want):
        assert got == want, f"{what}: got {got!r}, expected {want!r}"
        return
    assert abs(got - want) <= ATOL, f"{what}: got {got!r}, expected {want!r}"


# ---- the token bucket ----------------------------------------------------------------------------


def check_token_bucket_starts_full_and_a_burst_drains_it(mod) -> None:
    bucket, now = mod.TokenBucket(2.0, 5.0), FAKE_EPOCH  # 2 per second, 5 at most
    for i in range(5):
        _close(bucket.wait_s(1, now), 0.0,
               f"wait_s(1) for request {i + 1} of a burst of 5 (a new bucket is full)")
        bucket.take(1, now)
    _close(bucket.wait_s(1, now), 0.5,
           "wait_s(1) once the burst of 5 is spent (1 token at 2 per second)")
    _close(bucket.wait_s(1, now + 0.5), 0.0, "wait_s(1) half a second later (the token has come)")


def check_token_bucket_refill_stops_at_the_burst(mod) -> None:
    bucket, now = mod.TokenBucket(10.0, 3.0), FAKE_EPOCH
    bucket.take(3, now)
    now += 100.0  # idle for 100 s: 1000 tokens' worth of refill, but the bucket holds 3
    for i in range(3):
        _close(bucket.wait_s(1, now), 0.0, f"wait_s(1) for request {i + 1} after 100 s idle")
        bucket.take(1, now)
    _close(bucket.wait_s(1, now), 0.1,
           "wait_s(1) for the 4th request after 100 s idle "
           "(the level stops at burst=3, however long the idle)")


def check_token_bucket_wait_s_is_seconds_until_the_amount_is_there(mod) -> None:
    bucket, now = mod.TokenBucket(4.0, 10.0), FAKE_EPOCH
    bucket.take(10, now)
    now += 1.0  # the level is back to 4
    _close(bucket.wait_s(6, now), 0.5,
           "wait_s(6) with 4 tokens at 4 per second (2 missing: 0.5 s, not 2 tokens)")
    _close(bucket.wait_s(3, now), 0.0, "wait_s(3) with 4 tokens there (0, never negative)")
    _close(bucket.wait_s(10, now), 1.5,
           "wait_s(10) = the whole burst, from 4 tokens at 4 per second")
    _close(bucket.wait_s(10.5, now), math.inf,
           "wait_s(10.5) in a bucket of burst 10 (it can never hold that)")


def check_token_bucket_runs_on_the_clock_it_is_given(mod) -> None:
    bucket = mod.TokenBucket(1.0, 60.0)
    bucket.take(60, 0.0)
    _close(bucket.wait_s(30, 0.0), 30.0,
           "wait_s(30) right after emptying a bucket refilled at 1 per second")
    _close(bucket.wait_s(30, 45.0), 0.0,
           "wait_s(30) at now=45.0 (45 s later on the clock we pass in; the wall clock "
           "has barely moved)")


def check_token_bucket_ignores_a_reading_earlier_than_the_last(mod) -> None:
    bucket, now = mod.TokenBucket(2.0, 4.0), FAKE_EPOCH
    bucket.take(4, now)
    _close(bucket.wait_s(1, now - 3.0), 0.5,
           "wait_s(1) at a reading 3 s before the last (it adds and loses nothing)")
    _close(bucket.wait_s(2, now + 0.5), 0.5,
           "wait_s(2) 0.5 s after the last reading (1 token refilled since then, measured from "
           "the latest reading)")


def check_token_bucket_refuses_a_rate_or_burst_that_is_not_positive(mod) -> None:
    for rate, burst, field in ((0.0, 5.0, "rate_per_s"), (-1.0, 5.0, "rate_per_s"),
                               (math.nan, 5.0, "rate_per_s"), (2.0, 0.0, "burst"),
                               (2.0, -3.0, "burst")):
        raises_naming(field, lambda r=rate, b=burst: mod.TokenBucket(r, b),
                      f"TokenBucket({rate}, {burst})")


def check_token_bucket_matches_the_engine_on_random_operations(mod) -> None:
    rng = random.Random(SEED)
    for _ in range(TRIALS):
        rate, burst = rng.choice([0.5, 1.0, 3.0, 20.0]), rng.choice([1.0, 2.0, 7.5, 50.0])
        mine, engine, now = mod.TokenBucket(rate, burst), EngineTokenBucket(rate, burst), FAKE_EPOCH
        for step in range(40):
            # bursts, gaps, a step back
            now += rng.choice([0.0, 0.0, rng.expovariate(rate), -rng.uniform(0, 1)])
            cost = rng.choice([1.0, rng.uniform(0.1, burst * 1.2)])
            want = engine.wait_s(cost, now)
            _close(mine.wait_s(cost, now), want,
                   f"wait_s({cost:.3g}) at op {step} (rate {rate}, burst {burst})")
            if want == 0.0:
                mine.take(cost, now)
                engine.take(cost, now)


# ---- the Retry-After header ----------------------------------------------------------------------


def check_retry_after_rounds_up_to_whole_seconds(mod) -> None:
    for seconds, want in ((0.25, "1"), (0.5, "1"), (1.0, "1"), (1.01, "2"), (2.4, "3"), (7.0, "7"),
                          (0.0, "1")):
        got = mod.retry_after_header(seconds)
        assert got == want, (
            f"retry_after_header({seconds}) = {got!r}, expected {want!r} (whole seconds, "
            "rounded up, at least 1: a client that obeys it is never early)")


def check_retry_after_is_none_when_waiting_would_not_help(mod) -> None:
    for seconds in (None, math.inf):
        got = mod.retry_after_header(seconds)
        assert got is None, f"retry_after_header({seconds}) = {got!r}, expected None (no header)"


def check_retry_after_matches_the_server(mod) -> None:
    rng = random.Random(SEED + 1)
    for _ in range(TRIALS):
        seconds = rng.choice([rng.uniform(0, 3), rng.uniform(0, 120), float(rng.randint(1, 30))])
        want = OpenAIError(503, "the server is full", retry_after_s=seconds).headers["Retry-After"]
        got = mod.retry_after_header(seconds)
        assert got == want, f"retry_after_header({seconds!r}) = {got!r}, the server sends {want!r}"


# ---- the queue caps ------------------------------------------------------------------------------


def _verdict(mod, requests, queued, prompt, max_reqs, max_tokens):
    return mod.queue_cap_rejection(requests, queued, prompt, max_reqs, max_tokens)


def check_queue_cap_turns_away_the_request_past_max_num_queued_reqs(mod) -> None:
    for requests, want in ((0, None), (3, None), (4, "max_num_queued_reqs"),
                           (9, "max_num_queued_reqs")):
        got = _verdict(mod, requests, 0, 10, 4, None)
        assert got == want, (
            f"queue_cap_rejection with {requests} requests in flight, max_num_queued_reqs=4: "
            f"{got!r}, expected {want!r} (4 in flight is full: the new one would be the 5th)")


def check_queue_cap_counts_this_prompt_against_max_num_queued_tokens(mod) -> None:
    for queued, prompt, want in ((600, 400, None), (600, 401, "max_num_queued_tokens"),
                                 (1000, 1, "max_num_queued_tokens"), (999, 1, None)):
        got = _verdict(mod, 2, queued, prompt, None, 1000)
        assert got == want, (
            f"queue_cap_rejection with {queued} tokens queued and a prompt of {prompt}, "
            f"max_num_queued_tokens=1000: {got!r}, expected {want!r} (queued + this prompt "
            "may reach the cap, not pass it)")


def check_queue_cap_lets_a_long_prompt_in_when_nothing_is_queued(mod) -> None:
    got = _verdict(mod, 1, 0, 5000, 8, 1000)
    assert got is None, (
        f"queue_cap_rejection of a 5000-token prompt with nothing queued, max_num_queued_tokens="
        f"1000: {got!r}, expected None (else a prompt over the cap could never be served)")
    got = _verdict(mod, 1, 1, 1000, 8, 1000)
    assert got == "max_num_queued_tokens", \
        f"queue_cap_rejection of a 1000-token prompt behind 1 queued token, cap 1000: {got!r}"


def check_queue_cap_names_the_request_cap_first_and_none_is_no_cap(mod) -> None:
    got = _verdict(mod, 4, 900, 200, 4, 1000)
    assert got == "max_num_queued_reqs", (
        f"queue_cap_rejection past both caps: {got!r}, expected the request cap")
    got = _verdict(mod, 10_000, 10**9, 10**6, None, None)
    assert got is None, f"queue_cap_rejection with both caps None (no caps): {got!r}, expected None"


def check_queue_cap_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 2)
    for _ in range(TRIALS * 4):
        max_reqs, max_tokens = rng.choice([None, 1, 4, 16]), rng.choice([None, 1, 256, 2048])
        load = Load(rng.randint(0, 20), rng.choice([0, rng.randint(1, 3000)]))
        prompt = rng.randint(1, 1500)
        admission = Admission(AdmissionLimits(max_num_queued_reqs=max_reqs,
                                              max_num_queued_tokens=max_tokens))
        try:
            admission.check(None, prompt, prompt, load, FAKE_EPOCH)
            want = None
        except Rejected as rejected:
            want = rejected.reason
        got = _verdict(mod, load.num_requests, load.num_queued_tokens, prompt, max_reqs, max_tokens)
        assert got == want, (
            f"queue_cap_rejection({load.num_requests}, {load.num_queued_tokens}, {prompt}, "
            f"{max_reqs}, {max_tokens}) = {got!r}; the engine's Admission says {want!r}")


# ---- a cap from the TTFT target ------------------------------------------------------------------


def check_queued_tokens_cap_is_ttft_target_times_prefill_throughput(mod) -> None:
    for target_s, tokens_per_s, want in ((0.5, 4000, 2000), (2.0, 1500, 3000), (0.25, 2048, 512),
                                         (0.75, 1333, 999)):
        got = mod.max_num_queued_tokens_for(target_s, tokens_per_s)
        assert got == want, (
            f"max_num_queued_tokens_for({target_s} s, {tokens_per_s} tok/s) = {got!r}, "
            f"expected {want} (seconds x tokens per second, rounded down)")


def check_queued_tokens_cap_keeps_the_wait_within_the_target(mod) -> None:
    rng = random.Random(SEED + 3)
    for _ in range(TRIALS * 4):
        target_s, tokens_per_s = rng.uniform(0.05, 5.0), rng.uniform(20.0, 20_000.0)
        cap = mod.max_num_queued_tokens_for(target_s, tokens_per_s)
        assert cap / tokens_per_s <= target_s, (
            f"max_num_queued_tokens_for({target_s:.4f}, {tokens_per_s:.1f}) = "
            f"{cap!r}: prefilling it takes {cap / tokens_per_s:.4f} s, past the "
            "target (round down)")
        assert (cap + 1) / tokens_per_s > target_s, (
            f"max_num_queued_tokens_for({target_s:.4f}, {tokens_per_s:.1f})"
            f" = {cap!r}: one more token would still fit the target")


def check_queued_tokens_cap_is_an_int_the_engine_accepts(mod) -> None:
    # 0.2 tokens: the cap is still 1
    for target_s, tokens_per_s, want in ((1.5, 1000.0, 1500), (0.1, 2.0, 1)):
        got = mod.max_num_queued_tokens_for(target_s, tokens_per_s)
        assert type(got) is int and got == want, (
            f"max_num_queued_tokens_for({target_s}, {tokens_per_s}) = {got!r}, "
            f"expected the int {want}")
        AdmissionLimits(max_num_queued_tokens=got)  # raises unless an int >= 1


def check_queued_tokens_cap_refuses_a_target_or_throughput_that_is_not_positive(mod) -> None:
    for target_s, tokens_per_s, field in ((0.0, 1000.0, "ttft_target_s"),
                                          (-1.0, 1000.0, "ttft_target_s"),
                                          (1.0, 0.0, "prefill_tokens_per_s"),
                                          (1.0, math.inf, "prefill_tokens_per_s")):
        raises_naming(field, lambda t=target_s, p=tokens_per_s: mod.max_num_queued_tokens_for(t, p),
                       f"max_num_queued_tokens_for({target_s}, {tokens_per_s})")


# ---- the first move of the troubleshooting order: two halves -------------------------------------


def _splits(arrivals) -> list[RequestSplit]:
    return [RequestSplit(f"r{i}", None, float(t), 16, 8, 0.0, 0.01, 0.05)
            for i, t in enumerate(arrivals)]


def _ids(part, what: str) -> list[str]:
    assert isinstance(part, list), f"{what}: expected a list, got {type(part).__name__}"
    return [s.request_id for s in part]


def _check_halves(mod, splits, want_first: int, what: str) -> None:
    got = mod.arrival_halves(list(splits))
    assert isinstance(got, tuple) and len(got) == 2, (
        f"arrival_halves of {what}: expected (first, second)")
    first, second = _ids(got[0], f"first half of {what}"), _ids(got[1], f"second half of {what}")
    ids = [s.request_id for s in splits]
    assert (first, second) == (ids[:want_first], ids[want_first:]), (
        f"arrival_halves of {what}: {len(first)} + {len(second)} requests, expected {want_first} + "
        f"{len(ids) - want_first}, the same objects, in arrival order")


def check_arrival_halves_split_the_window_by_time_not_by_count(mod) -> None:
    steady = [float(t) for t in range(20)]  # one request a second for 20 s ...
    flood = [15.0 + i / 6 for i in range(1, 25)]  # ... and 24 more in its last 4 s
    # the window is 0..19 s: its middle is 9.5 s; 10 steady requests before it, the flood all after
    _check_halves(mod, _splits(sorted(steady + flood)), 10,
                  "20 steady requests and a flood at the end")


def check_arrival_halves_measure_the_window_from_the_first_arrival(mod) -> None:
    _check_halves(mod, _splits([100.0, 101.0, 102.5, 104.0, 106.0, 107.0, 110.0]), 4,
                  "arrivals from 100 s to 110 s (middle 105 s)")


def check_arrival_halves_put_a_request_at_the_middle_in_the_second_half(mod) -> None:
    _check_halves(mod, _splits([0.0, 1.0, 2.0]), 1,
                  "arrivals 0, 1, 2 s (the one at 1 s is at the middle)")
    _check_halves(mod, _splits([3.0]), 0, "a single request (its arrival is the whole window)")
    _check_halves(mod, [], 0, "no requests")


def check_arrival_halves_match_the_engine(mod) -> None:
    rng = random.Random(SEED + 4)
    for _ in range(TRIALS):
        now, arrivals = rng.uniform(0, 1000), []
        for _ in range(rng.randint(1, 60)):
            arrivals.append(round(now, 2))
            # ties, lulls and bursts
            now += rng.choice([0.0, rng.expovariate(0.5), rng.expovariate(5.0)])
        n = len(arrivals)
        splits = _splits(arrivals)
        want = len(engine_arrival_halves(list(splits))[0])
        _check_halves(mod, splits, want,
                      f"{n} random arrivals (the engine puts {want} in the first half)")

"""Chapter 10 reference answers: a token bucket, the Retry-After header, the queue caps' decision,
the max_num_queued_tokens that keeps TTFT near a target, and the two halves of a run that the
troubleshooting order compares."""

from __future__ import annotations

import math

from engine.serving.diagnose import RequestSplit


class TokenBucket:
    """`burst` tokens at most, refilled at `rate_per_s` per second; it starts full.
    Time is whatever `now` says."""

    def __init__(self, rate_per_s: float, burst: float):
        for name, value in (("rate_per_s", rate_per_s), ("burst", burst)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number")
        self.rate_per_s, self.burst = float(rate_per_s), float(burst)
        self.level = float(burst)  # a new tenant may send a whole burst at once
        self.updated: float | None = None  # the latest clock reading we have seen

    def refill(self, now: float) -> None:
        if self.updated is not None and now > self.updated:  # a reading from the past adds nothing
            self.level = min(self.burst, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now if self.updated is None else max(self.updated, now)

    def wait_s(self, amount: float, now: float) -> float:
        self.refill(now)
        if amount > self.burst:
            return math.inf  # the bucket never holds that much: waiting would not help
        return max(0.0, (amount - self.level) / self.rate_per_s)

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount


def retry_after_header(retry_after_s: float | None) -> str | None:
    """Whole seconds, rounded up and at least 1; None when waiting would not help (None or inf)."""
    if retry_after_s is None or math.isinf(retry_after_s):
        return None
    return str(max(1, math.ceil(retry_after_s)))


def queue_cap_rejection(num_requests: int, num_queued_tokens: int, num_prompt_tokens: int,
                        max_num_queued_reqs: int | None,
                        max_num_queued_tokens: int | None) -> str | None:
    """The cap a new request would break ("max_num_queued_reqs" first), or None to admit it."""
    if max_num_queued_reqs is not None and num_requests >= max_num_queued_reqs:
        return "max_num_queued_reqs"
    if (max_num_queued_tokens is not None and num_queued_tokens > 0  # alone, a long prompt gets in
            and num_queued_tokens + num_prompt_tokens > max_num_queued_tokens):
        return "max_num_queued_tokens"
    return None


def max_num_queued_tokens_for(ttft_target_s: float, prefill_tokens_per_s: float) -> int:
    """The largest whole number of queued prompt tokens prefilled within the target (at least 1)."""
    for name, value in (("ttft_target_s", ttft_target_s),
                        ("prefill_tokens_per_s", prefill_tokens_per_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive number")
    return max(1, math.floor(ttft_target_s * prefill_tokens_per_s))


def arrival_halves(splits: list[RequestSplit]) -> tuple[list[RequestSplit], list[RequestSplit]]:
    """The requests that arrived before the middle of the arrival window, and the rest
    (split by time)."""
    if not splits:
        return [], []
    mid = (splits[0].arrival_time + splits[-1].arrival_time) / 2
    return [s for s in splits if s.arrival_time < mid], [s for s in splits if s.arrival_time >= mid]

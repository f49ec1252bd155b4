"""Chapter 10 exercises: saying no early (a token bucket, the Retry-After header, the queue caps),
sizing a cap from a TTFT target, and the first move of the troubleshooting order
(compare two halves of a run).

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch10

The gates in front of the engine (engine/serving/admission.py), checked when a request arrives:

    new request ──► its tenant's token bucket      empty ─────► 429 + Retry-After (that tenant only)
                ──► requests in flight >= max_num_queued_reqs ───► 503 + Retry-After (everybody)
                ──► queued prompt tokens + this prompt > max_num_queued_tokens ──► 503 + Retry-After
                ──► admitted

A token bucket holds at most `burst` tokens and refills at `rate_per_s` per second, on the clock we
are GIVEN (`now`, in seconds: a fake clock in a test, the engine's clock in the server;
never time.time()):

    rate 2/s, burst 5, each request costs 1

    now   0.0   0.0   0.0   0.0   0.0   0.0          0.5               100.0
    level 5->4  4->3  3->2  2->1  1->0  0: wait 0.5 s  refilled to 1, 1->0  refilled to 5, not 199:
                                                                            the burst caps it

`TokenBucket` and `arrival_halves` have the engine's names and signatures
(engine/serving/admission.py, engine/serving/diagnose.py) and the engine's own versions pass the
same checks; try not to peek until yours do.
"""

from __future__ import annotations

import math  # noqa: F401

from engine.serving.diagnose import RequestSplit


class TokenBucket:
    """`burst` tokens at most, refilled at `rate_per_s` per second; it starts full.
    Time is whatever `now` says."""

    def __init__(self, rate_per_s: float, burst: float):
        """A ValueError naming the field unless rate_per_s and burst are finite and > 0. Keep both,
        the level (it starts FULL: a new tenant may send a whole burst at once) and the last `now`
        seen (none yet)."""
        raise NotImplementedError(
            "which numbers make no sense for a rate or a burst? How full is a new tenant's "
            "bucket, and which clock reading has it seen?")

    def refill(self, now: float) -> None:
        """Add (now - the last reading) x rate_per_s, but never past `burst`; remember `now`. A
        reading earlier than the last one (clocks of two threads) adds nothing, and the later
        reading is kept."""
        raise NotImplementedError(
            "how many tokens did the time since the last reading bring, and what caps them? What "
            "should a reading from the past do, and the very first reading?")

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` tokens are there (refill first): 0.0 if they are there now,
        math.inf if amount > burst (the bucket can never hold that much). This is the 429's
        Retry-After, in seconds."""
        raise NotImplementedError(
            "how many tokens are missing after a refill, and how long does the rate take to bring "
            "them? What if the bucket can never hold that many?")

    def take(self, amount: float, now: float) -> None:
        """Pay `amount` tokens (refill first). It does not check: call wait_s first."""
        raise NotImplementedError(
            "what must happen to the level before you pay, so that the time since the last call "
            "counts?")


def retry_after_header(retry_after_s: float | None) -> str | None:
    """The value of HTTP's `Retry-After` header for a wait of `retry_after_s` seconds.

    HTTP counts whole seconds: round UP (a client that obeys it is never early) and say at least 1.
    retry_after_header(0.25) == "1", retry_after_header(2.4) == "3".
    None (no header) when retry_after_s is None or math.inf: the request is bigger than the bucket,
    waiting would not help.
    """
    raise NotImplementedError("which rounding never makes a client come back early? And what does "
                              "round(0.25) tell it?")


def queue_cap_rejection(num_requests: int, num_queued_tokens: int, num_prompt_tokens: int,
                        max_num_queued_reqs: int | None,
                        max_num_queued_tokens: int | None) -> str | None:
    """Which cap a new request of `num_prompt_tokens` would break, or None to admit it.

    The server holds `num_requests` requests (waiting or running) and `num_queued_tokens` prompt
    tokens still to prefill. A cap of None is no cap. In this order:
      "max_num_queued_reqs"    when num_requests is already AT the cap (the new one would be one
                               too many);
      "max_num_queued_tokens"  when the queued tokens plus this prompt go PAST the cap; but a
                               prompt that arrives when nothing is queued always gets in (else a
                               prompt longer than the cap could never be served).
    """
    raise NotImplementedError("at the cap or past it? Check requests first, count this prompt with "
                              "the queued tokens, and mind an empty queue")


def max_num_queued_tokens_for(ttft_target_s: float, prefill_tokens_per_s: float) -> int:
    """The `max_num_queued_tokens` to set so a new request waits at most
    about `ttft_target_s` seconds.

    A new request waits for the prompt tokens queued ahead of it to be prefilled, at
    prefill_tokens_per_s: the largest whole number of tokens prefilled within the target (round
    DOWN: one more token would break it), and at least 1 (the engine refuses a cap of 0). A
    ValueError naming the field unless both are finite and > 0.
    max_num_queued_tokens_for(0.5, 4000) == 2000.
    """
    raise NotImplementedError(
        "how many tokens does prefill get through in ttft_target_s seconds, which way must you "
        "round, and what is the smallest cap the engine accepts? Which inputs make no sense?")


def arrival_halves(splits: list[RequestSplit]) -> tuple[list[RequestSplit], list[RequestSplit]]:
    """The requests that arrived in the first half of the arrival WINDOW, and the rest.

    `splits` are in arrival order (engine.serving.diagnose.request_splits gives them; only
    `.arrival_time` matters here). The window runs from the first arrival to the last; a request
    arriving at its middle or later is in the second half. We split by time, not by count, so that a
    flood in the second half stays there:

        arrivals  |  .  .  .  .  .  .  .  .  .  .  .  .:::::::::|
                  first            ^ middle of the window   last
        by time:  [ first half    ][ second half, flood and all ]

    ([], []) for no requests.
    """
    raise NotImplementedError(
        "where is the middle of the window in time (not in count), and on which side does a "
        "request exactly at it go? And for no requests?")

"""Admission control (chapter 10): say no early, so that the requests we said yes to stay fast.

A server that accepts every request has no defence against overload. Past its capacity the queue
grows without bound, and so does everybody's time to first token, including the users who stayed
within their share. We put gates in front of the engine, checked when a request arrives (on the
engine thread, between two steps, so the counts cannot change under us):

    new request ──► its tenant's token buckets     over the rate ──► 429 + Retry-After
                    (requests/s, tokens/s)                           (that tenant only)
                ──► the server's load              over a cap    ──► 503 + Retry-After (everybody)
                    requests in flight >= max_num_queued_reqs
                    prompt tokens still to prefill + this prompt > max_num_queued_tokens
                ──► admitted: the tenant's buckets pay for it

and deadlines after it: a request that waited longer than `queue_timeout_s` for its first step, or
lived longer than `request_timeout_s`, is aborted (its KV blocks go back to the pool at once).

`max_num_queued_tokens` is a TTFT guard: a new request waits for about (prompt tokens queued ahead
of it) / (prefill tokens per second) before its own prefill starts, so capping the queued tokens at
target TTFT x prefill throughput keeps the admitted requests' TTFT near the target.

A token bucket (one per tenant and resource) holds at most `burst` tokens and refills at `rate` per
second; a request takes what it costs, or waits until the bucket holds that much:

    level  burst ┤████▇▆▅▄                 ▁▂▃▄▅▆▇███    a burst drains it; then one request
               0 ┤        ▃▂▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁             per 1/rate seconds gets through
                 └──────────────────────────────────► time

Everything here is policy and arithmetic on numbers we are given (a clock reading `now`, the load):
no HTTP, no threads, so a unit test can drive it with a fake clock. The server turns a `Rejected`
into the HTTP answer; `AsyncLLMEngine` calls `Admission.admit` and enforces the `Deadlines`.

`Degradation` is the gentler answer to a long queue: a token cap on every request, and while the
queue is long, shorter answers and low-priority requests shed. The server does not apply it yet;
the incident runner does (engine/lab/incidents.py, `run_scenario(..., degradation=...)`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# When the server is full we cannot know when a seat frees up; one second is the smallest
# Retry-After HTTP can say (whole seconds) and about the time a small model needs to
# finish a few requests.
DEFAULT_RETRY_AFTER_S = 1.0
# Past this many tenants' buckets we forget the full ones (a full bucket is the same as a new one),
# so a client inventing a new `user` per request cannot grow the server's memory.
MAX_TRACKED_BUCKETS = 1024

REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens",
                     "tenant_request_rate", "tenant_token_rate")
ABORT_REASONS = ("queue_timeout", "request_timeout", "client_disconnect", "cancelled")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive_or_none(name: str, value) -> None:
    _require(value is None or (isinstance(value, int | float) and not isinstance(value, bool)
                               and math.isfinite(value) and value > 0),
             f"{name}={value!r} must be a positive number (or None for no limit)")


# ---- the token bucket ----------------------------------------------------------------------------


@dataclass
class TokenBucket:
    """`burst` tokens at most, refilled at `rate_per_s`; it starts full.
    Time is whatever `now` says."""

    rate_per_s: float
    burst: float
    level: float = math.nan  # nan: full (set on first use)
    updated: float | None = None

    def __post_init__(self) -> None:
        _positive_or_none("rate_per_s", self.rate_per_s)
        _positive_or_none("burst", self.burst)
        if math.isnan(self.level):
            self.level = float(self.burst)

    def refill(self, now: float) -> None:
        if self.updated is not None and now > self.updated:
            self.level = min(self.burst, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now if self.updated is None else max(self.updated, now)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` tokens are there: 0 now,
        inf if more than the bucket can ever hold."""
        self.refill(now)
        if amount > self.burst:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate_per_s)

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount

    def is_full(self, now: float) -> bool:
        self.refill(now)
        return self.level >= self.burst


# ---- limits, load, decisions ---------------------------------------------------------------------


@dataclass(frozen=True)
class RateLimit:
    """A tenant's rates (None: unlimited).
    A burst defaults to one second's worth (at least one request)."""

    requests_per_s: float | None = None
    tokens_per_s: float | None = None  # tokens = prompt + n x max_tokens: what the request may cost
    request_burst: float | None = None
    token_burst: float | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_s", "request_burst", "token_burst"):
            _positive_or_none(f"RateLimit.{name}", getattr(self, name))

    def buckets(self) -> dict[str, TokenBucket]:
        """A fresh pair of full buckets, keyed by the rejection reason each one gives."""
        out = {}
        if self.requests_per_s is not None:
            burst = self.request_burst or max(1.0, math.ceil(self.requests_per_s))
            out["tenant_request_rate"] = TokenBucket(self.requests_per_s, burst)
        if self.tokens_per_s is not None:
            out["tenant_token_rate"] = TokenBucket(self.tokens_per_s,
                                                   self.token_burst or self.tokens_per_s)
        return out


@dataclass(frozen=True)
class AdmissionLimits:
    """Every knob of overload protection; None everywhere (default) admits everything, as before.

    `tenant_rate` applies to each tenant on its own (every tenant gets its own buckets);
    `tenant_rates` overrides it for named tenants. The timeouts are the server's; a request may ask
    for shorter ones."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    tenant_rate: RateLimit = field(default_factory=RateLimit)
    tenant_rates: dict[str | None, RateLimit] = field(default_factory=dict)
    queue_timeout_s: float | None = None
    request_timeout_s: float | None = None
    retry_after_s: float = DEFAULT_RETRY_AFTER_S

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                       and value >= 1),
                     f"{name}={value!r} must be an integer >= 1 (or None for no cap)")
        for name in ("queue_timeout_s", "request_timeout_s", "retry_after_s"):
            _positive_or_none(name, getattr(self, name))
        rates = [self.tenant_rate, *self.tenant_rates.values()]
        _require(all(isinstance(r, RateLimit) for r in rates),
                 f"tenant_rate and tenant_rates' values must be RateLimit(...)s, got {rates!r}")

    def rate_for(self, tenant: str | None) -> RateLimit:
        return self.tenant_rates.get(tenant, self.tenant_rate)


@dataclass(frozen=True)
class Load:
    """What the server holds right now: requests in flight (waiting or running) and prompt tokens
    still to prefill (the work ahead of a new request's first token)."""

    num_requests: int
    num_queued_tokens: int


def prefill_tokens_left(sequences: Iterable) -> int:
    """Prompt tokens not yet in the KV cache over `sequences` (engine `Request`s, waiting or
    running): a decoding sequence has none left; one preempted by recompute has its prompt and
    outputs again."""
    return sum(0 if s.is_decoding else s.num_uncomputed_tokens
               for s in sequences if not s.is_finished)


class Rejected(Exception):
    """A request turned away at the door: HTTP `status` (429 or 503), a `reason` from
    REJECTION_REASONS, and `retry_after_s` (None when waiting would not help: the request is larger
    than the bucket)."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None):
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after_s = (status, reason, message,
                                                                      retry_after_s)


# ---- the gate ------------------------------------------------------------------------------------


class Admission:
    """Decides, for each arriving request, admit or reject (see the module docstring); keeps the
    tenants' buckets. Not thread-safe: the AsyncLLMEngine calls it from its one engine thread."""

    def __init__(self, limits: AdmissionLimits | None = None):
        self.limits = limits or AdmissionLimits()
        self._buckets: dict[str | None, dict[str, TokenBucket]] = {}

    def admit(self, tenant: str | None, num_prompt_tokens: int, num_tokens: int, load: Load,
              now: float) -> None:
        """Admit a request of `num_prompt_tokens` that may cost `num_tokens` in all
        (prompt + n x max_tokens), charging its tenant's buckets; or raise `Rejected` and change
        nothing. (`check`, then `charge`.)"""
        self.check(tenant, num_prompt_tokens, num_tokens, load, now)
        self.charge(tenant, num_tokens, now)

    def check(self, tenant: str | None, num_prompt_tokens: int, num_tokens: int, load: Load,
              now: float) -> None:
        """Raise `Rejected` if the request may not come in now; charge nothing. The AsyncLLMEngine
        checks, lets the engine validate the request, and charges only a request the engine took:
        bad input never uses up its tenant's rate."""
        buckets = self._tenant_buckets(tenant, now)
        for reason, bucket in buckets.items():
            cost = _cost(reason, num_tokens)
            wait = bucket.wait_s(cost, now)
            if wait > 0:
                raise self._rate_limited(tenant, reason, bucket, cost, wait)
        self._check_load(num_prompt_tokens, load)

    def charge(self, tenant: str | None, num_tokens: int, now: float) -> None:
        for reason, bucket in self._tenant_buckets(tenant, now).items():
            bucket.take(_cost(reason, num_tokens), now)

    def _check_load(self, num_prompt_tokens: int, load: Load) -> None:
        lim, retry = self.limits, self.limits.retry_after_s
        if lim.max_num_queued_reqs is not None and load.num_requests >= lim.max_num_queued_reqs:
            raise Rejected(503, "max_num_queued_reqs",
                           f"the server is full: {load.num_requests} requests are "
                           f"waiting or running (max_num_queued_reqs={lim.max_num_queued_reqs}); "
                           f"retry after {retry:g} s", retry)
        queued, cap = load.num_queued_tokens, lim.max_num_queued_tokens
        # alone, a long prompt gets in
        if cap is not None and queued > 0 and queued + num_prompt_tokens > cap:
            raise Rejected(503, "max_num_queued_tokens",
                           f"the server is full: {queued} prompt tokens are waiting "
                           f"to be prefilled and this request adds {num_prompt_tokens} "
                           f"(max_num_queued_tokens={lim.max_num_queued_tokens}); "
                           f"retry after {retry:g} s", retry)

    def _rate_limited(self, tenant, reason: str, bucket: TokenBucket, cost: float,
                      wait: float) -> Rejected:
        what = "requests" if reason == "tenant_request_rate" else "tokens"
        rate = f"{bucket.rate_per_s:g} {what}/s, burst {bucket.burst:g}"
        if math.isinf(wait):
            return Rejected(429, reason,
                            f"Request too large for tenant {tenant!r}: it may cost {cost:g} {what} "
                            "(prompt + n x max_tokens) but the tenant's bucket holds at most "
                            f"{bucket.burst:g} ({rate}); lower max_tokens or shorten the prompt",
                            None)
        return Rejected(429, reason,
                        f"Rate limit reached for tenant {tenant!r} ({rate}); this request needs "
                        f"{cost:g}, retry after {wait:.2f} s", wait)

    def _tenant_buckets(self, tenant: str | None, now: float) -> dict[str, TokenBucket]:
        if tenant not in self._buckets:
            if len(self._buckets) >= MAX_TRACKED_BUCKETS:
                self._forget_full_buckets(now)
            self._buckets[tenant] = self.limits.rate_for(tenant).buckets()
        return self._buckets[tenant]

    @property
    def num_tracked_tenants(self) -> int:
        """Tenants whose buckets we hold (bounded: see MAX_TRACKED_BUCKETS)."""
        return len(self._buckets)

    def _forget_full_buckets(self, now: float) -> None:
        for tenant in [t for t, bs in self._buckets.items()
                       if all(b.is_full(now) for b in bs.values())]:
            del self._buckets[tenant]

    def deadlines(self, arrival: float, queue_timeout_s: float | None = None,
                  request_timeout_s: float | None = None) -> Deadlines:
        """A request's deadlines: the server's timeouts, or the request's own where shorter."""
        return Deadlines.after(arrival, _shorter(self.limits.queue_timeout_s, queue_timeout_s),
                               _shorter(self.limits.request_timeout_s, request_timeout_s))


def _cost(reason: str, num_tokens: int) -> int:
    return 1 if reason == "tenant_request_rate" else num_tokens


def _shorter(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class Deadlines:
    """Absolute times (on the engine's clock) past which a request is aborted; None: no deadline."""

    queue: float | None = None  # not scheduled yet by then: "queue_timeout"
    total: float | None = None  # not finished by then: "request_timeout"

    @classmethod
    def after(cls, arrival: float, queue_timeout_s: float | None = None,
              request_timeout_s: float | None = None) -> Deadlines:
        _positive_or_none("queue_timeout_s", queue_timeout_s)
        _positive_or_none("request_timeout_s", request_timeout_s)
        return cls(None if queue_timeout_s is None else arrival + queue_timeout_s,
                   None if request_timeout_s is None else arrival + request_timeout_s)

    def expired(self, now: float, started: bool) -> str | None:
        """The reason to abort now ("queue_timeout", "request_timeout"), or None."""
        if self.total is not None and now > self.total:
            return "request_timeout"
        if self.queue is not None and not started and now > self.queue:
            return "queue_timeout"
        return None


# ---- degradation: serve less, rather than nobody -------------------------------------------------

SHED_REASON = "shed_low_priority"  # the Rejected.reason of a request shed while degraded


@dataclass(frozen=True)
class Served:
    """How `Degradation.apply` lets a request in: the `max_tokens` it gets, and why it got less than
    it asked for (`capped`: the token cap; `degraded`: the queue was long)."""

    max_tokens: int
    capped: bool = False
    degraded: bool = False


@dataclass(frozen=True)
class Degradation:
    """What we give up while the queue is long, so that the requests we keep still meet the SLO.

    A queue cap (above) answers overload with "no". Degradation answers with "less": while at least
    `queue_at` requests wait for a seat, every new request gets at most `degraded_max_tokens` output
    tokens (each seat turns over sooner, so the queue drains), and requests of priority
    `shed_priority_from` or more (vLLM: a larger number is less urgent) are refused with 503:

        max_tokens asked ──► min(asked, max_tokens_cap)                      the token cap, always
                         ──► waiting >= queue_at ?  no ──► served as capped
                                                    yes ─► priority >= shed_priority_from ? ─► 503
                                                           else min(capped, degraded_max_tokens)

    A shorter answer is a worse answer, so degrade only what the product can afford to shorten, and
    say so (the finish_reason stays "length"). None everywhere (default) changes nothing.
    """

    max_tokens_cap: int | None = None
    queue_at: int | None = None
    degraded_max_tokens: int | None = None
    shed_priority_from: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens_cap", "queue_at", "degraded_max_tokens"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                       and value >= 1),
                     f"Degradation.{name}={value!r} must be an integer >= 1 (or None: off)")
        shed = self.shed_priority_from
        _require(shed is None or (isinstance(shed, int) and not isinstance(shed, bool)),
                 f"Degradation.shed_priority_from={shed!r} must be an int priority (or None: off)")
        acts = self.degraded_max_tokens is not None or shed is not None
        _require(self.queue_at is not None or not acts,
                 "Degradation: degraded_max_tokens / shed_priority_from need queue_at, the number "
                 "of waiting requests at which we degrade")
        _require(self.queue_at is None or acts,
                 f"Degradation.queue_at={self.queue_at} does nothing without degraded_max_tokens "
                 "or shed_priority_from: set one of them, or leave queue_at None")

    def is_degraded(self, num_waiting: int) -> bool:
        return self.queue_at is not None and num_waiting >= self.queue_at

    def apply(self, max_tokens: int, priority: int, num_waiting: int) -> Served:
        """The `Served` terms of a request asking for `max_tokens` at `priority` while
        `num_waiting` requests wait for a seat; or raise `Rejected` (503, SHED_REASON)."""
        cap = self.max_tokens_cap
        served = Served(max_tokens) if cap is None or max_tokens <= cap else Served(cap, True)
        if not self.is_degraded(num_waiting):
            return served
        if self.shed_priority_from is not None and priority >= self.shed_priority_from:
            raise Rejected(503, SHED_REASON,
                           f"the server is degraded: {num_waiting} requests wait for a seat "
                           f"(queue_at={self.queue_at}) and priority {priority} >= "
                           f"shed_priority_from={self.shed_priority_from} is shed; retry later "
                           "or with a more urgent priority", DEFAULT_RETRY_AFTER_S)
        low = self.degraded_max_tokens
        if low is None or served.max_tokens <= low:
            return served
        return Served(low, served.capped, True)


# ---- command-line flags (`python -m engine serve`) -----------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The overload-protection flags of `serve` (vLLM's names for the queue caps)."""
    g = p.add_argument_group("overload protection (chapter 10)")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="503 past this many requests waiting or running")
    g.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="503 past this many prompt tokens still to prefill "
                        "(about target TTFT x prefill tok/s)")
    g.add_argument("--queue-timeout-s", type=float, default=None,
                   help="abort a request not started by then")
    g.add_argument("--request-timeout-s", type=float, default=None,
                   help="abort a request not finished by then")
    g.add_argument("--tenant-requests-per-s", type=float, default=None,
                   help="429 past this rate, per tenant")
    g.add_argument("--tenant-tokens-per-s", type=float, default=None,
                   help="429 past this many tokens (prompt + n x max_tokens) per second, "
                        "per tenant")
    g.add_argument("--api-key", action="append", default=None, metavar="TENANT=KEY",
                   help="accept this bearer key as TENANT (repeat it); with any, other keys get "
                        "401 and the tenant comes from the key, else from OpenAI's `user` field")


def limits_from_args(args: argparse.Namespace) -> AdmissionLimits:
    return AdmissionLimits(max_num_queued_reqs=args.max_num_queued_reqs,
                           max_num_queued_tokens=args.max_num_queued_tokens,
                           tenant_rate=RateLimit(args.tenant_requests_per_s,
                                                 args.tenant_tokens_per_s),
                           queue_timeout_s=args.queue_timeout_s,
                           request_timeout_s=args.request_timeout_s)


def api_keys_from_args(items: list[str] | None) -> dict[str, str] | None:
    """["alice=sk-1", "bob=sk-2"] -> {"sk-1": "alice", "sk-2": "bob"} (key -> tenant)."""
    if not items:
        return None
    keys = {}
    for item in items:
        tenant, sep, key = item.partition("=")
        _require(bool(sep and tenant and key),
                 f"--api-key {item!r} must look like TENANT=KEY, e.g. alice=sk-123")
        keys[key] = tenant
    return keys

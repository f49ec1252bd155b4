"""Serving metrics: how fast each request was served, and how well the whole run went.

This is the ONE place servelab computes them. Plots (`engine/viz/`), the demo, the notebooks and the
benchmarks read these numbers; they never re-derive them. Two sources feed it:

- a `Trace` (engine/trace.py): the engine's own record, step by step (`requests_from_trace`);
- client-side timings: a request's arrival and the moment each of its tokens arrived, as a load
  generator or an HTTP client sees them (`RequestTiming(...)`, or `RequestTiming.from_step_times`).

One request's life, on one clock:

    arrival   first scheduled    token 0      token 1   token 2          token 3 = finish
      |-------------|--------------|-----------|---------|------------------|
      |<- queue_s ->|              |<- itl -->|<- itl ->|<----- itl ------>|
      |<--------- ttft_s --------->|<------------ decode: tpot_s = mean itl ------>|
      |<--------------------------------- e2e_s ----------------------------------->|

    queue_s  arrival -> first scheduled: time spent waiting for a seat
             (vllm:request_queue_time_seconds)
    ttft_s   arrival -> first token: what a user stares at before anything appears; queueing +
             prefill (vllm:time_to_first_token_seconds)
    itl_s    the gaps between consecutive tokens, one value per gap: what a streaming reader feels,
             stalls included (vllm:inter_token_latency_seconds)
    tpot_s   (last token - first token) / (tokens - 1): the request's mean pace once it started
             (vllm:request_time_per_output_token_seconds)
    e2e_s    arrival -> finish: the whole wait for a complete answer
             (vllm:e2e_request_latency_seconds)

Over a run: throughput (output tokens per second), the distribution of each latency, goodput
(requests per second that met their latency promise), and Jain's fairness index.

Why percentiles and not means: latency distributions have long tails. One request stuck behind a
long prefill can wait 50x longer than the rest; the mean hides it (or is dragged by it), while the
P99 says "1 user in 100 waited at least this long", which is what a service promises (an SLO). We
report P50 (the typical user), P95 and P99 (the unlucky ones) next to the mean.

Our percentile is the NEAREST RANK one: the P-th percentile of n values is the ceil(P/100 * n)-th
smallest. It is always a value that was really observed (a real request waited exactly that long),
it is easy to check by hand, and on fewer than 100 values P99 is simply the maximum. (numpy's
default interpolates between two neighbours, and Prometheus' `histogram_quantile` interpolates
inside a bucket, so they can differ a little from ours on small samples.)

ITL vs TPOT: both are "time per token", weighted differently. The ITL distribution has one value
per token gap (a request with 500 tokens counts 500 times, like vLLM's histogram); TPOT has one
value per request (each user counts once). A stall shows in ITL's P99 and max, not in mean TPOT.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # metrics reads traces; the trace module never needs us
    from engine.trace import Trace

PERCENTILES = (50, 95, 99)  # the typical user, and the unlucky 1 in 20 and 1 in 100
PROMPT_LENGTH_EDGES = (64, 256, 1024)  # short chat turns / paragraphs / documents / long documents
OUTPUT_LENGTH_EDGES = (32, 128, 512)  # a short answer / a paragraph / a page / a long generation

# the short names of the per-request latencies a bucket table can show
BUCKET_METRIC_NAMES = {"queue_s": "queue", "ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL",
                       "e2e_s": "E2E"}

# Prometheus names vLLM uses for the same per-request quantities (chapter 09's /metrics endpoint).
VLLM_NAMES = {
    "queue_s": "vllm:request_queue_time_seconds",
    "ttft_s": "vllm:time_to_first_token_seconds",
    "itl_s": "vllm:inter_token_latency_seconds",
    "tpot_s": "vllm:request_time_per_output_token_seconds",
    "e2e_s": "vllm:e2e_request_latency_seconds",
    "prompt_tokens": "vllm:request_prompt_tokens",
    "output_tokens": "vllm:request_generation_tokens",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries",  # tokens looked up in the prefix cache
    "prefix_cache_hits": "vllm:prefix_cache_hits",  # of those, tokens found cached (not prefilled)
}


# ---- statistics over a list of values ------------------------------------------------------------


def _observed(values: Iterable[float]) -> list[float]:
    """The values that were measured: nan marks "not defined for this request" and is left out."""
    return [v for v in values if not math.isnan(v)]


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The q-th percentile by nearest rank: the smallest value with at least q% of the data at or
    below it (P50 of [1, 2, 3, 4] is 2; P99 of 20 values is their maximum). nan values are left out;
    nan when nothing is left."""
    if not 0 < q <= 100:
        raise ValueError(f"nearest_rank: q={q!r} must be in (0, 100] (a percentile, e.g. 50 or 99)")
    ordered = sorted(_observed(values))
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def mean(values: Iterable[float]) -> float:
    """The mean of the measured values (nan left out); nan when there are none."""
    values = _observed(values)
    return sum(values) / len(values) if values else math.nan


def std(values: Iterable[float]) -> float:
    """The population standard deviation of the measured values (numpy's default, ddof=0);
    nan when none."""
    values = _observed(values)
    if not values:
        return math.nan
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def jain_fairness(values: Iterable[float]) -> float:
    """Jain's index (sum x)^2 / (n * sum x^2): 1 when every x is equal,
    1/n when one gets everything."""
    values = _observed(values)
    square_sum = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square_sum) if square_sum > 0 else math.nan


@dataclass(frozen=True)
class Distribution:
    """One metric over many observations: how many, the mean,
    P50/P95/P99 (nearest rank) and the max."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        values = _observed(values)
        p50, p95, p99 = (nearest_rank(values, q) for q in PERCENTILES)
        return cls(len(values), mean(values), p50, p95, p99, max(values, default=math.nan))

    def flat(self, prefix: str, unit: str) -> dict[str, float]:
        """{"<prefix>_mean_<unit>": ..., "<prefix>_p50_<unit>": ..., ...}
        for tables and JSON rows."""
        return {f"{prefix}_{k}_{unit}": getattr(self, k)
                for k in ("mean", "p50", "p95", "p99", "max")}


# ---- one request ---------------------------------------------------------------------------------


@dataclass
class RequestTiming:
    """One request's life on one clock (seconds), and the latencies it implies
    (see the module picture).

    `token_times` holds the moment each output token became available (from a trace: the end of the
    step that sampled it; from a client: when it was received). Latencies that a request cannot have
    yet are nan: TTFT before the first token, TPOT and E2E before it finished.
    """

    request_id: str
    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    first_scheduled_time: float | None = None
    finish_time: float | None = None
    # "stop", "length", "abort" (None: unfinished, or not reported)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    tenant: str | None = None
    priority: int = 0
    preemptions: int = 0
    # Engine steps (from a trace only): step-counted latencies do not depend on the machine's speed.
    arrival_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None

    @classmethod
    def from_step_times(cls, step_times_s: Sequence[float], request_id: str = "0",
                        finish_reason: str | None = None) -> RequestTiming:
        """A request served alone, timed per step by its caller (step 0 = prefill + first sample,
        then one token per step); the clock starts at 0 when the first step starts."""
        times, now = [], 0.0
        for dt in step_times_s:
            now += dt
            times.append(now)
        return cls(request_id, 0.0, times, first_scheduled_time=0.0,
                   finish_time=times[-1] if times else None, finish_reason=finish_reason)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def finished(self) -> bool:
        return self.finish_time is not None

    @property
    def queue_s(self) -> float:
        """Arrival -> first scheduled (vllm:request_queue_time_seconds)."""
        return (math.nan if self.first_scheduled_time is None
                else self.first_scheduled_time - self.arrival_time)

    @property
    def ttft_s(self) -> float:
        """Time to first token: arrival -> first token (queueing included)."""
        return self.token_times[0] - self.arrival_time if self.token_times else math.nan

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gap before each token after the first."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, (last - first) / (n - 1): the mean of `itl_s`.
        Defined once the request finished with at least 2 tokens (like vLLM, recorded at the
        end)."""
        if not self.finished or self.output_tokens < 2:
            return math.nan
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        """End to end: arrival -> finish."""
        return math.nan if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def ttft_steps(self) -> float:
        """TTFT in engine steps, counting the arrival step and the first token's step
        (nan without steps)."""
        if self.arrival_step is None or self.first_token_step is None:
            return math.nan
        return float(self.first_token_step - self.arrival_step + 1)


def request_observations(r: RequestTiming) -> dict[str, list[float]]:
    """What one finished request adds to each per-request histogram, keyed like `VLLM_NAMES` (a
    server's /metrics observes these; ITL gives one value per token gap, the others one each).
    Latencies a request does not have (TPOT of a one-token answer, TTFT of a request aborted before
    its first token) are left out, as vLLM does."""
    values = {"queue_s": [r.queue_s], "ttft_s": [r.ttft_s], "itl_s": r.itl_s, "tpot_s": [r.tpot_s],
              "e2e_s": [r.e2e_s], "prompt_tokens": [float(r.prompt_tokens)],
              "output_tokens": [float(r.output_tokens)]}
    return {name: _observed(v) for name, v in values.items()}


def requests_from_trace(trace: Trace) -> list[RequestTiming]:
    """Every request of a trace, in arrival order, with its token times (each token at the end of
    the step that sampled it) and first scheduled time (the start of the first step that fed it)."""
    arrived = {e["request_id"]: e for r in trace.steps for e in r.events
               if e.get("type") == "arrived"}
    tokens: dict[str, list[float]] = {}
    scheduled: dict[str, float] = {}
    for report in trace.steps:
        for s in report.scheduled:
            scheduled.setdefault(s.request_id, report.start_time)
            tokens.setdefault(s.request_id, []).extend([report.end_time] * s.tokens_out)
    out = []
    for rid, r in trace.requests().items():
        e = arrived.get(rid, {})
        out.append(RequestTiming(
            rid, r.arrival_time, tokens.get(rid, []), scheduled.get(rid), r.finish_time,
            r.finish_reason, r.num_prompt_tokens, e.get("tenant"), e.get("priority", 0),
            r.num_preemptions, r.arrival_step, r.first_token_step, r.finish_step))
    return out


# ---- service level objectives and goodput --------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    """A latency promise per request: first token within `ttft_s`, then a pace of at most `tpot_s`
    seconds per token, and (optionally) the whole answer within `e2e_s` (math.inf switches one off;
    vLLM's `--goodput ttft:ms tpot:ms e2el:ms`)."""

    ttft_s: float
    tpot_s: float
    e2e_s: float = math.inf

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SLO.{name}={value!r} must be > 0 seconds (math.inf: no limit)")

    def met_by(self, r: RequestTiming) -> bool:
        """Did this request finish (not aborted) within every limit? A one-token answer has no TPOT
        and cannot miss the pace limit."""
        if not r.finished or r.finish_reason == "abort" or not r.ttft_s <= self.ttft_s:
            return False
        if not r.e2e_s <= self.e2e_s:
            return False
        return math.isnan(r.tpot_s) or r.tpot_s <= self.tpot_s


@dataclass(frozen=True)
class Goodput:
    """How many requests were served within the SLO: per second of the run, and as a fraction.

    Throughput counts every token, even those that came too late to be useful; goodput counts only
    the requests whose user got what was promised. Pushing a server past its capacity raises
    throughput a little and can make goodput collapse: everybody is served, too late.
    """

    slo: SLO
    requests: int
    met: int
    duration_s: float

    @property
    def per_s(self) -> float:
        return self.met / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def fraction(self) -> float:
        return self.met / self.requests if self.requests else math.nan


def goodput(requests: Sequence[RequestTiming], slo: SLO, duration_s: float) -> Goodput:
    """Goodput of `requests` over a run of `duration_s` seconds
    (unfinished requests count as misses)."""
    return Goodput(slo, len(requests), sum(slo.met_by(r) for r in requests), duration_s)


# ---- a whole run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingSummary:
    """A run at a glance. Latencies are distributions over requests (ITL: over token gaps).

    throughput_tok_s = output tokens / duration_s; fairness = Jain's index of each finished
    request's own rate (its output tokens / its E2E), 1.0 when every request got the same pace.
    `steps` and the step-counted TTFT exist only for a trace.
    """

    requests: int
    finished: int
    output_tokens: int
    duration_s: float
    throughput_tok_s: float
    queue_s: Distribution
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    preemptions: int
    fairness: float
    steps: int | None = None
    ttft_steps: Distribution | None = None
    goodput: Goodput | None = None

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.steps if self.steps else math.nan

    def as_dict(self) -> dict:
        """One flat row:
        {"requests", ..., "ttft_mean_s", "ttft_p50_s", ..., "ttft_p99_steps", ...}."""
        out = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}
        for name in ("queue", "ttft", "tpot", "itl", "e2e"):
            out.update(getattr(self, f"{name}_s").flat(name, "s"))
        if self.ttft_steps is not None:
            out.update(self.ttft_steps.flat("ttft", "steps"))
        out["tokens_per_step"] = self.tokens_per_step
        if self.goodput is not None:
            out.update(goodput_per_s=self.goodput.per_s, goodput_fraction=self.goodput.fraction)
        return {k: v for k, v in out.items() if v is not None}


def run_duration(requests: Sequence[RequestTiming]) -> float:
    """Client-side run length: first arrival -> last token or finish (0.0 for no requests)."""
    ends = [t for r in requests for t in (*r.token_times[-1:], r.finish_time) if t is not None]
    if not requests or not ends:
        return 0.0
    return max(ends) - min(r.arrival_time for r in requests)


def summarize(requests: Sequence[RequestTiming], duration_s: float | None = None,
              slo: SLO | None = None, steps: int | None = None) -> ServingSummary:
    """The summary of these requests over `duration_s` (default: `run_duration(requests)`)."""
    duration = run_duration(requests) if duration_s is None else duration_s
    tokens = sum(r.output_tokens for r in requests)
    done = [r for r in requests if r.finished and r.output_tokens > 0]
    return ServingSummary(
        requests=len(requests), finished=len(done), output_tokens=tokens, duration_s=duration,
        throughput_tok_s=tokens / duration if duration > 0 else math.nan,
        queue_s=Distribution.of(r.queue_s for r in requests),
        ttft_s=Distribution.of(r.ttft_s for r in requests),
        tpot_s=Distribution.of(r.tpot_s for r in requests),
        itl_s=Distribution.of(gap for r in requests for gap in r.itl_s),
        e2e_s=Distribution.of(r.e2e_s for r in requests),
        preemptions=sum(r.preemptions for r in requests),
        fairness=jain_fairness(r.output_tokens / r.e2e_s for r in done if r.e2e_s > 0),
        steps=steps,
        ttft_steps=Distribution.of(r.ttft_steps for r in requests) if steps is not None else None,
        goodput=goodput(requests, slo, duration) if slo is not None else None)


def trace_duration(trace: Trace) -> float:
    """A trace's length: from the first arrival (or the first step's start)
    to the last step's end."""
    if not trace.steps:
        raise ValueError("trace_duration: trace has no steps; run the engine for at least one step "
                         "first")
    start = min([trace[0].start_time] + [r.arrival_time for r in trace.requests().values()])
    return trace[-1].end_time - start


def trace_summary(trace: Trace, tenant: str | None = None,
                  slo: SLO | None = None) -> ServingSummary:
    """`summarize` of a trace's requests (with `tenant`: only that tenant's; the duration stays the
    whole run's, so per-tenant throughputs add up to the run's)."""
    duration = trace_duration(trace)
    requests = [r for r in requests_from_trace(trace) if tenant is None or r.tenant == tenant]
    return summarize(requests, duration, slo, steps=len(trace))


def trace_metrics(trace: Trace, tenant: str | None = None, slo: SLO | None = None) -> dict:
    """`trace_summary(...)` as one flat dict (the row format of tables, sweeps and benchmark JSON),
    with the prefix cache's queries, hits and hit rate (`prefix_cache_stats`)."""
    return {**trace_summary(trace, tenant, slo).as_dict(),
            **prefix_cache_stats(trace, tenant).as_dict()}


# ---- buckets: the same metrics for each kind of request ------------------------------------------


def bucket_by(requests: Iterable[RequestTiming], key: Callable[[RequestTiming], Hashable]) -> dict:
    """{key(r): [requests with that key]}, keys in order of first appearance."""
    out: dict = {}
    for r in requests:
        out.setdefault(key(r), []).append(r)
    return out


def prompt_length_label(prompt_tokens: int, edges: Sequence[int] = PROMPT_LENGTH_EDGES) -> str:
    """The bucket of a prompt length: "[0, 64)", "[64, 256)", ..., "[1024, inf)"
    for the default edges."""
    if list(edges) != sorted(set(edges)) or not edges or edges[0] <= 0:
        raise ValueError(f"edges={tuple(edges)!r} must be positive token counts in increasing "
                         "order, e.g. (64, 256, 1024)")
    for lo, hi in zip((0, *edges), edges, strict=False):
        if prompt_tokens < hi:
            return f"[{lo}, {hi})"
    return f"[{edges[-1]}, inf)"


def by_prompt_length(requests: Iterable[RequestTiming],
                     edges: Sequence[int] = PROMPT_LENGTH_EDGES) -> dict[str, list[RequestTiming]]:
    """Requests grouped by prompt length, every bucket present (short to long), empty ones included.

    Why bucket: a long prompt's TTFT is long because its prefill is long, not because the server is
    slow; mixing them into one P99 blames the server for the workload. Per bucket, a regression in
    short-prompt TTFT is not hidden by a few long documents (and the other way round)."""
    requests = list(requests)
    labels = [prompt_length_label(n, edges) for n in (0, *edges)]
    grouped = bucket_by(requests, lambda r: prompt_length_label(r.prompt_tokens, edges))
    return {label: grouped.get(label, []) for label in labels}


def by_output_length(requests: Iterable[RequestTiming],
                     edges: Sequence[int] = OUTPUT_LENGTH_EDGES) -> dict[str, list[RequestTiming]]:
    """Requests grouped by how many tokens they generated, every bucket present (short to long).

    Why: E2E is about TTFT + (n - 1) x TPOT, so it grows with the answer's length n. A week of
    longer answers raises the E2E P99 with no change in the server; per output-length bucket, we
    see which it was (the labels are those of `prompt_length_label`)."""
    requests = list(requests)
    labels = [prompt_length_label(n, edges) for n in (0, *edges)]
    grouped = bucket_by(requests, lambda r: prompt_length_label(r.output_tokens, edges))
    return {label: grouped.get(label, []) for label in labels}


def by_tenant(requests: Iterable[RequestTiming]) -> dict[str | None, list[RequestTiming]]:
    """Requests grouped by tenant (None: requests that gave no tenant),
    in order of first arrival."""
    return bucket_by(requests, lambda r: r.tenant)


BUCKET_TABLE_METRICS = ("ttft_s", "tpot_s", "e2e_s")  # the per-request latencies of a table row


def bucket_table(buckets: Mapping, metrics: Sequence[str] = BUCKET_TABLE_METRICS,
                 percentiles: Sequence[float] = PERCENTILES) -> str:
    """A plain-text table: one row per bucket ({label: [RequestTiming, ...]}, e.g. from
    `by_output_length` or `by_tenant`), the number of requests and, per metric, its nearest-rank
    percentiles in ms. An empty bucket (or a metric no request of it has) shows "-"::

        bucket           n  TTFT P50/P95/P99 ms   TPOT P50/P95/P99 ms ...
        [0, 32)         12      14 /    31 /    40       4 /     6 /     7 ...
    """
    unknown = [m for m in metrics if m not in BUCKET_METRIC_NAMES]
    if unknown:
        raise ValueError(f"bucket_table: metrics {unknown} unknown; choose from "
                         f"{sorted(BUCKET_METRIC_NAMES)}")
    width = max([6] + [len(str(label)) for label in buckets]) + 2
    qs = "/".join(f"P{q:g}" for q in percentiles)
    header = f"{'bucket':<{width}}{'n':>4}" + "".join(
        f"  {BUCKET_METRIC_NAMES[m] + ' ' + qs + ' ms':>{8 * len(percentiles) - 2}}"
        for m in metrics)
    lines = [header]
    for label, rs in buckets.items():
        row = f"{str(label):<{width}}{len(rs):>4}"
        for m in metrics:
            values = [v for r in rs for v in (getattr(r, m) if m == "itl_s" else [getattr(r, m)])]
            cells = [nearest_rank(values, q) * 1e3 for q in percentiles]
            row += "  " + " /".join("     -" if math.isnan(c) else f"{c:6.0f}" for c in cells)
        lines.append(row)
    return "\n".join(lines)


def summarize_buckets(buckets: dict, duration_s: float, slo: SLO | None = None) -> dict:
    """{bucket: ServingSummary} over the whole run's duration
    (so the buckets' throughputs add up)."""
    return {name: summarize(rs, duration_s, slo) for name, rs in buckets.items()}


# ---- the prefix cache (chapter 06) ---------------------------------------------------------------


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups over a run, in tokens, as vLLM counts them: every time a request gets
    its blocks (arrival, or again after a recompute preemption), its tokens are *queried* and the
    cached prefix found is a *hit*. hit_rate = hits / queries (nan when nothing was looked up:
    caching off)."""

    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else math.nan

    def as_dict(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hit_rate}


def prefix_cache_stats(trace: Trace, tenant: str | None = None) -> PrefixCacheStats:
    """Queries and hits from the trace's "prefix_hit" events (with `tenant`: that tenant's requests
    only; a forked sample "<id>#i" belongs to its request's tenant)."""
    tenants: dict[str, str | None] = {}
    queries = hits = 0
    for report in trace.steps:
        for e in report.events:
            kind = e.get("type")
            if kind == "arrived":
                tenants[e["request_id"]] = e.get("tenant")
            elif kind == "forked":
                tenants[e["request_id"]] = tenants.get(e["parent"])
            elif kind == "prefix_hit":
                if tenant is None or tenants.get(e["request_id"]) == tenant:
                    queries += e["num_query_tokens"]
                    hits += e["num_tokens"]
    return PrefixCacheStats(queries, hits)


# ---- speculative decoding (chapter 12) -----------------------------------------------------------


@dataclass(frozen=True)
class SpecDecodeStats:
    """Guesses and what became of them over a run, counted as vLLM's spec-decode metrics do.

    num_drafts: request-steps that verified at least one guess; num_draft_tokens: guesses fed;
    num_accepted_tokens: guesses the target kept; accepted_per_position[i]: drafts whose (i+1)-th
    guess was kept (a guess can only be kept if every guess before it was);
    num_emitted_tokens: tokens those verify steps output (kept guesses + the target's own, less
    any cut by a stop rule)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    num_emitted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Kept guesses / guesses (nan when nothing was guessed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else math.nan

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step yields on average, the target's own one included (vLLM's
        1 + accepted / drafts); nan without drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    def acceptance_by_position(self) -> list[float]:
        """Share of drafts whose (i+1)-th guess was kept, for each position i (vLLM's per-position
        acceptance: accepted at position i / drafts)."""
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.acceptance_rate,
                "spec_mean_acceptance_length": self.mean_acceptance_length,
                "spec_accepted_per_position": list(self.accepted_per_position)}


def spec_decode_stats(trace: Trace | Iterable) -> SpecDecodeStats:
    """Count every verify step of a trace (or of an iterable of StepReports): the scheduled
    requests with `draft_token_ids`."""
    steps = trace.steps if hasattr(trace, "steps") else trace
    drafts = guesses = accepted = emitted = 0
    per_position: list[int] = []
    for report in steps:
        for s in report.scheduled:
            if not s.draft_token_ids:
                continue
            drafts += 1
            guesses += len(s.draft_token_ids)
            accepted += s.num_accepted or 0
            emitted += s.tokens_out
            per_position += [0] * (len(s.draft_token_ids) - len(per_position))
            for i in range(s.num_accepted or 0):
                per_position[i] += 1
    return SpecDecodeStats(drafts, guesses, accepted, tuple(per_position), emitted)

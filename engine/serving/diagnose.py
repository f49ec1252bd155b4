"""Troubleshooting a slow deployment in a fixed order, on a saved `Trace` (chapter 10).

    python -m engine diagnose TRACE.json      # the quality record, if any, is read from the trace

When a service gets slow, the tempting move is to guess (a bad GPU, a noisy neighbour) and to start
tuning. The text gives an order instead, from the cheapest question to the most specific, and we
walk it on the trace, comparing the first half of the run with the second (requests by arrival time,
steps by index):

    (1) where does each request's time go?  queueing | prefill | decode          -> which part grew?
    (2) did the traffic change?             prompt / output lengths, arrival rate, tenants' shares
    (3) is the KV cache under pressure?     block usage, preemptions, prefix-cache hit rate
    (4) is the step itself slower?          the engine's TimeSplit: the forward vs the CPU work
                                            around it (scheduling, sampling, detokenizing: "other")
    (5) did anything change?                the run's configuration, and `config_changed` events
    (6) are the answers still right?        task scores of the version before and after
                                            (quality record)

Each step prints what it sees; the first of these rules that fires, in this order, is the finding:

    traffic_mix_shift       median prompt or output length moved by >= MIX_SHIFT_RATIO
                            between halves
    tenant_flood            arrivals per second grew >= FLOOD_RATE_RATIO and one tenant took
                            the extra
    preemption_storm        >= PREEMPTIONS_PER_REQUEST preemptions per request
                            (the pool is too small)
    prefix_cache_collapse   hit rate fell from >= CACHE_HIT_BEFORE to below
                            CACHE_COLLAPSE_FRACTION of it (with the config change that came
                            just before, if the trace recorded one)
    slow_cpu_outside_forward  the time per step outside the forward grew >= OUTSIDE_GROWTH x and
                            by at least MEASURABLE_S, to at least OUTSIDE_SHARE of the step
                            (a slow tokenizer or detokenizer, a slow sampler)
    quality_regression      a task's score got worse by more than QUALITY_DROP (a rate) or
                            PERPLEXITY_GROWTH x (a perplexity) from the first version scored
                            to the last
    healthy                 none of the above

The order matters because causes mask each other: a flood of requests also fills the KV pool and
preempts, longer prompts also slow each step; we name the first link in the chain. The
thresholds are generous on purpose: a trace from a busy laptop wobbles, a real incident moves
numbers by multiples.

Step (6) is the text's last check: quality, so that wrong answers are never traded for good-looking
latency. Steps (1)-(5) only look for slowness, so a change that makes the service faster AND wrong
(a model pruned or quantized too far, a cache that serves stale answers) passes them all; only task
scores see it. A trace does not hold them, so we read a quality record: the rows of
engine/lab/eval.py (`evaluate_model`, `tasks.evaluate`: {"task", "metric", "value", "n"}) per
version, oldest first,

    {"tinylab": [{"task": "arith", "metric": "exact", "value": 0.81, "n": 16}, ...],
     "tinylab-3-layers": [{"task": "arith", "metric": "exact", "value": 0.0, "n": 16}, ...]}

passed as `diagnose(trace, quality=...)` or stored in `trace.config["quality"]` (the incident runner
does; `python -m engine diagnose` reads it from there). We compare each (task, metric) of the first
version with the last. Without a record, step (6) says that it could not check, and "healthy" only
means "not slow". When an earlier rule fires and quality fell too, the finding stays the earlier
rule's and its summary adds the regression: the order names the first link, and a wrong answer must
never go unmentioned.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

from engine.trace import Trace

MIX_SHIFT_RATIO = 1.5  # a median length 1.5x longer (or shorter) is a different workload
FLOOD_RATE_RATIO = 1.5  # arrivals per second up by half ...
FLOOD_SHARE_GAIN = 0.25  # ... and one tenant's share of them up by 25 points
PREEMPTIONS_PER_REQUEST = 0.2  # one request in five preempted: the pool cannot hold the batch
CACHE_HIT_BEFORE = 0.3  # a prefix cache that was earning its keep ...
CACHE_COLLAPSE_FRACTION = 0.5  # ... and then lost more than half of its hit rate
OUTSIDE_GROWTH = 2.0  # the time around the forward doubled ...
# ... and is no longer a rounding error (the forward's own speed depends on the machine)
OUTSIDE_SHARE = 0.1
# 10 points of a rate: with the few dozen examples a quick eval scores, one answer moves a rate by a
# few points; a change that breaks a task moves it by tens.
QUALITY_DROP = 0.10
PERPLEXITY_GROWTH = 1.2  # a perplexity 20% higher: the model is clearly less sure of the right text
LOWER_IS_BETTER = frozenset({"false_refusal_rate", "perplexity"})  # engine/lab/tasks.py's metrics

MEASURABLE_S = 0.001  # below a millisecond a ratio says nothing
ORDER = ("where the time goes", "traffic mix", "KV cache", "step time split", "changes", "quality")


@dataclass
class Finding:
    """What one step of the order saw (`lines`), and the cause it points at, if any."""

    step: int  # 1..6, in ORDER
    lines: list[str] = field(default_factory=list)
    cause: str | None = None
    why: str = ""


@dataclass
class Diagnosis:
    findings: list[Finding]
    cause: str  # a rule's name (module docstring), or "healthy"
    summary: str

    def text(self) -> str:
        out = []
        for f in self.findings:
            out.append(f"({f.step}) {ORDER[f.step - 1]}")
            out += [f"    {line}" for line in f.lines]
        out.append(f"\nfinding: {self.cause}: {self.summary}")
        return "\n".join(out)


@dataclass
class RequestSplit:
    """One request's time, in seconds and in steps: waiting for a seat, its prefill, its decode."""

    request_id: str
    tenant: str | None
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    queue_s: float
    prefill_s: float
    decode_s: float


# ---- reading the trace ---------------------------------------------------------------------------


def request_splits(trace: Trace) -> list[RequestSplit]:
    """Every finished request (not aborted) that got a token, in arrival order."""
    first_scheduled: dict[str, float] = {}
    tenants: dict[str, str | None] = {}
    for report in trace.steps:
        for s in report.scheduled:
            first_scheduled.setdefault(s.request_id, report.start_time)
        for e in report.events:
            if e.get("type") == "arrived":
                tenants[e["request_id"]] = e.get("tenant")
    out = []
    for r in trace.requests().values():
        if (r.first_token_time is None or r.finish_time is None
                or r.finish_reason in ("abort", "error")):
            continue
        start = first_scheduled.get(r.request_id, r.arrival_time)
        out.append(RequestSplit(r.request_id, tenants.get(r.request_id), r.arrival_time,
                                r.num_prompt_tokens, r.num_output_tokens, start - r.arrival_time,
                                r.first_token_time - start, r.finish_time - r.first_token_time))
    return sorted(out, key=lambda s: s.arrival_time)


def halves(items: list) -> tuple[list, list]:
    mid = len(items) // 2
    return items[:mid], items[mid:]


def arrival_halves(splits: list[RequestSplit]) -> tuple[list[RequestSplit], list[RequestSplit]]:
    """Requests that arrived in the first half of the arrival window, and in the second
    (split by time, not by count: a flood in the second half must not be spread over both)."""
    if not splits:
        return [], []
    mid = (splits[0].arrival_time + splits[-1].arrival_time) / 2
    return [s for s in splits if s.arrival_time < mid], [s for s in splits if s.arrival_time >= mid]


def _median(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def _ratio(after: float, before: float) -> float:
    return after / before if before > 0 else (math.inf if after > 0 else 1.0)


# ---- (1) where the time goes ---------------------------------------------------------------------


def where_time_goes(splits: list[RequestSplit]) -> Finding:
    f = Finding(1)
    first, second = arrival_halves(splits)
    if not first or not second:
        f.lines.append(f"only {len(splits)} finished request(s): too few to compare halves")
        return f
    f.lines.append(f"{len(splits)} finished requests; median seconds, first half -> second half:")
    for part in ("queue_s", "prefill_s", "decode_s"):
        a, b = _median(getattr(s, part) for s in first), _median(getattr(s, part) for s in second)
        f.lines.append(f"{part[:-2]:>8}: {a:8.3f} -> {b:8.3f}{_times(b, a)}")
    e2e = [_median(s.queue_s + s.prefill_s + s.decode_s for s in h) for h in (first, second)]
    f.lines.append(f"{'total':>8}: {e2e[0]:8.3f} -> {e2e[1]:8.3f}{_times(e2e[1], e2e[0])}")
    return f


def _times(after: float, before: float) -> str:
    return f"  (x{after / before:.1f})" if before >= MEASURABLE_S else ""


# ---- (2) traffic mix -----------------------------------------------------------------------------


def traffic_mix(splits: list[RequestSplit]) -> Finding:
    f = Finding(2)
    first, second = arrival_halves(splits)
    if not first or not second:
        return f
    for name, key in (("prompt tokens", "prompt_tokens"), ("output tokens", "output_tokens")):
        a, b = _median(getattr(s, key) for s in first), _median(getattr(s, key) for s in second)
        ratio = _ratio(b, a)
        f.lines.append(f"median {name}: {a:.0f} -> {b:.0f} (x{ratio:.2f})")
        if f.cause is None and not 1 / MIX_SHIFT_RATIO < ratio < MIX_SHIFT_RATIO:
            f.cause, f.why = "traffic_mix_shift", (f"the median {name} per request went from "
                                                  f"{a:.0f} to {b:.0f}: "
                                                  "the workload changed, not the server")
    rates = [_arrival_rate(h) for h in (first, second)]
    f.lines.append(f"arrivals per second: {rates[0]:.2f} -> {rates[1]:.2f}")
    shares = [_tenant_shares(h) for h in (first, second)]
    f.lines.append("tenants' shares: " + "; ".join(", ".join(f"{t}: {p:.0%}" for t, p in s.items())
                                                   for s in shares))
    top, gain = _biggest_gain(*shares)
    if (f.cause is None and _ratio(rates[1], rates[0]) >= FLOOD_RATE_RATIO
            and gain >= FLOOD_SHARE_GAIN):
        f.cause, f.why = "tenant_flood", (f"arrivals went from {rates[0]:.1f}/s to "
                                          f"{rates[1]:.1f}/s and tenant "
                                          f"{top!r} took {gain:.0%} more of them: "
                                          "its requests fill the queue "
                                          "(a per-tenant rate limit or quota protects the others)")
    return f


def _arrival_rate(part: list[RequestSplit]) -> float:
    span = part[-1].arrival_time - part[0].arrival_time
    return (len(part) - 1) / span if span > 0 else math.inf


def _tenant_shares(part: list[RequestSplit]) -> dict:
    counts = Counter(str(s.tenant) for s in part)
    return {t: n / len(part) for t, n in counts.most_common()}


def _biggest_gain(before: dict, after: dict) -> tuple[str | None, float]:
    gains = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in after}
    top = max(gains, key=gains.get, default=None)
    return top, gains.get(top, 0.0)


# ---- (3) the KV cache ----------------------------------------------------------------------------


def kv_cache(trace: Trace, splits: list[RequestSplit]) -> Finding:
    f = Finding(3)
    used = [r.blocks.used / r.blocks.total for r in trace.steps if r.blocks.total]
    if used:
        f.lines.append(f"KV blocks in use: mean {statistics.fmean(used):.0%}, peak {max(used):.0%} "
                       f"of {trace.steps[0].blocks.total}")
    requests = trace.requests()
    preemptions = sum(r.num_preemptions for r in requests.values())
    per_request = preemptions / max(1, len(requests))
    f.lines.append(f"preemptions: {preemptions} over {len(requests)} requests "
                   f"({per_request:.2f} per request)")
    if per_request >= PREEMPTIONS_PER_REQUEST:
        f.cause, f.why = "preemption_storm", (f"{preemptions} preemptions for {len(requests)} "
                                              "requests: the KV pool cannot hold the running "
                                              "batch, so requests are thrown out and recomputed "
                                              "(more blocks, or fewer seats: max_num_seqs)")
    _prefix_cache(trace, splits, f)
    return f


def _prefix_cache(trace: Trace, splits: list[RequestSplit], f: Finding) -> None:
    first, _ = arrival_halves(splits)
    early = {s.request_id for s in first}
    hits = {True: [0, 0], False: [0, 0]}  # in the first half? -> [hit tokens, looked-up tokens]
    for report in trace.steps:
        for e in report.events:
            if e.get("type") == "prefix_hit":
                h = hits[e["request_id"] in early]
                h[0], h[1] = h[0] + e["num_tokens"], h[1] + e["num_query_tokens"]
    if not hits[True][1] and not hits[False][1]:
        f.lines.append("prefix cache: off (no lookups)")
        return
    rate = [h[0] / h[1] if h[1] else math.nan for h in (hits[True], hits[False])]
    f.lines.append(f"prefix-cache hit rate: {rate[0]:.0%} -> {rate[1]:.0%}")
    if (f.cause is None and rate[0] >= CACHE_HIT_BEFORE
            and rate[1] < CACHE_COLLAPSE_FRACTION * rate[0]):
        f.cause, f.why = "prefix_cache_collapse", ("the prefix-cache hit rate fell from "
                                                   f"{rate[0]:.0%} to {rate[1]:.0%}: "
                                                   "prompts stopped sharing their prefix, "
                                                   "so every prompt is prefilled in full")


# ---- (4) the step's time split -------------------------------------------------------------------


def step_time_split(trace: Trace) -> Finding:
    f = Finding(4)
    busy = [r for r in trace.steps if r.scheduled]
    first, second = halves(busy)
    if not first or not second:
        return f
    outside_ms, share = [], 0.0
    for name, part in (("first", first), ("second", second)):
        total = sum(r.time_s.total for r in part)
        forward = sum(r.time_s.prefill + r.time_s.decode for r in part)
        outside_ms.append((total - forward) / len(part) * 1e3)
        share = 1 - forward / total if total > 0 else math.nan
        f.lines.append(f"{name} half: {len(part)} steps of {total / len(part) * 1e3:.1f} ms: "
                       f"forward {forward / len(part) * 1e3:.1f} ms, "
                       "outside it (schedule, sample, detokenize, ...) "
                       f"{outside_ms[-1]:.1f} ms ({share:.0%})")
    # a fast machine's sub-millisecond wobble can double too
    grew_ms = outside_ms[1] - outside_ms[0]
    if (_ratio(outside_ms[1], outside_ms[0]) >= OUTSIDE_GROWTH and grew_ms >= MEASURABLE_S * 1e3
            and share >= OUTSIDE_SHARE):
        f.cause, f.why = "slow_cpu_outside_forward", ("the time outside the forward went from "
                                                      f"{outside_ms[0]:.1f} to "
                                                      f"{outside_ms[1]:.1f} ms per step "
                                                      f"({share:.0%} of it): "
                                                      "the model is as fast as before; "
                                                      "a tokenizer, detokenizer or sampler is not")
    return f


# ---- (5) changes ---------------------------------------------------------------------------------


def changes(trace: Trace) -> Finding:
    f = Finding(5)
    shown = {k: trace.config[k] for k in ("model", "dtype", "attention_backend", "scenario")
             if k in trace.config}
    if isinstance(shown.get("model"), dict):
        shown["model"] = shown["model"].get("model_id", shown["model"].get("name"))
    f.lines.append("configuration: " + (", ".join(f"{k}={v}" for k, v in shown.items())
                                        or "(none recorded)"))
    for report in trace.steps:
        for e in report.events:
            if e.get("type") == "config_changed":
                f.lines.append(f"step {report.step}: {e['what']} changed "
                               f"{e.get('old')!r} -> {e.get('new')!r}")
    return f


def config_changes(trace: Trace) -> list[tuple[int, dict]]:
    return [(r.step, e) for r in trace.steps for e in r.events if e.get("type") == "config_changed"]


# ---- (6) quality ---------------------------------------------------------------------------------


def answer_quality(record: dict | None, splits: list[RequestSplit]) -> Finding:
    """Compare the first and the last version's task scores
    (the quality record: module docstring)."""
    f = Finding(6)
    if not record:
        f.lines.append("no quality record (trace.config['quality']): the trace shows speed, "
                       "not whether the answers are right; score each version with "
                       "engine/lab/eval.py")
        return f
    versions = _check_record(record)
    if len(versions) < 2:
        f.lines.append(f"only one version scored ({versions[0]}): nothing to compare it with")
        return f
    old, new = versions[0], versions[-1]
    before = {(r["task"], r["metric"]): r["value"] for r in record[old]}
    f.lines.append(f"task scores, {old} -> {new}:")
    for r in record[new]:
        a, b = before.get((r["task"], r["metric"])), r["value"]
        if a is None:
            continue
        worse = _got_worse(r["metric"], a, b)
        f.lines.append(f"{r['task']} {r['metric']}: {a:.3f} -> {b:.3f}"
                       f"{'  (worse)' if worse else ''}")
        if worse and f.cause is None:
            f.cause, f.why = "quality_regression", (f"{r['task']} {r['metric']} went from "
                                                    f"{a:.3f} to {b:.3f} "
                                                    f"({old} -> {new}){_latency_note(splits)}: "
                                                    "the answers are "
                                                    "wrong, however fast they come")
    return f


def _check_record(record) -> list[str]:
    """The versions of a quality record, oldest first;
    a malformed record is refused, naming the bad part."""
    if not isinstance(record, dict):
        raise ValueError("quality: must map a version name to its rows of engine/lab/eval.py, "
                         f"got a {type(record).__name__}")
    for version, rows in record.items():
        for i, row in enumerate(rows if isinstance(rows, list) else [rows]):
            ok = isinstance(row, dict) and {"task", "metric", "value"} <= set(row)
            if not ok or not isinstance(row["value"], int | float):
                raise ValueError(f"quality[{version!r}][{i}]: {row!r} is not a row of "
                                 "engine/lab/eval.py; each row needs 'task', 'metric' and a "
                                 "number 'value' (as evaluate_model returns them)")
    return list(record)


def _got_worse(metric: str, before: float, after: float) -> bool:
    base = metric.split("[")[0]  # "accuracy_by_length[128-255]" is an accuracy
    if math.isnan(before) or math.isnan(after):
        return False
    if base == "perplexity":
        return after >= before * PERPLEXITY_GROWTH
    return (after - before if base in LOWER_IS_BETTER else before - after) > QUALITY_DROP


def _latency_note(splits: list[RequestSplit]) -> str:
    first, second = arrival_halves(splits)
    if not first or not second:
        return ""
    e2e = [_median(s.queue_s + s.prefill_s + s.decode_s for s in h) for h in (first, second)]
    return f", while the median request took {e2e[0]:.3f} -> {e2e[1]:.3f} s"


# ---- the walk ------------------------------------------------------------------------------------


def diagnose(trace: Trace, quality: dict | None = None) -> Diagnosis:
    """Walk the order on `trace`; the first rule that fires is the finding (see the module
    docstring). `quality`: the quality record (version -> engine/lab/eval.py rows); default
    `trace.config["quality"]`."""
    splits = request_splits(trace)
    record = quality if quality is not None else trace.config.get("quality")
    findings = [where_time_goes(splits), traffic_mix(splits), kv_cache(trace, splits),
                step_time_split(trace), changes(trace), answer_quality(record, splits)]
    cause = next((f for f in findings if f.cause is not None), None)
    if cause is None:
        return Diagnosis(findings, "healthy",
                         "no rule fired: the traffic, the KV cache and the step time split "
                         "look the same in both halves of the run"
                         + ("" if record else " (no quality record: "
                                              "step 6 could not check the answers)"))
    summary = cause.why
    recorded = config_changes(trace)
    if recorded:
        step, e = recorded[-1]
        summary += (f"; it follows the recorded change at step {step}: "
                    f"{e['what']} {e.get('old')!r} -> {e.get('new')!r}")
    regression = findings[-1]
    if regression.cause is not None and regression is not cause:
        summary += f"; and step (6) found a quality regression too: {regression.why}"
    return Diagnosis(findings, cause.cause, summary)


def main(path: str) -> Diagnosis:
    """`python -m engine diagnose TRACE.json`: print the walk and the finding."""
    try:
        trace = Trace.load(path)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a saved Trace (missing or wrong field {e}); "
                         "save one with Trace.save, "
                         "e.g. python -m engine.lab.incidents --out runs/incidents") from None
    diagnosis = diagnose(trace)
    print(diagnosis.text())
    return diagnosis


__all__ = ["Diagnosis", "Finding", "RequestSplit", "diagnose", "request_splits"]

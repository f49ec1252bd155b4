"""Figures for chapter 09: serving metrics and load, drawn from plain data.

    render_request_timeline       each request's life on one clock (queued, waiting for its first
                                  token, streaming its tokens); one request annotated with queue,
                                  TTFT, ITL, TPOT and E2E
    render_percentiles            a run's latencies sorted from best to worst: mean, P50 and P99
                                  marked, and the P99 / P50 gap that one average hides
    render_buckets                P50 and P99 per prompt-length bucket, one bar per workload: long
                                  prompts that slow down short ones show up in the short bucket
    render_arrivals               arrival processes (Poisson, bursty gamma, steady) as ticks, and
                                  how many requests land in each window
    render_capacity_curve         throughput and goodput against the offered request rate, P50/P99
                                  TTFT and TPOT against their SLO, the knee marked
    render_goodput_vs_throughput  the same sweep as one path:
                                  throughput keeps growing after goodput falls
    capacity_knee                 which rate of a sweep is the knee (the rule is in its docstring)
    render_overload               chapter 10: goodput, P99 TTFT, share turned away against the
                                  offered load, with and without overload protection; the waiting
                                  queue over time

The inputs are plain data: `engine.companions.metrics.RequestTiming`s (from a server's `Trace`
through `requests_from_trace`, or from a client through `BenchRun.timings()`), lists of seconds, and
the result dicts of `engine.serving.bench_serve.benchmark` (vLLM's keys). Every number is computed
by `engine/companions/metrics.py` (`nearest_rank`, `mean`); this file only draws. How to read one
request's timeline::

    arrival   scheduled          token 0   token 1   token 2        token 3 = finish
      |░░░░░░░░░░|▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓|---------|---------|--------------|
      |<-queue-->|                  |<- ITL ->|                         TPOT = mean ITL
      |<------------ TTFT --------->|
      |<------------------------------- E2E ------------------------------------>|

Artists carry a `gid`: request r's spans are "queued:<r>", "first_token_wait:<r>", "streaming:<r>"
and its token ticks "tokens:<r>"; the annotated request's brackets "bracket:queue", "bracket:ttft",
"bracket:itl", "bracket:tpot", "bracket:e2e"; a percentile plot's lines "sorted:<name>",
"mean:<name>", "p50:<name>", "p99:<name>"; bars "p50:<workload>:<bucket>" and
"p99:<workload>:<bucket>"; arrival ticks "arrivals:<name>" and window bars "window:<name>:<k>";
capacity lines "throughput", "goodput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "slo:ttft",
"slo:tpot", "knee"; the path "path".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

from engine.companions.metrics import SLO, RequestTiming, mean, nearest_rank, std
from engine.viz._figure import fail as _fail
from engine.viz._figure import new_figure as _new_figure

MS = 1e3  # seconds -> milliseconds
# the knee: the last rate at which at least 90% of the served requests met the SLO
KNEE_FRACTION = 0.9
# latencies spanning more than this factor get a log axis (else a linear one from 0)
LOG_SCALE_RATIO = 20
# an infinite rate is drawn at this multiple of the highest finite rate (labelled "inf")
INF_POSITION = 2.0
LABEL_FLIP = 0.75  # a point label past this share of the axis is written to the left of its point
ROW_HEIGHT = 0.6  # a timeline bar; rows are 1 apart
ROW_INCHES = 0.42  # figure height per timeline row
MAX_ROWS = 40  # a timeline of more requests stops being readable: we refuse and say so
BRACKET_GAP = 0.32  # vertical distance between two stacked brackets, in row units
COLORS = {"queued": "0.8", "first_token_wait": "tab:orange", "streaming": "lightsteelblue",
          "tokens": "tab:blue", "mean": "tab:red", "p50": "tab:green", "p95": "tab:orange",
          "p99": "tab:purple"}
QUANTILES = (50, 95, 99)  # the typical user, the unlucky 1 in 20, the unlucky 1 in 100
QUANTILE_STYLES = {50: "o-", 95: "^-.", 99: "s--"}
WORKLOAD_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")




# ---- one request's life --------------------------------------------------------------------------


def _spans(r: RequestTiming) -> list[tuple[str, float, float]]:
    """(kind, start, end) of a request's coloured spans, in seconds on its own clock."""
    out = []
    first_wait_start = r.arrival_time
    if r.first_scheduled_time is not None:
        out.append(("queued", r.arrival_time, r.first_scheduled_time))
        first_wait_start = r.first_scheduled_time
    if r.token_times:
        out.append(("first_token_wait", first_wait_start, r.token_times[0]))
        end = r.finish_time if r.finish_time is not None else r.token_times[-1]
        out.append(("streaming", r.token_times[0], end))
    return out


def _draw_request_row(ax, y: float, r: RequestTiming, t0: float) -> None:
    for kind, start, end in _spans(r):
        ax.add_patch(Rectangle((start - t0, y - ROW_HEIGHT / 2), max(end - start, 0.0), ROW_HEIGHT,
                               facecolor=COLORS[kind], edgecolor="none",
                               gid=f"{kind}:{r.request_id}"))
    if r.token_times:
        ax.vlines([t - t0 for t in r.token_times], y - ROW_HEIGHT / 2, y + ROW_HEIGHT / 2,
                  color=COLORS["tokens"], linewidth=1.0, gid=f"tokens:{r.request_id}")
    ax.plot([r.arrival_time - t0], [y], marker="|", markersize=14, color="black")


def _bracket(ax, x0: float, x1: float, y: float, label: str, gid: str) -> None:
    """A double-headed arrow from x0 to x1 at height y, its label above the middle."""
    ax.annotate("", xy=(x0, y), xytext=(x1, y), gid=gid,
                arrowprops={"arrowstyle": "<->", "color": "black", "lw": 1.1, "shrinkA": 0,
                            "shrinkB": 0})
    ax.text((x0 + x1) / 2, y + 0.04, label, ha="center", va="bottom", fontsize=8,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 0.5})


def _annotate_request(ax, r: RequestTiming, t0: float) -> None:
    """Row 0 of `ax` is request r alone: the longest ITL above its bar; queue (when known), TTFT,
    the decode part with its TPOT, and E2E in brackets stacked below it."""
    a, level = r.arrival_time - t0, -ROW_HEIGHT / 2 - BRACKET_GAP
    if r.first_scheduled_time is not None:
        _bracket(ax, a, r.first_scheduled_time - t0, level, f"queue {r.queue_s * MS:.0f} ms",
                 "bracket:queue")
        level -= BRACKET_GAP
    if r.token_times:
        _bracket(ax, a, r.token_times[0] - t0, level, f"TTFT {r.ttft_s * MS:.0f} ms",
                 "bracket:ttft")
        level -= BRACKET_GAP
    gaps = r.itl_s
    if gaps:
        k = max(range(len(gaps)), key=gaps.__getitem__)
        _bracket(ax, r.token_times[k] - t0, r.token_times[k + 1] - t0, ROW_HEIGHT / 2 + 0.12,
                 f"longest ITL {gaps[k] * MS:.0f} ms", "bracket:itl")
        tpot = "" if math.isnan(r.tpot_s) else f": TPOT = mean ITL = {r.tpot_s * MS:.0f} ms"
        _bracket(ax, r.token_times[0] - t0, r.token_times[-1] - t0, level,
                 f"{len(gaps)} gaps after the first token{tpot}", "bracket:tpot")
        level -= BRACKET_GAP
    if r.finished:
        _bracket(ax, a, r.finish_time - t0, level, f"E2E {r.e2e_s * MS:.0f} ms", "bracket:e2e")
        level -= BRACKET_GAP
    ax.set_ylim(level + BRACKET_GAP / 2 - 0.1, ROW_HEIGHT / 2 + 0.55)


def _timeline_legend(ax) -> None:
    handles = [Patch(facecolor=COLORS[k], label=label) for k, label in (
        ("queued", "queued (no seat yet)"), ("first_token_wait", "until the first token (prefill)"),
        ("streaming", "streaming"))]
    handles.append(plt.Line2D([], [], color=COLORS["tokens"], label="a token arrives"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=8,
              frameon=False)


def render_request_timeline(requests: Sequence[RequestTiming], annotate: int | None = 0,
                            title: str = "") -> Figure:
    """One row per request (top to bottom, in the order given) on one clock that starts at the first
    arrival: grey while queued (only known from a server's trace), orange until its first token,
    pale blue while it streams, a blue tick per token. With `annotate` (an index; None for none) a
    panel on top shows that request alone with brackets for its queue time, TTFT, longest
    inter-token gap, the decode part with its TPOT, and its E2E."""
    func = "render_request_timeline"
    if not requests:
        _fail(func, "requests", "is empty: give at least one RequestTiming")
    if len(requests) > MAX_ROWS:
        _fail(func, "requests",
              f"has {len(requests)} requests; draw at most {MAX_ROWS} (a slice of the run)")
    if annotate is not None and not 0 <= annotate < len(requests):
        _fail(func, "annotate", f"={annotate} must be an index in [0, {len(requests) - 1}] or None")
    t0 = min(r.arrival_time for r in requests)
    ends = [t for r in requests for t in (r.finish_time, *r.token_times[-1:], r.arrival_time)
            if t is not None]
    rows_inches = 1.2 + ROW_INCHES * len(requests)
    if annotate is None:
        fig, axes = _new_figure((11.0, rows_inches))
        ax = axes[0][0]
    else:
        fig, axes = _new_figure((11.0, rows_inches + 2.6), 2, 1, height_ratios=(2.6, rows_inches))
        one, ax = axes[0][0], axes[1][0]
        r = requests[annotate]
        _draw_request_row(one, 0, r, t0)
        _annotate_request(one, r, t0)
        one.set_yticks([0], [str(r.request_id)[:18]], fontsize=8)
        one.set_title(f"one request, measured: {r.output_tokens} tokens", fontsize=9, loc="left")
    for i, r in enumerate(requests):
        _draw_request_row(ax, -i, r, t0)
    ax.set_yticks([-i for i in range(len(requests))], [str(r.request_id)[:18] for r in requests],
                  fontsize=8)
    ax.set_ylim(-len(requests) + 0.4, 0.6)
    ax.set_xlim(0, (max(ends) - t0) * 1.02 or 1.0)
    if annotate is not None:  # the annotated request zoomed to its own life, on the same clock
        r = requests[annotate]
        own = [t for t in (r.finish_time, *r.token_times[-1:]) if t is not None] or [r.arrival_time]
        pad = 0.03 * (max(own) - r.arrival_time) or 0.01
        one.set_xlim(r.arrival_time - t0 - pad, max(own) - t0 + pad)
    ax.set_xlabel("seconds since the first arrival (| marks each request's arrival)")
    _timeline_legend(ax)
    fig.suptitle(title or "Each request on one clock: queue, TTFT, ITL, TPOT and E2E", fontsize=10)
    return fig


# ---- percentiles ---------------------------------------------------------------------------------


def _finite(func: str, name: str, values: Sequence[float]) -> list[float]:
    kept = [float(v) for v in values if not math.isnan(v)]
    if not kept:
        _fail(func, "samples",
              f"[{name!r}] holds no measured value: give at least one latency in seconds")
    return kept


def render_percentiles(samples: Mapping[str, Sequence[float]], title: str = "") -> Figure:
    """One panel per metric (e.g. {"TTFT": [...], "TPOT": [...]}, seconds): its values sorted from
    best to worst against their percentile rank, with the mean, P50, P95 and P99 (nearest rank) as
    lines and the P99 / P50 ratio written in. A flat curve means everybody waited about as long; a
    hockey stick means a typical user is fine and an unlucky few are not, which the mean alone
    never says."""
    func = "render_percentiles"
    if not samples:
        _fail(func, "samples", "is empty: give {metric name: [seconds, ...]}")
    fig, axes = _new_figure((5.2 * len(samples), 4.3), 1, len(samples))
    for ax, (name, values) in zip(axes[0], samples.items(), strict=True):
        ms = sorted(v * MS for v in _finite(func, name, values))
        ranks = [100 * (k + 1) / len(ms) for k in range(len(ms))]
        ax.step(ranks, ms, where="post", color="0.25", gid=f"sorted:{name}",
                label=f"{len(ms)} values, sorted")
        ax.plot(ranks, ms, ".", color="0.25", markersize=3)
        p50, p95, p99, avg = (*(nearest_rank(ms, q) for q in QUANTILES), mean(ms))
        for key, y, label in (("mean", avg, f"mean {avg:.0f} ms"),
                              ("p50", p50, f"P50 {p50:.0f} ms"), ("p95", p95, f"P95 {p95:.0f} ms"),
                              ("p99", p99, f"P99 {p99:.0f} ms")):
            ax.axhline(y, color=COLORS[key], linestyle="--" if key == "mean" else "-",
                       linewidth=1.2, gid=f"{key}:{name}", label=label)
        ratio = p99 / p50 if p50 > 0 else math.inf
        ax.set(xlabel="percentile rank (% of values at or below)", ylabel=f"{name} (ms)",
               xlim=(0, 101))
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8,
                  frameon=False)
        ax.set_title(f"{name}: P99 / P50 = {ratio:.1f}x", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# ---- buckets -------------------------------------------------------------------------------------


def render_buckets(groups: Mapping[str, Mapping[str, Sequence[float]]], metric: str = "TTFT",
                   title: str = "", bucket_kind: str = "prompt length (tokens)") -> Figure:
    """P50, P95 and P99 of `metric` per bucket (one panel each), one bar per workload, e.g.
    {"short prompts only": {"[0, 64)": [s, ...], ...}, "mixed with long ones": {...}} (seconds).
    `bucket_kind` names what the buckets split ("output length (tokens)", "tenant"). The buckets are
    drawn in the order of the first workload; an empty bucket gets no bar, only "n=0"."""
    func = "render_buckets"
    if not groups:
        _fail(func, "groups", "is empty: give {workload: {bucket: [seconds, ...]}}")
    buckets = list(next(iter(groups.values())))
    if not buckets:
        _fail(func, "groups", "has a workload with no buckets: give at least one bucket of values")
    width = 0.8 / len(groups)
    fig, axes = _new_figure((max(13.0, 1.6 * len(buckets) * 3 + 2), 3.9), 1, len(QUANTILES))
    for ax, q in zip(axes[0], QUANTILES, strict=True):
        for w, (workload, by_bucket) in enumerate(groups.items()):
            for b, bucket in enumerate(buckets):
                values = [v * MS for v in by_bucket.get(bucket, []) if not math.isnan(v)]
                x = b + (w - (len(groups) - 1) / 2) * width
                if values:
                    h = nearest_rank(values, q)
                    ax.bar(x, h, width * 0.92, color=WORKLOAD_COLORS[w % len(WORKLOAD_COLORS)],
                           gid=f"p{q}:{workload}:{bucket}", label=workload if b == 0 else None)
                    # the count above the value, not inside the bar: a short bar has no room
                    ax.text(x, h, f"{h:.0f}\nn={len(values)}", ha="center", va="bottom",
                            fontsize=7, linespacing=1.0)
                else:
                    ax.text(x, 0, "n=0", ha="center", va="bottom", fontsize=6.5, color="0.3")
        ax.set_xticks(range(len(buckets)), buckets)
        ax.set(xlabel=bucket_kind, ylabel=f"{metric} P{q} (ms)")
        ax.set_title(f"P{q} {metric} per {bucket_kind.split(' (')[0]} bucket", fontsize=10)
        ax.margins(y=0.22)
        ax.legend(fontsize=8, frameon=False, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# ---- arrivals ------------------------------------------------------------------------------------


def render_arrivals(processes: Mapping[str, Sequence[float]], window_s: float = 1.0,
                    title: str = "") -> Figure:
    """One row per arrival process ({"Poisson (burstiness 1)": [send offsets in seconds], ...}): a
    tick per request along the top, and bars counting the requests that arrive in each `window_s`
    window. The same mean rate can come as a steady trickle or as bursts that a server must
    queue."""
    func = "render_arrivals"
    if not processes:
        _fail(func, "processes", "is empty: give {name: [arrival offsets in seconds]}")
    if not window_s > 0:
        _fail(func, "window_s", f"={window_s!r} must be > 0 seconds")
    for name, times in processes.items():
        if not times or any(t < 0 or math.isnan(t) for t in times):
            _fail(func, "processes", f"[{name!r}] must be a non-empty list of offsets >= 0 seconds")
    horizon = max(max(t) for t in processes.values())
    windows = int(horizon // window_s) + 1
    fig, axes = _new_figure((11.0, 1.0 + 1.6 * len(processes)), len(processes), 1, sharex=True)
    top = max(max(_window_counts(t, window_s, windows)) for t in processes.values())
    for ax, (name, times) in zip(axes[:, 0], processes.items(), strict=True):
        counts = _window_counts(times, window_s, windows)
        for k, c in enumerate(counts):
            ax.bar(k * window_s, c, window_s * 0.9, align="edge", color="lightsteelblue",
                   gid=f"window:{name}:{k}")
        ax.vlines(times, top * 1.08, top * 1.3, color="black", linewidth=0.8,
                  gid=f"arrivals:{name}")
        ax.axhline(len(times) / windows, color="tab:red", linestyle="--", linewidth=1)
        gaps = [b - a for a, b in zip(sorted(times), sorted(times)[1:], strict=False)]
        # 1 / sqrt(burstiness) in theory
        cv = std(gaps) / mean(gaps) if gaps and mean(gaps) > 0 else 0.0
        ax.set_ylim(0, top * 1.35)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
        ax.set_ylabel(f"per {window_s:g} s", fontsize=8)
        ax.set_title(f"{name}: {len(times)} requests, gaps' CV {cv:.2f}, "
                     f"at most {max(counts)} in one window", fontsize=9, loc="left")
    axes[-1][0].set_xlabel("seconds (ticks: each arrival; bars: arrivals per window; "
                           "dashed: the mean)")
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _window_counts(times: Sequence[float], window_s: float, windows: int) -> list[int]:
    counts = [0] * windows
    for t in times:
        counts[min(int(t // window_s), windows - 1)] += 1
    return counts


# ---- the capacity curve --------------------------------------------------------------------------

CAPACITY_KEYS = ("request_rate", "request_throughput", "request_goodput", "p50_ttft_ms",
                 "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")


def _sweep(func: str, rows: Sequence[Mapping]) -> list[Mapping]:
    """The rows sorted by offered rate (inf last), after checking they carry what we draw."""
    if not rows:
        _fail(func, "rows", "is empty: give one bench result per request rate")
    for r in rows:
        missing = [k for k in CAPACITY_KEYS if r.get(k) is None]
        if missing:
            _fail(func, "rows",
                  f"lack {missing}: run engine.serving.bench_serve.benchmark with an SLO (goodput) "
                  "and percentiles=(50, 99)")
    return sorted(rows, key=lambda r: r["request_rate"])


def capacity_knee(rows: Sequence[Mapping], min_fraction: float = KNEE_FRACTION) -> float | None:
    """The knee of a rate sweep: going up in offered rate, the last rate at which at least
    `min_fraction` of the served requests still met the SLO (goodput >= min_fraction x request
    throughput) with every lower rate passing too. None when even the lowest rate fails (the SLO is
    out of reach, or the sweep starts too high). rows: `benchmark(...).result` dicts (vLLM's keys),
    any order."""
    if not 0 < min_fraction <= 1:
        _fail("capacity_knee", "min_fraction", f"={min_fraction!r} must be in (0, 1]")
    knee = None
    for r in _sweep("capacity_knee", rows):
        if not r["request_goodput"] >= min_fraction * r["request_throughput"]:
            break
        knee = r["request_rate"]
    return knee


def _positions(rates: Sequence[float]) -> tuple[list[float], list[str]]:
    """Where each offered rate goes on a log axis (inf: INF_POSITION x the highest finite)
    and its label."""
    finite = [r for r in rates if math.isfinite(r)]
    inf_at = INF_POSITION * max(finite) if finite else 1.0
    return ([r if math.isfinite(r) else inf_at for r in rates],
            [f"{r:g}" if math.isfinite(r) else "inf" for r in rates])


def _rate_axis(ax, x: list[float], labels: list[str]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(x, labels)
    ax.minorticks_off()
    ax.set_xlabel("offered request rate (req/s; inf = all at once)")


def _latency_panel(ax, x, rows, metric: str, limit_s: float | None,
                   log: bool | None = None) -> None:
    """P50, P95 (when every row has it) and P99 of `metric` against the rate, the SLO's limit as a
    line. log None: a log axis when the values span more than LOG_SCALE_RATIO."""
    qs = [q for q in QUANTILES if q != 95 or all(r.get(f"p95_{metric}_ms") is not None
                                                 for r in rows)]
    for q in qs:
        ax.plot(x, [r[f"p{q}_{metric}_ms"] for r in rows], QUANTILE_STYLES[q],
                color=COLORS[f"p{q}"], label=f"P{q}", gid=f"{metric}_p{q}")
    if limit_s is not None and math.isfinite(limit_s):
        ax.axhline(limit_s * MS, color="tab:red", linewidth=1.2, gid=f"slo:{metric}",
                   label=f"SLO {limit_s * MS:g} ms")
    values = ([r[f"p{q}_{metric}_ms"] for r in rows for q in qs]
              + ([limit_s * MS] if limit_s and math.isfinite(limit_s) else []))
    if log is None:
        log = min(values) > 0 and max(values) / min(values) > LOG_SCALE_RATIO
    if log and min(values) > 0:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_ylabel(f"{metric.upper()} (ms, log scale)")
    else:
        ax.set_ylim(0, max(v for v in values if math.isfinite(v)) * 1.15)
        ax.set_ylabel(f"{metric.upper()} (ms)")
    # below the panel, beside the left panel's: a legend inside would sit on the climbing lines
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)


def render_capacity_curve(rows: Sequence[Mapping], slo: SLO | None = None,
                          min_fraction: float = KNEE_FRACTION, title: str = "") -> Figure:
    """Left: request throughput and goodput against the offered rate (dotted: served = offered), the
    knee (`capacity_knee`) as a vertical line. Middle and right: P50, P95 (when the rows have it)
    and P99 of TTFT (always a log axis) and TPOT, with the SLO's limits. rows: one
    `benchmark(...).result` per rate (percentiles (50, 95, 99) or at least (50, 99), and an SLO)."""
    rows = _sweep("render_capacity_curve", rows)
    x, labels = _positions([r["request_rate"] for r in rows])
    knee = capacity_knee(rows, min_fraction)
    fig, axes = _new_figure((14.0, 4.6), 1, 3)
    ax, ax_ttft, ax_tpot = axes[0]
    # throughput wide and pale underneath, goodput thin on top: where they agree, both still show
    ax.plot(x, [r["request_throughput"] for r in rows], "o-", color="tab:blue", alpha=0.4,
            linewidth=6, markersize=10, label="throughput (served)", gid="throughput")
    ax.plot(x, [r["request_goodput"] for r in rows], "s-", color="tab:green", linewidth=1.5,
            markersize=5, label="goodput (within SLO)", gid="goodput")
    finite = [xi for xi, r in zip(x, rows, strict=True) if math.isfinite(r["request_rate"])]
    if finite:
        ax.plot([min(finite), max(finite)], [min(finite), max(finite)], ":", color="0.5",
                label="served = offered")
    ax.set_ylabel("requests / s")
    ax.set_ylim(0, 1.3 * max(r["request_throughput"] for r in rows))  # the diagonal leaves the plot
    # a queue multiplies TTFT by orders of magnitude: always a log axis, so both ends stay readable
    _latency_panel(ax_ttft, x, rows, "ttft", slo.ttft_s if slo else None, log=True)
    _latency_panel(ax_tpot, x, rows, "tpot", slo.tpot_s if slo else None)
    for a, name in ((ax, "throughput and goodput"), (ax_ttft, "time to first token"),
                    (ax_tpot, "time per output token")):
        _rate_axis(a, x, labels)
        a.set_title(name, fontsize=10)
        if knee is not None:
            # every rate passed: the knee lies beyond the sweep
            last = knee == rows[-1]["request_rate"]
            a.axvline(x[[r["request_rate"] for r in rows].index(knee)], color="black", linewidth=1,
                      linestyle="-.", gid="knee",
                      label=(("every rate within SLO" if last else f"knee {knee:g} req/s")
                             if a is ax else None))
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def render_goodput_vs_throughput(rows: Sequence[Mapping], title: str = "") -> Figure:
    """The sweep as one path, offered rate rising along it: request throughput (x) against goodput
    (y). On the dotted diagonal every served request met its SLO; past the knee the path turns down
    and right: the server serves more requests per second than ever, and fewer of them are any
    use."""
    rows = _sweep("render_goodput_vs_throughput", rows)
    _, labels = _positions([r["request_rate"] for r in rows])
    tp, gp = [r["request_throughput"] for r in rows], [r["request_goodput"] for r in rows]
    fig, axes = _new_figure((6.4, 4.6))
    ax = axes[0][0]
    top = max(tp) * 1.1
    ax.plot([0, top], [0, top], ":", color="0.5",
            label="goodput = throughput (every request within SLO)")
    ax.plot(tp, gp, "o-", color="tab:green", gid="path", label="measured, offered rate rising")
    for k, (xi, yi, label) in enumerate(zip(tp, gp, labels, strict=True)):
        # near the right edge: written on the left; every other label below its point, so two
        # neighbouring rates that land on the same spot past the knee do not overprint
        right, below = xi > LABEL_FLIP * top, k % 2 == 1
        ax.annotate(f"{label} req/s", (xi, yi), textcoords="offset points",
                    xytext=(-6 if right else 6, -6 if below else 6),
                    ha="right" if right else "left", va="top" if below else "bottom", fontsize=8,
                    gid=f"label:{label}")
    ax.set(xlabel="throughput (requests served / s)", ylabel="goodput (requests within SLO / s)",
           xlim=(0, top), ylim=(0, top))
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.set_title(title or "Goodput vs throughput over a rate sweep", fontsize=10)
    return fig


# ---- overload, with and without protection (chapter 10) ------------------------------------------

OVERLOAD_KEYS = ("protection", "load_x", "goodput_x_capacity", "p99_ttft_s", "rejected_share")
# others: the default cycle
PROTECTION_STYLES = {"none": ("o-", "tab:red"), "protected": ("s-", "tab:green")}


def render_overload(rows: Sequence[Mapping], series: Mapping[str, Sequence[Mapping]] | None = None,
                    title: str = "") -> Figure:
    """The overload experiment (benchmarks/results/overload.json) against the offered load, in
    multiples of the capacity: goodput (x capacity), P99 TTFT (log scale), the share of requests
    turned away; one line per `protection`. With `series` (its "series": "<protection>@<load>x" ->
    samples of "t_s" and "waiting"), a fourth panel draws the waiting queue over time at the highest
    load. Gids: "goodput:<p>", "p99_ttft:<p>", "rejected:<p>", "waiting:<p>"."""
    if not rows:
        _fail("render_overload", "rows",
              "is empty: give the rows of benchmarks/results/overload.json")
    for r in rows:
        missing = [k for k in OVERLOAD_KEYS if r.get(k) is None]
        if missing:
            _fail("render_overload", "rows",
                  f"lack {missing}: give the rows of benchmarks/results/overload.json")
    kinds = list(dict.fromkeys(r["protection"] for r in rows))
    fig, axes = _new_figure((15.0, 4.2), 1, 4 if series else 3)
    panels = (("goodput_x_capacity", "goodput (x capacity)", "goodput within SLO", "goodput"),
              ("p99_ttft_s", "P99 TTFT (s, log scale)", "P99 time to first token", "p99_ttft"),
              ("rejected_share", "share rejected or timed out", "turned away", "rejected"))
    for ax, (key, ylabel, name, gid) in zip(axes[0], panels, strict=False):
        for kind in kinds:
            mine = sorted((r for r in rows if r["protection"] == kind), key=lambda r: r["load_x"])
            style, color = PROTECTION_STYLES.get(kind, ("o-", None))
            ax.plot([r["load_x"] for r in mine], [r[key] for r in mine], style, color=color,
                    label=kind, gid=f"{gid}:{kind}")
        ax.axvline(1.0, color="0.5", linestyle=":", linewidth=1)
        ax.set(xlabel="offered load (x capacity)", ylabel=ylabel)
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8, frameon=False, loc="upper left")
    axes[0][1].set_yscale("log")
    axes[0][1].yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    axes[0][1].yaxis.set_minor_locator(NullLocator())
    axes[0][1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0][2].set_ylim(0, 1)
    if series:
        _waiting_panel(axes[0][3], rows, kinds, series)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _waiting_panel(ax, rows: Sequence[Mapping], kinds: list[str],
                   series: Mapping[str, Sequence[Mapping]]) -> None:
    top = max(r["load_x"] for r in rows)
    for kind in kinds:
        samples = series.get(f"{kind}@{top:.1f}x")
        if not samples:
            continue
        style, color = PROTECTION_STYLES.get(kind, ("o-", None))
        ax.plot([s["t_s"] for s in samples], [s["waiting"] for s in samples], "-", color=color,
                label=kind, gid=f"waiting:{kind}")
    ax.set(xlabel="time (s)", ylabel="requests waiting")
    ax.set_title(f"the waiting queue at {top:g}x capacity", fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")

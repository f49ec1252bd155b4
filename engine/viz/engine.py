"""Figures for chapter 05: what the engine did, step by step, drawn from a `Trace`.

    render_timeline            one row per request:
                               waiting / prefill / decode / preempted spans over steps
    render_timeline_comparison the same arrivals under two (or more) configurations, side by side
    render_blocks              the KV block grid at step i (engine/viz/blocks.py draws it)
    render_queues              waiting, running, swapped counts and KV blocks used, over steps
    render_step                all of them at step i: the picture the player redraws
    trace_player               ipywidgets Play + slider over render_step
                               (static fallback: render_step)
    render_step_durations      each step's wall time and tokens, for one or more runs
                               (chunked prefill)
    render_sweep               throughput, TTFT and fairness against a scheduler knob (rows of
                               engine.companions.metrics.trace_metrics)

How to read a timeline (one character per step; the figure draws coloured bars):

    step        0 1 2 3 4 5 6 7 8 9
    req 0       P d d d d                      P prefill, d decode
    req 1       P d d d d d d d                . waiting (arrived, not admitted yet)
    req 2         . . P P d d x . . P d d      P P: a long prompt in two chunks (chunked prefill)
                                               x: preempted here (recompute): back to waiting

A row starts when the request arrives and ends in the step that produced its last token.
"stalled" means admitted (holding KV blocks) but not scheduled in that step
(the token budget ran out).

The numbers behind the pictures are public (`step_states`, `timeline_spans`, `queue_lengths`), so a
test or a reader can check them without a figure; the serving metrics in the titles (throughput,
TTFT, TPOT, fairness) come from `engine/companions/metrics.py`, the one place they are computed.
Artists carry a `gid`: a span is "span:<id>:<state>", a preemption marker "preempted:<id>", a queue
line "queue:<name>".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from engine.companions.metrics import trace_metrics
from engine.trace import StepReport, Trace
from engine.viz._figure import new_figure as _new_figure
from engine.viz.blocks import (
    LEGEND_INCHES,
    BlockGridSnapshot,
    _draw_block_grid,
    _fit_labels,
    columns_to_fill,
    distinct_colors,
    render_block_grid,
)
from engine.viz.widgets import interactive_figure

# What each state looks like. "absent" (not arrived yet) and "finished" are not drawn.
STATE_COLORS = {
    "waiting": "0.82",
    "prefill": "tab:orange",
    "decode": "tab:blue",
    "stalled": "lightsteelblue",
    "preempted": "tab:red",
    "swapped": "tab:purple",
}
DRAWN_STATES = tuple(STATE_COLORS)
QUEUE_COLORS = {"waiting": "0.45", "running": "tab:blue", "swapped": "tab:purple"}
ROW_HEIGHT = 0.7  # of a timeline row (rows are 1 apart): the gap between bars keeps rows apart
ROW_INCHES = 0.26  # figure height per timeline row
MAX_TIMELINE_INCHES = 9.0  # a 200-request timeline still fits on a screen; its labels get small
ROW_LABELS_MAX = 40  # above this many rows we label every k-th row only, so labels do not overlap
# the shade over the current step's column: visible, yet the bars under it stay readable
NOW_ALPHA = 0.12
PLAYER_INTERVAL_MS = 800  # one step per 0.8 s: slow enough to read the step's title
STEP_WIDTH_IN, BOTTOM_ROW_IN = 12.0, 3.6  # render_step's width, and the height of its lower row
# render_step's lower row: the queues panel and the block grid panel, side by side, in this ratio
QUEUES_TO_GRID = (1.1, 1.0)
GRID_TITLE_IN = 0.5  # the grid panel's two-line title



def _check_step(func: str, trace: Trace, i: int) -> int:
    if not trace.steps:
        raise ValueError(f"{func}: trace has no steps; run the engine for at least one step first")
    if not -len(trace) <= i < len(trace):
        raise ValueError(f"{func}: i={i} is outside the trace's steps 0..{len(trace) - 1}")
    return i % len(trace)


# ---- the numbers behind the figures --------------------------------------------------------------


def step_states(report: StepReport) -> dict[str, str]:
    """{request id: state} for every request the step saw (the drawn states, plus "finished" for
    those that finished in it without being scheduled, e.g. aborted while waiting).

    The same rules as `Trace.state_at`, for all requests of a step at once: a timeline is then one
    pass over the steps, instead of a scan of the past for every (request, step) cell.
    """
    q = report.queues
    states = {rid: "stalled" for rid in q.running}
    states.update({rid: "preempted" if rid in q.preempted else "waiting" for rid in q.waiting})
    states.update({rid: "swapped" for rid in q.swapped})
    states.update({rid: "finished" for rid in q.finished if rid not in states})
    states.update({s.request_id: s.phase for s in report.scheduled})
    return states


@dataclass(frozen=True)
class Span:
    """Steps [start, stop) in which a request was in one state."""

    state: str
    start: int
    stop: int


def timeline_spans(trace: Trace, upto_step: int | None = None) -> dict[str, list[Span]]:
    """{request id: its spans}, for every request of the trace in arrival order (steps after
    `upto_step` are left out; a request that had not arrived by then has no spans)."""
    last = len(trace) - 1 if upto_step is None else min(upto_step, len(trace) - 1)
    spans: dict[str, list[Span]] = {rid: [] for rid in trace.request_ids()}
    for i in range(last + 1):
        for rid, state in step_states(trace[i]).items():
            if state not in STATE_COLORS or rid not in spans:
                continue
            row = spans[rid]
            if row and row[-1].state == state and row[-1].stop == i:
                row[-1] = Span(state, row[-1].start, i + 1)
            else:
                row.append(Span(state, i, i + 1))
    return spans


def preemption_steps(trace: Trace, upto_step: int | None = None) -> list[tuple[int, str, str]]:
    """(step, request id, mode) of every preemption, in order."""
    last = len(trace) - 1 if upto_step is None else upto_step
    return [(i, e["request_id"], e.get("mode", "recompute"))
            for i, report in enumerate(trace.steps[:last + 1])
            for e in report.events if e.get("type") == "preempted"]


def describe_step(report: StepReport) -> str:
    """One line: what step i ran ("3 decodes, prefill long [62, 124)") and what happened in it."""
    decodes = [s for s in report.scheduled if s.phase == "decode"]
    prefills = [f"prefill {s.request_id} [{s.start}, {s.end})" for s in report.scheduled
                if s.phase == "prefill" and s.end > s.start]
    work = ([f"{len(decodes)} decode{'s' * (len(decodes) != 1)}"] if decodes else []) + prefills
    events = [f"{e['type']} {e['request_id']}" + (f" ({e['mode']})" if "mode" in e else "")
              for e in report.events if e.get("type") in ("admitted", "preempted", "swapped_in",
                                                          "finished", "aborted")]
    text = f"step {report.step}: " + (", ".join(work) if work else "idle")
    return text + (" | " + ", ".join(events) if events else "")


# ---- the timeline --------------------------------------------------------------------------------


def _draw_timeline(ax, trace: Trace, upto_step: int | None = None, title: str = "") -> None:
    spans = timeline_spans(trace, upto_step)
    rows = list(spans)
    for y, rid in enumerate(rows):
        for s in spans[rid]:
            ax.add_patch(Rectangle((s.start, y - ROW_HEIGHT / 2), s.stop - s.start, ROW_HEIGHT,
                                   facecolor=STATE_COLORS[s.state], edgecolor="white",
                                   linewidth=0.3, gid=f"span:{rid}:{s.state}"))
    where = {rid: y for y, rid in enumerate(rows)}
    for step, rid, _mode in preemption_steps(trace, upto_step):
        if rid in where:
            ax.plot([step + 0.5], [where[rid]], marker="x", color="black", markersize=5,
                    gid=f"preempted:{rid}")
    ax.set_xlim(0, max(len(trace), 1))
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first arrival on top
    ax.set_yticks(range(len(rows)))
    every = math.ceil(len(rows) / ROW_LABELS_MAX)
    ax.set_yticklabels([rid if y % every == 0 else "" for y, rid in enumerate(rows)],
                       fontsize=7 if len(rows) <= ROW_LABELS_MAX else 5)
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    if upto_step is not None:
        _mark_now(ax, upto_step)
    ax.set_title(title or f"{len(rows)} requests over {len(trace)} steps", fontsize=10)


def _mark_now(ax, step: int) -> None:
    """Shade the column [step, step + 1) over whatever is drawn there, with a thin edge, so it reads
    as "now" even where no bar reaches it (only the requests still running end in that column)."""
    ax.axvspan(step, step + 1, facecolor=(0, 0, 0, NOW_ALPHA), edgecolor="black", linewidth=0.6,
               zorder=3, gid="now")


def _state_legend(ax, trace: Trace) -> None:
    seen = {st for row in timeline_spans(trace).values() for st in (s.state for s in row)}
    handles = [Patch(facecolor=STATE_COLORS[s], label=s) for s in DRAWN_STATES if s in seen]
    if preemption_steps(trace):
        handles.append(plt.Line2D([], [], marker="x", color="black", linestyle="none",
                                  label="preempted here"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7,
              frameon=False)


def _timeline_inches(num_rows: int) -> float:
    return min(MAX_TIMELINE_INCHES, 1.2 + ROW_INCHES * num_rows)


def render_timeline(trace: Trace, upto_step: int | None = None, title: str = "") -> Figure:
    """Each request's life over the engine's steps (see the module docstring), up to `upto_step`."""
    if not trace.steps:
        raise ValueError("render_timeline: trace has no steps; "
                         "run the engine for at least one step first")
    fig, axes = _new_figure((9.0, _timeline_inches(len(trace.request_ids()))))
    _draw_timeline(axes[0][0], trace, upto_step, title)
    _state_legend(axes[0][0], trace)
    return fig


def render_timeline_comparison(traces: Mapping[str, Trace], metrics: bool = True) -> Figure:
    """The same arrivals under several configurations, one timeline each, on a shared step axis;
    each title says its throughput and mean TTFT (`trace_metrics`) when `metrics` is True."""
    if not traces or any(not t.steps for t in traces.values()):
        raise ValueError("render_timeline_comparison: traces must be a non-empty {name: Trace}, "
                         "each with at least one step")
    rows = max(len(t.request_ids()) for t in traces.values())
    fig, axes = _new_figure((6.0 * len(traces), _timeline_inches(rows)), 1, len(traces),
                            sharex=True)
    for ax, (name, trace) in zip(axes[0], traces.items(), strict=True):
        title = name
        if metrics:
            m = trace_metrics(trace)
            title += (f"\n{len(trace)} steps, {m['tokens_per_step']:.2f} tokens/step, "
                      f"{m['throughput_tok_s']:.0f} tok/s, "
                      f"mean TTFT {m['ttft_mean_steps']:.1f} steps")
        _draw_timeline(ax, trace, None, title)
    axes[0][0].set_xlim(0, max(len(t) for t in traces.values()))  # shared: the longest run fits
    _state_legend(axes[0][-1], max(traces.values(), key=lambda t: len(preemption_steps(t))))
    return fig


# ---- blocks and queues ---------------------------------------------------------------------------


def _block_snapshot(trace: Trace, i: int) -> BlockGridSnapshot:
    b = trace[i].blocks
    return BlockGridSnapshot(dict(b.tables), b.total, b.block_size, dict(b.num_tokens), f"step {i}",
                             tuple(b.cached_block_ids))


def render_blocks(trace: Trace, i: int) -> Figure:
    """The KV block pool as the forward of step i saw it: one cell per block,
    coloured by its owner."""
    i = _check_step("render_blocks", trace, i)
    snap = _block_snapshot(trace, i)
    if snap.num_blocks < 1:
        raise ValueError(f"render_blocks: step {i} has no block pool recorded (blocks.total = 0)")
    return render_block_grid(snap.tables, snap.num_blocks, snap.num_tokens, snap.block_size,
                             snap.label, cached_block_ids=snap.cached_block_ids)


def queue_lengths(trace: Trace) -> dict[str, list[int]]:
    """Per step: waiting, running (admitted), swapped counts,
    and KV blocks used / total / swap used."""
    out: dict[str, list[int]] = {k: [] for k in ("waiting", "running", "swapped", "blocks_used",
                                                 "blocks_total", "swap_used")}
    for report in trace.steps:
        q, b = report.queues, report.blocks
        for key, value in (("waiting", len(q.waiting)), ("running", len(q.running)),
                           ("swapped", len(q.swapped)), ("blocks_used", b.used),
                           ("blocks_total", b.total), ("swap_used", b.swap_used)):
            out[key].append(value)
    return out


def _draw_queues(ax_q, ax_kv, trace: Trace, mark_step: int | None = None) -> None:
    lengths, edges = queue_lengths(trace), range(len(trace) + 1)  # step i's value spans [i, i + 1)
    for name, color in QUEUE_COLORS.items():
        if name != "swapped" or any(lengths["swapped"]):
            ax_q.stairs(lengths[name], edges, color=color, label=name, linewidth=1.5,
                        gid=f"queue:{name}")
    ax_q.set_ylabel("requests")
    ax_q.legend(fontsize=7, loc="best", frameon=False)
    ax_kv.stairs(lengths["blocks_used"], edges, color="tab:green", label="KV blocks used",
                 linewidth=1.5, gid="queue:blocks_used")
    ax_kv.stairs(lengths["blocks_total"], edges, color="black", linestyle="--", linewidth=0.8,
                 label="pool", gid="queue:blocks_total")
    if any(lengths["swap_used"]):
        ax_kv.stairs(lengths["swap_used"], edges, color="tab:purple", label="CPU swap used",
                     linewidth=1.5, gid="queue:swap_used")
    ax_kv.set_ylabel("KV blocks")
    ax_kv.set_xlabel("engine step")
    ax_kv.set_ylim(0, max(lengths["blocks_total"] + [1]) * 1.1)
    ax_kv.legend(fontsize=7, loc="best", frameon=False)  # where it hides the least of the lines
    for step, _rid, _mode in preemption_steps(trace):
        for ax in (ax_q, ax_kv):
            ax.axvline(step + 0.5, color="tab:red", linewidth=0.6, alpha=0.6, gid="preemption")
    if mark_step is not None:
        for ax in (ax_q, ax_kv):
            _mark_now(ax, mark_step)
    ax_q.set_xlim(0, len(trace))


def render_queues(trace: Trace, mark_step: int | None = None) -> Figure:
    """Queue lengths (top) and KV blocks in use (bottom) at every step;
    red lines mark preemptions."""
    if not trace.steps:
        raise ValueError("render_queues: trace has no steps; "
                         "run the engine for at least one step first")
    fig, axes = _new_figure((8.0, 4.2), 2, 1, sharex=True)
    _draw_queues(axes[0][0], axes[1][0], trace, mark_step)
    axes[0][0].set_title("queues and KV blocks over the run (red: a preemption)", fontsize=10)
    return fig


def render_step(trace: Trace, i: int) -> Figure:
    """Everything at step i: the timeline so far, the queues and KV use with step i marked, and the
    block grid of step i. The title says what the step ran (`describe_step`)."""
    i = _check_step("render_step", trace, i)
    rows = len(trace.request_ids())
    fig = plt.figure(figsize=(STEP_WIDTH_IN, _timeline_inches(rows) + BOTTOM_ROW_IN),
                     layout="constrained")
    plt.close(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[_timeline_inches(rows), BOTTOM_ROW_IN],
                            width_ratios=QUEUES_TO_GRID)
    timeline = fig.add_subplot(grid[0, :])
    _draw_timeline(timeline, trace, i, f"requests up to step {i}")
    _state_legend(timeline, trace)
    left = grid[1, 0].subgridspec(2, 1)
    ax_q = fig.add_subplot(left[0])
    _draw_queues(ax_q, fig.add_subplot(left[1], sharex=ax_q), trace, i)
    snap = _block_snapshot(trace, i)
    ax_blocks = fig.add_subplot(grid[1, 1])
    if snap.num_blocks >= 1:
        # as many columns as make the cells biggest in this panel, so their labels stay readable
        width = STEP_WIDTH_IN * QUEUES_TO_GRID[1] / sum(QUEUES_TO_GRID) - LEGEND_INCHES
        columns = columns_to_fill(snap.num_blocks, width, BOTTOM_ROW_IN - GRID_TITLE_IN)
        colors = distinct_colors(trace.request_ids())  # the same in every step's picture
        _fit_labels(fig, [_draw_block_grid(ax_blocks, snap, colors, columns=columns)])
    else:
        ax_blocks.set_axis_off()
    fig.suptitle(describe_step(trace[i]), fontsize=10)
    return fig


# ---- comparing runs ------------------------------------------------------------------------------


def render_step_durations(traces: Mapping[str, Trace]) -> Figure:
    """Top: each step's wall time (ms); bottom: the tokens in its forward, for each named run.

    A long prompt prefilled in one step shows as one tall spike that every running request waits
    through; chunked prefill spreads it over several shorter steps."""
    if not traces or any(not t.steps for t in traces.values()):
        raise ValueError("render_step_durations: traces must be a non-empty {name: Trace}, "
                         "each with at least one step")
    fig, axes = _new_figure((9.0, 4.8), 2, 1, sharex=True)
    for k, (name, trace) in enumerate(traces.items()):
        edges = range(len(trace) + 1)
        ms = [1e3 * (r.end_time - r.start_time) for r in trace.steps]
        axes[0][0].stairs(ms, edges, color=f"C{k}", linewidth=1.5, label=name,
                          gid=f"duration:{name}")
        axes[1][0].stairs([r.num_tokens for r in trace.steps], edges, color=f"C{k}", linewidth=1.5,
                          label=name, gid=f"tokens:{name}")
    axes[0][0].set_ylabel("step time (ms)")
    axes[1][0].set_ylabel("tokens in the step")
    axes[1][0].set_xlabel("engine step")
    axes[0][0].legend(fontsize=8, frameon=False)
    axes[0][0].set_title("how long each step took, and how many tokens it carried", fontsize=10)
    return fig


def render_sweep(rows: Sequence[Mapping], knob: str) -> Figure:
    """Throughput, latency (TTFT and TPOT) and fairness against a scheduler knob, from rows that
    each hold the knob's value and the keys of `engine.companions.metrics.trace_metrics`
    (e.g. {"max_num_seqs": 4, **trace_metrics(t)})."""
    if not rows or any(knob not in r for r in rows):
        raise ValueError("render_sweep: rows must be a non-empty list of dicts, each with the "
                         f"knob {knob!r}")
    x = [r[knob] for r in rows]
    fig, axes = _new_figure((12.0, 3.6), 1, 3)
    ax_tp, ax_lat, ax_fair = axes[0]
    _twin_lines(ax_tp, x, [r["throughput_tok_s"] for r in rows], "tokens / s",
                [r["tokens_per_step"] for r in rows], "tokens / step")
    ax_tp.set_title("throughput", fontsize=10)
    ax_lat.plot(x, [r["ttft_mean_s"] * 1e3 for r in rows], "o-", color="C0", label="TTFT mean",
                gid="sweep:ttft_mean_s")
    ax_lat.plot(x, [r["ttft_p99_s"] * 1e3 for r in rows], "o:", color="C0", label="TTFT P99",
                gid="sweep:ttft_p99_s")
    ax_lat.set_ylabel("TTFT (ms)", color="C0")
    ax_lat.legend(fontsize=8, frameon=False, loc="upper center")
    tpot = ax_lat.twinx()
    tpot.plot(x, [r["tpot_mean_s"] * 1e3 for r in rows], "s--", color="C1", gid="sweep:tpot_mean_s")
    tpot.set_ylabel("TPOT mean (ms, squares)", color="C1")
    tpot.set_ylim(bottom=0)
    ax_lat.set_title("latency: waiting to start vs pace once started", fontsize=10)
    ax_fair.plot(x, [r["fairness"] for r in rows], "o-", color="C2", gid="sweep:fairness")
    ax_fair.set_ylabel("Jain's index (1 = equal pace)")
    ax_fair.set_title("fairness", fontsize=10)
    for ax in (ax_tp, ax_lat, ax_fair):
        ax.set_xlabel(knob)
        ax.set_xticks(x)
        ax.set_ylim(bottom=0)
    ax_fair.set_ylim(0, 1.05)
    return fig


def _twin_lines(ax, x, left, left_label: str, right, right_label: str) -> None:
    """Two series with their own y axes: circles on the left axis, squares on the right one."""
    ax.plot(x, left, "o-", color="C0", gid=f"sweep:{left_label}")
    ax.set_ylabel(f"{left_label} (circles)", color="C0")
    twin = ax.twinx()
    twin.plot(x, right, "s--", color="C1", gid=f"sweep:{right_label}")
    twin.set_ylabel(f"{right_label} (squares)", color="C1")
    twin.set_ylim(bottom=0)


def evenly_spaced_steps(trace: Trace, count: int = 4) -> list[int]:
    """`count` step indices spread from the first step to the last
    (for a static strip of render_step)."""
    n = len(trace)
    return sorted({round(k * (n - 1) / max(count - 1, 1)) for k in range(min(count, n))})


def trace_player(trace: Trace, interval_ms: int = PLAYER_INTERVAL_MS):
    """A Play button and a step slider that redraw `render_step(trace, i)`.

    Needs ipywidgets (imported here, so the rest of the module works without it); a notebook shows
    the returned widget with `display(...)`. Without widgets, draw `render_step` at a few steps
    (`evenly_spaced_steps`). The picture is an Image widget, not an Output widget, so
    `nbconvert --execute` and nbmake never stall on it (engine/viz/widgets.py says why).
    """
    import ipywidgets as widgets

    _check_step("trace_player", trace, 0)
    last = len(trace) - 1
    play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval_ms, description="play")
    slider = widgets.IntSlider(value=0, min=0, max=last, description="step")
    widgets.jslink((play, "value"), (slider, "value"))
    figure = interactive_figure(lambda i: render_step(trace, i), {"i": slider})
    return widgets.VBox([widgets.HBox([play, slider]), figure])

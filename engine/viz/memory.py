"""Figures for chapters 02 and 03: where the time of a forward goes, and where the memory goes.

Every function here is a `render_*(...) -> matplotlib Figure` that draws numbers it is given (or
computes them with `engine.companions.memory` / `engine.companions.roofline`); nothing is measured
here. The one widget, `kv_calculator_widget()`, is a thin ipywidgets wrapper around
`render_kv_calculator`, so the same picture works without widgets (CI, GitHub preview).

    chapter 02   render_prefill_decode_times   time per token, prefill vs decode
                 render_roofline               measurements placed on this machine's roofline
                 render_request_timelines      TTFT, then one dot per token, for a few requests
    chapter 03   render_step_time_curves       per-step time of the naive loop vs the cached one
                 render_kv_calculator          weights + KV cache vs tokens (or batch), card lines
                 render_attention_variants     KV memory of MHA vs GQA vs MQA
                 render_window_recall          recall accuracy with and without a sliding window

Artists that a test (or a curious reader) may want to find carry a `gid`, e.g. the roofline's
roof is the line with gid "roof", the 80 GB card line has gid "gpu:80".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from engine.companions.memory import (
    ACTIVATION_RESERVE_FRACTION,
    DTYPE_BYTES,
    GB,
    GPU_MEMORY_GB,
    dtype_bytes,
    kv_bytes_per_token,
    max_concurrent_sequences,
    plan_memory,
    weight_bytes,
)
from engine.companions.roofline import MachineRoofline, ridge_point
from engine.config import MODEL_PRESETS, ModelConfig
from engine.viz.sampling import running_median, step_time_slope_ms

MS_PER_S = 1000.0
CURVE_POINTS = 400  # samples along a curve: smooth at any zoom a notebook offers
# extend the x axis 15% past where the largest card fills, so the crossing shows
CROSSING_MARGIN = 1.15
ROOFLINE_DECADES_MARGIN = 10.0  # one decade of room either side of the points and the ridge
# The roofline's y axis runs to 8x the highest point or peak: above the flat roof, where nothing
# measured can sit, two rows of text fit (the regimes at 1.7x, the ridge's value at 4x: a log axis,
# so each row is about a quarter of a decade, two text heights, above the one below).
ROOFLINE_HEADROOM = 8.0
REGIME_LIFT, RIDGE_LIFT = 1.7, 4.0
RIDGE_GAP_PT = 4  # the regime names stand this far either side of the ridge line
LABEL_FONTSIZE = 8
POINTS_PER_INCH = 72.0
MARKER_HALF_PT = 4.0  # half the side of a marker's box: scatter's default s=36 is a 6 pt disc
MARKER_CLEAR_PT = 9.0  # no label comes nearer than this to a point it does not name
# a white ground under each label, so grid lines do not strike through it (pad in points)
LABEL_BACKGROUND = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.5}
# Where a point's label may go, nearest first: the distance from the point (points), and the
# directions as (dx, dy) in -1/0/1 (right of the point preferred, as a reader scans).
LABEL_RADII_PT = (6, 12, 22, 34, 48, 64)
LABEL_DIRECTIONS = ((1, 0), (1, 1), (1, -1), (0, 1), (0, -1), (-1, 0), (-1, 1), (-1, -1))
LEADER_FROM_PT = 12  # a label this far from its point gets a leader line back to it
LINE_COST_TIERS = 2  # a label across the roof or the ridge line ranks as if two radii farther out
FIGSIZE = (8.0, 4.5)
# A request's row in render_request_timelines, in row units: the TTFT bar spans +-0.25 around it,
# the summary line hangs from 0.35 (its top) below it, and the row ends at 0.7, before the next bar.
TIMELINE_BAR_HEIGHT = 0.5
TIMELINE_TEXT_BELOW = 0.35
TIMELINE_ROW_BOTTOM = 0.7
FIGSIZE_WIDE = (11.0, 4.2)

# The calculator's allowed ranges: wide enough for every published model we know of (Llama-3.1-405B
# has 126 layers, 128k context), small enough that the plot stays readable.
# Sliders use the same ranges.
CALCULATOR_LIMITS: dict[str, tuple[int, int]] = {
    "layers": (1, 256),
    "batch": (1, 4096),
    "tokens": (1, 1_048_576),
    "kv_heads": (1, 256),
    "head_dim": (8, 1024),
}
CALCULATOR_AXES = ("tokens", "batch")
# The calculator's names for the formula's factors (its sliders),
# and the ModelConfig fields they set.
CALCULATOR_FIELDS = {"layers": "num_hidden_layers", "kv_heads": "num_key_value_heads",
                     "head_dim": "head_dim"}


def _new_figure(figsize=FIGSIZE, ncols: int = 1):
    """A figure that pyplot does not keep: we return it, and the notebook displays it once."""
    fig, axes = plt.subplots(1, ncols, figsize=figsize, layout="constrained")
    plt.close(fig)
    return fig, axes


def _si(value: float) -> str:
    """1.05e11 -> '105 G', 3.35e12 -> '3.35 T': three significant digits and a decimal prefix."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g} "


def _check_range(func: str, field: str, value) -> None:
    lo, hi = CALCULATOR_LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ValueError(f"{func}: {field} must be an int in [{lo}, {hi}], got {value!r}")


# ---- chapter 02: time per token, the roofline, request timelines ---------------------------------


def render_prefill_decode_times(rows: Sequence[Mapping]) -> Figure:
    """Milliseconds per token of prefill and decode, one line per (phase, batch).

    Each row: {"phase": "prefill" | "decode", "tokens": prompt length (prefill) or context length
    (decode), "batch": B, "ms_per_token": time of the forward / tokens it produced}.
    """
    if not rows:
        raise ValueError("render_prefill_decode_times: rows is empty; measure at least one forward")
    fig, ax = _new_figure()
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for row in rows:
        if row["phase"] not in ("prefill", "decode"):
            raise ValueError(f"render_prefill_decode_times: phase must be 'prefill' or 'decode', "
                             f"got {row['phase']!r}")
        series.setdefault((row["phase"], row["batch"]), []).append(
            (row["tokens"], row["ms_per_token"]))
    for (phase, batch), points in sorted(series.items()):
        x, y = zip(*sorted(points), strict=True)
        style = "-o" if phase == "prefill" else "--s"
        ax.plot(x, y, style, label=f"{phase}, batch {batch}", gid=f"{phase}:{batch}")
    ax.set(xscale="log", yscale="log",
           xlabel="prompt length (prefill) / context length (decode), tokens",
           ylabel="ms per token",
           title="Time per token: prefill shares each weight read among many tokens")
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 20 rather than 2x10^1
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    # decode's are P + 1: one tick each, not two
    prefill_lengths = {row["tokens"] for row in rows if row["phase"] == "prefill"}
    ax.set_xticks(sorted(prefill_lengths or {row["tokens"] for row in rows}))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig


def render_token_time_vs_floor(ms_per_token: Mapping[str, float], floor_ms: float,
                               title: str) -> Figure:
    """Horizontal bars: milliseconds per decode token for each way of running the same model,
    against the bandwidth floor (the time to stream the weights once, a dashed line). The gap
    between a bar and the line is time spent on something other than reading weights."""
    if not ms_per_token:
        raise ValueError("render_token_time_vs_floor: ms_per_token is empty; "
                         "measure at least one way")
    if not floor_ms > 0:
        raise ValueError(f"render_token_time_vs_floor: floor_ms must be > 0, got {floor_ms!r}")
    fig, ax = _new_figure(figsize=(FIGSIZE_WIDE[0], 1.6 + 0.6 * len(ms_per_token)))
    names = list(ms_per_token)
    bars = ax.barh(names, [ms_per_token[n] for n in names], color="tab:blue", height=0.5)
    ax.bar_label(bars, labels=[f"{ms_per_token[n]:.1f} ms "
                               f"({ms_per_token[n] / floor_ms:.1f}x the floor)"
                               for n in names], padding=4)
    ax.axvline(floor_ms, color="tab:red", linestyle="--",
               label=f"bandwidth floor {floor_ms:.1f} ms")
    ax.set_xlim(0, 1.45 * max(max(ms_per_token.values()), floor_ms))  # room for the labels
    ax.invert_yaxis()  # the first entry on top
    ax.set(xlabel="ms per decode token (batch 1)", title=title)
    # below the axis: never on a bar
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    return fig


def render_roofline(roofline: MachineRoofline,
                    points: Sequence[tuple[str, float, float]]) -> Figure:
    """A log-log roofline with measured points (label, intensity in FLOP/byte, achieved FLOP/s).

    Points whose labels share their first word ("prefill ...", "decode ...") share a colour. Above
    the flat roof, where no measured point can be, one row names the two regimes either side of
    the ridge and a second row gives the ridge's value. Each point's label is placed where it
    overlaps no other label, no marker and no text (`_place_point_labels`); a label that had to
    move away from its point is tied to it by a thin leader line.
    """
    for label, intensity, flops in points:
        if not (intensity > 0 and flops > 0):
            raise ValueError(f"render_roofline: point {label!r} needs intensity > 0 "
                             "and achieved FLOP/s > 0 (a log-log plot), "
                             f"got intensity={intensity!r}, flops={flops!r}")
    ridge = ridge_point(roofline)
    xs = [p[1] for p in points] + [ridge]
    x = np.geomspace(min(xs) / ROOFLINE_DECADES_MARGIN, max(xs) * ROOFLINE_DECADES_MARGIN,
                     CURVE_POINTS)
    roof = np.minimum(roofline.peak_flops, roofline.bandwidth_bytes_per_s * x)
    fig, ax = _new_figure()
    ax.plot(x, roof, "k-", lw=2, label="roofline: min(peak, bandwidth x intensity)", gid="roof")
    ax.axvline(ridge, color="grey", ls=":", gid="ridge")
    groups = list(dict.fromkeys(label.split()[0] for label, _, _ in points))
    colours = {g: f"C{i}" for i, g in enumerate(groups)}
    for label, intensity, flops in points:
        ax.scatter([intensity], [flops], color=colours[label.split()[0]], zorder=3,
                   gid=f"point:{label}")
    for g in groups:
        ax.scatter([], [], color=colours[g], label=g)
    top = max([roofline.peak_flops] + [p[2] for p in points])
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per byte moved)",
           ylabel="FLOP/s", xlim=(x[0], x[-1]),
           ylim=(min([p[2] for p in points] + [roof[0]]) / 3, top * ROOFLINE_HEADROOM),
           title=f"Roofline ({roofline.dtype}): peak {_si(roofline.peak_flops)}FLOP/s, "
                 f"bandwidth {_si(roofline.bandwidth_bytes_per_s)}B/s")
    _ridge_texts(ax, ridge, top)
    # below the axes, outside them: never on a point or a label
    fig.legend(loc="outside lower center", ncols=1 + len(groups), fontsize=8, frameon=False)
    ax.grid(True, which="both", alpha=0.3)
    _place_point_labels(fig, ax, points, (x, roof), ridge)
    return fig


def _ridge_texts(ax, ridge: float, top: float) -> None:
    """Two rows above everything measured: the regimes either side of the ridge, then its value."""
    ax.annotate("\u2190 bandwidth-bound", (ridge, top * REGIME_LIFT), textcoords="offset points",
                xytext=(-RIDGE_GAP_PT, 0), ha="right", va="center", color="grey",
                gid="regime:bandwidth")
    ax.annotate("compute-bound \u2192", (ridge, top * REGIME_LIFT), textcoords="offset points",
                xytext=(RIDGE_GAP_PT, 0), ha="left", va="center", color="grey",
                gid="regime:compute")
    ax.annotate(f"ridge {ridge:.1f} FLOP/B", (ridge, top * RIDGE_LIFT), ha="center", va="center",
                color="grey", gid="ridge-label",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    for text in ax.texts:
        text.set_in_layout(False)  # inside the axes: the layout need not make room for them


def _candidate_box(anchor, offset_px, size, direction) -> np.ndarray:
    """[x0, y0, x1, y1] of a label of `size` (w, h) anchored at `anchor` + `offset_px`, aligned
    away from the point along `direction` (left-aligned when it lies to the right, and so on)."""
    (w, h), (dx, dy) = size, direction
    x = anchor[0] + offset_px[0] - w * (0.5 - 0.5 * dx)
    y = anchor[1] + offset_px[1] - h * (0.5 - 0.5 * dy)
    return np.array([x, y, x + w, y + h])


def _overlaps(box: np.ndarray, others: np.ndarray) -> int:
    """How many of the boxes `others` [N, 4] intersect `box` [4]."""
    if len(others) == 0:
        return 0
    return int(np.sum((others[:, 0] < box[2]) & (others[:, 2] > box[0])
                      & (others[:, 1] < box[3]) & (others[:, 3] > box[1])))


def _place_point_labels(fig: Figure, ax, points, roof_xy, ridge: float) -> None:
    """Greedy label placement in display space, nearest spot first.

    We run the layout once (so the axes stop moving; the labels are left out of it), then try
    each label at LABEL_RADII_PT from its point in LABEL_DIRECTIONS. A spot is allowed when the
    label lies inside the axes and overlaps no placed label, no ridge text, its own marker, and
    no other marker or the MARKER_CLEAR_PT around it (so no label sits beside a point it does not
    name). Among allowed spots the nearest wins, where lying across the roof or the ridge line
    counts as LINE_COST_TIERS radii farther (a long leader line is worse than a crossed line);
    if no spot is allowed, the least crowded one.
    """
    renderer = FigureCanvasAgg(fig).get_renderer()  # Agg: what every static figure is drawn with
    fig.draw_without_rendering()
    frame = ax.get_window_extent(renderer)
    px_per_pt = fig.dpi / POINTS_PER_INCH
    xy = ax.transData.transform([(p[1], p[2]) for p in points])  # [N, 2] the markers, in pixels
    own, clear = MARKER_HALF_PT * px_per_pt, MARKER_CLEAR_PT * px_per_pt
    markers = np.column_stack([xy - clear, xy + clear])  # [N, 4] the room other labels keep off
    texts = [t.get_window_extent(renderer).extents for t in ax.texts]
    roof_px = ax.transData.transform(np.column_stack(roof_xy))  # [CURVE_POINTS, 2]
    ridge_x = ax.transData.transform((ridge, 1.0))[0]
    # the roof's samples as zero-size boxes, and the ridge line as one zero-wide box
    lines = np.vstack([np.column_stack([roof_px, roof_px]),
                       [[ridge_x, frame.y0, ridge_x, frame.y1]]])
    for i, ((label, intensity, flops), anchor) in enumerate(zip(points, xy, strict=True)):
        obstacles = np.array(texts + [np.r_[anchor - own, anchor + own]]
                             + [m for j, m in enumerate(markers) if j != i])
        probe = ax.text(0, 0, label, fontsize=LABEL_FONTSIZE)
        size = probe.get_window_extent(renderer).size
        probe.remove()
        best = None
        for tier, radius in enumerate(LABEL_RADII_PT):
            for direction in LABEL_DIRECTIONS:
                box = _candidate_box(anchor, np.array(direction) * radius * px_per_pt, size,
                                     direction)
                inside = (box[0] >= frame.x0 and box[1] >= frame.y0
                          and box[2] <= frame.x1 and box[3] <= frame.y1)
                score = (_overlaps(box, obstacles) + (0 if inside else len(obstacles) + 1),
                         tier + LINE_COST_TIERS * (_overlaps(box, lines) > 0))
                if best is None or score < best[0]:
                    best = (score, direction, radius, box)
        _, (dx, dy), radius, box = best
        texts.append(box)
        leader = ({"arrowstyle": "-", "color": "0.45", "lw": 0.6, "shrinkA": 1, "shrinkB": 3}
                  if radius >= LEADER_FROM_PT else None)
        ax.annotate(label, (intensity, flops), textcoords="offset points",
                    xytext=(dx * radius, dy * radius), fontsize=LABEL_FONTSIZE,
                    ha=("center", "left", "right")[dx], va=("center", "bottom", "top")[dy],
                    arrowprops=leader, gid=f"label:{label}", annotation_clip=False,
                    bbox=LABEL_BACKGROUND).set_in_layout(False)


def render_request_timelines(step_times_s: Mapping[str, Sequence[float]]) -> Figure:
    """One row per request: the wait for the first token (TTFT), then a dot per later token.

    `step_times_s[label]` is a request's per-step times (step 0 is the prefill that gives the first
    token), e.g. `GenerationResult.step_times_s`.
    """
    if not step_times_s:
        raise ValueError("render_request_timelines: no requests given")
    fig, ax = _new_figure(figsize=(FIGSIZE[0], 1.0 + 1.0 * len(step_times_s)))
    for row, (label, times) in enumerate(step_times_s.items()):
        if not times:
            raise ValueError(f"render_request_timelines: request {label!r} has no steps")
        arrivals = np.cumsum(times) * MS_PER_S  # when each token is ready
        ttft, e2e = arrivals[0], arrivals[-1]
        ax.barh(row, ttft, height=TIMELINE_BAR_HEIGHT, color="C3", alpha=0.35,
                gid=f"ttft:{label}")
        ax.plot(arrivals, np.full_like(arrivals, row), "|", color="C0", ms=12,
                gid=f"tokens:{label}")
        tpot = (e2e - ttft) / (len(times) - 1) if len(times) > 1 else float("nan")
        ax.text(0, row + TIMELINE_TEXT_BELOW,
                f"TTFT {ttft:.0f} ms · TPOT {tpot:.1f} ms ({MS_PER_S / tpot:.0f} tokens/s "
                f"while decoding) · {len(times)} tokens in {e2e:.0f} ms", fontsize=8, va="top",
                gid=f"summary:{label}")
    ax.set_yticks(range(len(step_times_s)), list(step_times_s))
    ax.set(xlabel="ms since the request arrived",
           ylim=(-TIMELINE_BAR_HEIGHT, len(step_times_s) - 1 + TIMELINE_ROW_BOTTOM),
           title="Shaded: waiting for the first token (TTFT). Ticks: each token as it arrives.")
    ax.invert_yaxis()
    return fig


# ---- chapter 03: naive vs cached, the KV calculator, attention variants, the sliding window ------


def render_step_time_curves(step_times_s: Mapping[str, Sequence[float]], prompt_tokens: int,
                            include_prefill: bool = False) -> Figure:
    """Per-step time of several generation loops as the sequence grows
    (chapter 01's picture, extended).

    Step i >= 1 feeds the sequence of `prompt_tokens + i` tokens (step 0 is the prefill, left out
    unless `include_prefill`: it is the same work for both loops and dwarfs the rest). Dots are the
    measured steps, the line their running median (one slow step cannot bend it), and the legend
    gives each loop's slope: milliseconds added per extra token of sequence.
    """
    if prompt_tokens < 1:
        raise ValueError("render_step_time_curves: prompt_tokens must be >= 1, "
                         f"got {prompt_tokens}")
    fig, ax = _new_figure()
    first = 0 if include_prefill else 1
    for i, (label, times) in enumerate(step_times_s.items()):
        x = prompt_tokens + np.arange(first, len(times))
        y = np.asarray(times[first:], dtype=float) * MS_PER_S
        ax.plot(x, y, ".", color=f"C{i}", alpha=0.35, gid=f"steps:{label}")
        slope = f": {step_time_slope_ms(times):+.3f} ms per extra token" if len(times) >= 3 else ""
        ax.plot(x, running_median(y), "-", color=f"C{i}", lw=2, label=f"{label}{slope}",
                gid=f"median:{label}")
    ax.set(xlabel="sequence length at this step (tokens)", ylabel="ms per step", ylim=(0, None),
           title="Per-step time as the sequence grows (dots: measured; line: running median)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return fig


def calculator_shape(preset: str, layers: int | None = None, kv_heads: int | None = None,
                     head_dim: int | None = None) -> ModelConfig:
    """A preset's config with some of the formula's factors changed
    (what the calculator's sliders do).

    The weights follow the change too (fewer KV heads: smaller k/v projections), so the picture
    stays one consistent, if hypothetical, model.
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"calculator_shape: preset must be one of {sorted(MODEL_PRESETS)}, "
                         f"got {preset!r}")
    config = MODEL_PRESETS[preset]
    changes = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    changes = {field: value for field, value in changes.items() if value is not None}
    for field, value in changes.items():
        _check_range("calculator_shape", field, value)
    if not changes:
        return config
    heads = config.num_attention_heads
    if heads % changes.get("kv_heads", config.num_key_value_heads):
        raise ValueError(f"calculator_shape: kv_heads must divide heads={heads} (each KV head "
                         f"serves a whole group of query heads), got {kv_heads}")
    name = config.name + " (" + ", ".join(f"{k}={v}" for k, v in changes.items()) + ")"
    # a slider may hand us numpy ints
    fields = {CALCULATOR_FIELDS[k]: int(v) for k, v in changes.items()}
    return dataclasses.replace(config, name=name, **fields)


def _kv_curve_gb(shape: ModelConfig, per_token: int, batch: int, tokens: int, vs: str,
                 x: np.ndarray) -> np.ndarray:
    """KV GB along the x axis (tokens per sequence, or batch),
    a sliding window capping the tokens."""
    window = shape.sliding_window or math.inf
    if vs == "tokens":
        return per_token * batch * np.minimum(x, window) / GB
    return per_token * x * min(tokens, window) / GB


def _fit_label(shape: ModelConfig, card_gb: int, batch: int, tokens: int, vs: str,
               weight_dtype, kv_dtype) -> str:
    """What fits on one card after the weights and vLLM's 10% reserve
    (engine.companions.memory.plan_memory)."""
    try:
        plan = plan_memory(shape, card_gb * GB, weight_dtype, kv_dtype)
    except ValueError:
        return "weights do not fit"
    if vs == "batch":
        n = max_concurrent_sequences(shape, card_gb * GB, tokens, weight_dtype, kv_dtype)
        return f"{n} sequences fit"
    per_sequence = plan.kv_budget_bytes // (plan.kv_bytes_per_token * batch)
    if per_sequence >= (shape.sliding_window or math.inf):
        return "any length fits (window)"
    return f"{per_sequence:,} tokens per sequence fit"


def _x_axis(shape: ModelConfig, weights_gb: float, per_token: int, batch: int, tokens: int,
            vs: str) -> np.ndarray:
    """From 0 (or batch 1) to past the point where the largest card fills
    (or 2x the chosen value)."""
    chosen = tokens if vs == "tokens" else batch
    per_unit_gb = _kv_curve_gb(shape, per_token, batch, tokens, vs, np.array([1.0]))[0]
    room_gb = max(GPU_MEMORY_GB.values()) - weights_gb
    fills_at = room_gb / per_unit_gb if room_gb > 0 and per_unit_gb > 0 else 0
    if vs == "tokens" and shape.sliding_window and fills_at > shape.sliding_window:
        fills_at = 0  # a window caps the cache: it never fills the card
    end = max(2 * chosen, CROSSING_MARGIN * fills_at)
    end = min(end, CALCULATOR_LIMITS[vs][1])
    return np.linspace(0 if vs == "tokens" else 1, end, CURVE_POINTS)


def render_kv_calculator(shape: ModelConfig | str = "Llama-3-8B", batch: int = 1,
                         tokens: int = 8192, kv_dtype="fp16", weight_dtype="fp16",
                         vs: str = "tokens") -> Figure:
    """Weights plus KV cache, M_KV = 2·L·B·T·Hkv·D·b, against tokens per sequence or batch size.

    The weights are the grey band at the bottom, the KV cache is stacked on top; horizontal lines
    are 24, 80 and 141 GB cards, and the legend says what fits on each after the weights and a 10%
    reserve. The dot marks (batch, tokens). `shape` is a ModelConfig or a preset name.
    """
    if isinstance(shape, str):
        shape = calculator_shape(shape)
    _check_range("render_kv_calculator", "batch", batch)
    _check_range("render_kv_calculator", "tokens", tokens)
    if vs not in CALCULATOR_AXES:
        raise ValueError(f"render_kv_calculator: vs must be one of {CALCULATOR_AXES}, got {vs!r}")
    b = dtype_bytes(kv_dtype)
    per_token = kv_bytes_per_token(shape, b)
    weights_gb = weight_bytes(shape, weight_dtype) / GB
    x = _x_axis(shape, weights_gb, per_token, batch, tokens, vs)
    kv_gb = _kv_curve_gb(shape, per_token, batch, tokens, vs, x)

    fig, ax = _new_figure()
    ax.fill_between(x, 0, weights_gb, color="grey", alpha=0.4, label=f"weights ({weight_dtype})",
                    gid="weights")
    ax.fill_between(x, weights_gb, weights_gb + kv_gb, color="C0", alpha=0.4,
                    label=f"KV cache ({kv_dtype})")
    ax.plot(x, weights_gb + kv_gb, "C0-", gid="total")
    for i, (card, gb) in enumerate(GPU_MEMORY_GB.items()):
        fits = _fit_label(shape, gb, batch, tokens, vs, weight_dtype, kv_dtype)
        ax.axhline(gb, color=f"C{i + 1}", ls="--", label=f"{card}: {fits}", gid=f"gpu:{gb}")
    chosen = tokens if vs == "tokens" else batch
    chosen_kv = _kv_curve_gb(shape, per_token, batch, tokens, vs, np.array([float(chosen)]))[0]
    ax.plot([chosen], [weights_gb + chosen_kv], "ko", gid="chosen")
    ax.annotate(f"B={batch}, T={tokens:,}: {weights_gb:.1f} + {chosen_kv:.1f} GB",
                (chosen, weights_gb + chosen_kv), textcoords="offset points", xytext=(6, 6))
    factors = (f"2·{shape.num_hidden_layers}·B·T·{shape.num_key_value_heads}·"
               f"{shape.head_dim}·{b:g} B")
    window = f", window {shape.sliding_window} tokens" if shape.sliding_window else ""
    ax.set(xlabel="tokens per sequence (T)" if vs == "tokens" else "sequences (B)",
           ylabel="GB (10^9 bytes)",
           ylim=(0, max(max(GPU_MEMORY_GB.values()), weights_gb + kv_gb.max()) * 1.1),
           title=f"{shape.name or 'model'}: M_KV = {factors}{window}"
                 + (f" at B={batch}" if vs == "tokens" else f" at T={tokens:,}"))
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig


def attention_variants(base: str = "Llama-3-8B",
                       mha: str = "Llama-2-7B") -> list[tuple[str, ModelConfig]]:
    """Real MHA and GQA models of about the same size,
    plus the GQA one redone as MQA (hypothetical)."""
    m, g = MODEL_PRESETS[mha], MODEL_PRESETS[base]
    mqa = dataclasses.replace(g, name=f"{g.name} as MQA", num_key_value_heads=1)
    return [(f"{m.name}\nMHA, {m.num_key_value_heads} KV heads", m),
            (f"{g.name}\nGQA, {g.num_key_value_heads} KV heads", g),
            (f"{mqa.name}\n1 KV head (hypothetical)", mqa)]


def render_attention_variants(variants: Sequence[tuple[str, ModelConfig]] | None = None,
                              tokens: int = 8192, batch: int = 1, kv_dtype="fp16",
                              card_gb: int = 80) -> Figure:
    """Left: KV GB of `batch` sequences of `tokens` tokens.
    Right: how many fit on a `card_gb` card."""
    variants = attention_variants() if variants is None else variants
    _check_range("render_attention_variants", "tokens", tokens)
    _check_range("render_attention_variants", "batch", batch)
    labels = [label for label, _ in variants]
    kv_gb = [kv_bytes_per_token(s, kv_dtype) * batch * tokens / GB for _, s in variants]
    fits = [max_concurrent_sequences(s, card_gb * GB, tokens, kv_dtype, kv_dtype)
            for _, s in variants]
    fig, (left, right) = _new_figure(FIGSIZE_WIDE, ncols=2)
    for ax, values, fmt in ((left, kv_gb, "{:.2f} GB"), (right, fits, "{:,}")):
        bars = ax.bar(labels, values, color=["C3", "C0", "C2"][: len(values)])
        for bar, value, (_, s) in zip(bars, values, variants, strict=True):
            bar.set_gid(f"{'kv' if ax is left else 'fits'}:{s.name}")
            ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2, value), ha="center",
                        va="bottom")
        ax.tick_params(axis="x", labelsize=8)
    left.set(ylabel="GB", title=f"KV cache of {batch} x {tokens:,}-token sequence(s), {kv_dtype}")
    right.set(ylabel="sequences", title=f"{tokens:,}-token sequences that fit on {card_gb} GB\n"
              f"(weights also {kv_dtype}, {ACTIVATION_RESERVE_FRACTION:.0%} reserve)")
    return fig


def render_window_recall(accuracy: Mapping[str, Mapping[int, float]],
                         windows: Sequence[int] = ()) -> Figure:
    """Recall accuracy against prompt length, one line per cache; dotted lines mark the windows.

    `accuracy[label]` maps a prompt length in tokens to the fraction of questions answered right.
    """
    fig, ax = _new_figure()
    for label, by_length in accuracy.items():
        x = sorted(by_length)
        ax.plot(x, [by_length[n] for n in x], "-o", label=label, gid=f"recall:{label}")
    for i, window in enumerate(windows):
        ax.axvline(window, color="grey", ls=":", gid=f"window:{window}")
        ax.text(window, 1.02 - 0.06 * i, f" W={window}", color="grey", fontsize=8)
    ax.set(xlabel="prompt length (tokens)", ylabel="recall accuracy", ylim=(-0.05, 1.1),
           title="Recall accuracy by prompt length: facts older than the window are gone")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return fig


# ---- the widget: a thin wrapper around render_kv_calculator --------------------------------------

SLIDER_BATCH_MAX = 512  # a slider is for exploring; call render_kv_calculator for bigger numbers
SLIDER_TOKENS_MAX = 131_072  # 128k, the longest context of the presets' families
SLIDER_TOKENS_STEP = 256


def kv_calculator_widget(preset: str = "Llama-3-8B", batch: int = 32, tokens: int = 8192):
    """Sliders for L, B, T, Hkv, D and the dtype, plus a preset menu, over `render_kv_calculator`.

    Needs ipywidgets (an ImportError otherwise: show the static figure instead). A value the formula
    cannot take (say 3 KV heads for 32 query heads) keeps the last figure and says why under it.
    """
    import ipywidgets as w

    from engine.viz.widgets import interactive_figure

    shape = calculator_shape(preset)
    int_slider = lambda field, value, **kw: w.IntSlider(  # noqa: E731 - a tiny local factory
        value=value, min=CALCULATOR_LIMITS[field][0], description=field, continuous_update=False,
        **kw)
    controls = {
        "preset": w.Dropdown(options=sorted(MODEL_PRESETS), value=preset, description="preset"),
        "layers": int_slider("layers", shape.num_hidden_layers, max=CALCULATOR_LIMITS["layers"][1]),
        "batch": int_slider("batch", batch, max=SLIDER_BATCH_MAX),
        "tokens": int_slider("tokens", tokens, max=SLIDER_TOKENS_MAX, step=SLIDER_TOKENS_STEP),
        "kv_heads": int_slider("kv_heads", shape.num_key_value_heads,
                               max=CALCULATOR_LIMITS["kv_heads"][1]),
        "head_dim": int_slider("head_dim", shape.head_dim, max=CALCULATOR_LIMITS["head_dim"][1]),
        "kv_dtype": w.Dropdown(options=list(DTYPE_BYTES), value="fp16", description="KV dtype"),
        "vs": w.ToggleButtons(options=list(CALCULATOR_AXES), value="tokens", description="x axis"),
    }

    def on_preset(change) -> None:  # a new preset resets L, Hkv and D to its published values
        s = MODEL_PRESETS[change["new"]]
        controls["layers"].value, controls["kv_heads"].value = (s.num_hidden_layers,
                                                                s.num_key_value_heads)
        controls["head_dim"].value = s.head_dim

    controls["preset"].observe(on_preset, names="value")

    def draw(preset, layers, batch, tokens, kv_heads, head_dim, kv_dtype, vs) -> Figure:
        s = calculator_shape(preset, layers, kv_heads, head_dim)  # a ValueError: said under it
        return render_kv_calculator(s, batch, tokens, kv_dtype, vs=vs)

    # an Image, not an Output widget: nbconvert and nbmake cannot stall on it (viz/widgets.py)
    out = interactive_figure(draw, controls)
    return w.VBox([w.HBox(list(controls.values())[:4]), w.HBox(list(controls.values())[4:]), out])

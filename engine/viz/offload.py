"""Figures for the two other ways to hold less KV:
a sliding window (chapter 04) and a host tier (chapter 06).

    held_blocks_by_length   from a trace: how many device blocks one request held at each step,
                            against its length (a table entry of NULL_BLOCK = -1 is a block the
                            window gave back)
    moves_per_step          from a trace: the blocks (and bytes) the host tier moved at each step
    recompute_cost          the roofline's numbers for one block: FLOPs to prefill it again,
                            bytes to copy it
    render_blocks_held      blocks held against sequence length, with and without a window
    render_offload_ttft     TTFT per request with and without the host tier,
                            and the bytes moved per step
    render_break_even       compute against link bandwidth: where copying a block back costs more
                            than recomputing it, for several models, and where real machines stand

The break-even, in one line. Bringing a block back over a link of ``bandwidth`` bytes/s takes
``block_bytes / bandwidth``; prefilling it again on a chip of ``peak`` FLOP/s takes
``block_flops / peak``. Copying loses exactly when::

    peak / bandwidth  >  block_flops / block_bytes
    (the machine's FLOPs per link byte)   (the model's FLOPs per KV byte)

so on a log-log chart of compute against bandwidth each model is a straight line y = ratio * x:
machines above their model's line should recompute, machines below it should copy.

Artists carry a `gid`: "held:<label>" and "bound" (blocks held), "ttft:<config>", "offload" and
"reload" (TTFT and bytes), "model:<name>" and "machine:<name>" (break-even).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from engine.companions.memory import kv_block_bytes
from engine.companions.roofline import forward_cost
from engine.config import ModelConfig
from engine.trace import Trace
from engine.viz._figure import fail as _fail
from engine.viz._figure import new_figure as _new_figure
from kernels.paged_attention.reference import NULL_BLOCK

MS = 1e3  # seconds -> milliseconds
MIB = 2**20  # bytes -> MiB
GB = 1e9  # link bandwidths are quoted in decimal GB/s
TFLOP = 1e12
PALETTE = ["tab:gray", "tab:green", "tab:blue", "tab:purple", "tab:orange", "tab:brown"]
OFFLOAD_COLOR, RELOAD_COLOR = "tab:orange", "tab:blue"
# The break-even chart's axes (link GB/s, compute TFLOP/s) reach at least from one CPU core's memory
# copy to NVLink-C2C, and from one CPU core to a data-centre GPU;
# they widen to hold every machine given.
BANDWIDTH_RANGE_GB_S = (0.3, 3000.0)
COMPUTE_RANGE_TFLOP_S = (1e-3, 1e4)
AXIS_MARGIN = 3.0  # a machine's dot stays at least this factor inside the axes




# ---- plain data from a trace ---------------------------------------------------------------------


def held_blocks_by_length(trace: Trace, request_id: str) -> list[tuple[int, int]]:
    """(tokens in the sequence, device blocks it holds) at the end of every step where the request
    had a block table. Entries the sliding window freed (NULL_BLOCK) are not held."""
    points = []
    for report in trace.steps:
        table = report.blocks.tables.get(request_id)
        if table is not None:
            points.append((report.blocks.num_tokens[request_id],
                           sum(b != NULL_BLOCK for b in table)))
    if not points:
        _fail("held_blocks_by_length", "request_id",
              f"{request_id!r} holds no block table in any step of the "
              "trace: pick one of the trace's requests (trace.requests())")
    return points


def moves_per_step(trace: Trace) -> list[dict]:
    """One row per step that moved blocks: {"step", "offload", "reload" (blocks), "offload_bytes",
    "reload_bytes", "bytes"}. Swap and copy-on-write moves count in "bytes" only."""
    rows = []
    for report in trace.steps:
        for e in report.events:
            if e.get("type") != "blocks_moved":
                continue
            blocks = sum(v for k, v in e.items() if k not in ("type", "bytes"))
            per_block = e["bytes"] / blocks if blocks else 0
            off, re = e.get("offload", 0), e.get("reload", 0)
            rows.append({"step": report.step, "offload": off, "reload": re,
                         "offload_bytes": off * per_block, "reload_bytes": re * per_block,
                         "bytes": e["bytes"]})
    return rows


@dataclass(frozen=True)
class RecomputeCost:
    """What one KV block costs to get back: prefill it again (FLOPs) or copy it (bytes)."""

    # FLOPs of prefilling one block's tokens, averaged over a context_tokens-long prefix
    flops: float
    kv_bytes: int  # bytes of its K and V over every layer
    # the model's break-even ratio: machines with more FLOP/s per link B/s recompute
    flops_per_kv_byte: float


def recompute_cost(config: ModelConfig, block_size: int, context_tokens: int, kv_dtype,
                   weight_dtype) -> RecomputeCost:
    """The roofline's count (engine/companions/roofline.py, chapter 02) for one block of a
    ``context_tokens``-long prefix: the FLOPs of prefilling the prefix divided by its blocks (later
    blocks attend to more, so this is the mean), against the block's KV bytes. Attention is counted
    as a dense kernel does (the full rectangle)."""
    if context_tokens < block_size:
        _fail("recompute_cost", "context_tokens", f"= {context_tokens} is shorter than one block "
              f"({block_size} tokens): give the length of the prefix that would be recomputed")
    cost = forward_cost(config, 1, context_tokens, context_tokens, weight_dtype, kv_dtype)
    flops = cost.flops * block_size / context_tokens
    kv_bytes = kv_block_bytes(config, block_size, kv_dtype)
    return RecomputeCost(flops, kv_bytes, flops / kv_bytes)


# ---- figures -------------------------------------------------------------------------------------


def render_blocks_held(series: Mapping[str, Sequence[tuple[int, int]]], block_size: int,
                       window: int | None = None) -> Figure:
    """Device blocks a sequence holds against its length, one line per run (e.g. "no window",
    "W = 64"). With ``window``, a dashed line marks ceil(W / BS) + 1, the most a windowed sequence
    ever holds.

    series: {label: [(tokens, blocks held), ...]}, e.g. from `held_blocks_by_length`.
    """
    if not series or any(not points for points in series.values()):
        _fail("render_blocks_held", "series",
              "is empty or has an empty run: give {label: [(tokens, blocks)]}")
    if block_size < 1:
        _fail("render_blocks_held", "block_size", f"must be >= 1, got {block_size}")
    fig, axes = _new_figure((7.5, 4.2))
    ax = axes[0][0]
    for k, (label, points) in enumerate(series.items()):
        points = sorted(points)
        # earlier runs drawn wider, so a later one on top leaves them visible
        width = 2 + 1.5 * (len(series) - 1 - k)
        ax.step([p[0] for p in points], [p[1] for p in points], where="post",
                color=PALETTE[k % len(PALETTE)], linewidth=width, label=label, gid=f"held:{label}")
    longest = max(p[0] for points in series.values() for p in points)
    if window is not None:
        bound = -(-window // block_size) + 1
        ax.axhline(bound, color="0.3", linestyle="--", gid="bound",
                   label=f"ceil(W / BS) + 1 = {bound} blocks (W = {window}, BS = {block_size})")
    ax.set(xlabel="tokens in the sequence", ylabel="device blocks held", xlim=(0, longest * 1.02),
           ylim=(0, None), title="KV blocks one sequence holds as it grows")
    ax.legend(loc="upper left", fontsize=8)
    return fig


def _mib_bars(ax, moves: Sequence[Mapping]) -> None:
    steps = [m["step"] for m in moves]
    off = [m["offload_bytes"] / MIB for m in moves]
    re = [m["reload_bytes"] / MIB for m in moves]
    for kind, heights, bottom, color in (("offload", off, None, OFFLOAD_COLOR),
                                         ("reload", re, off, RELOAD_COLOR)):
        bars = ax.bar(steps, heights, bottom=bottom, color=color, label=f"{kind}: "
                      + ("device -> host" if kind == "offload" else "host -> device"))
        for patch in bars:
            patch.set_gid(kind)
    ax.set(xlabel="engine step", ylabel="MiB copied in the step", title="Bytes moved per step")
    ax.legend(loc="upper left", fontsize=8)


def render_offload_ttft(ttft_s: Mapping[str, Sequence[float]], moves: Sequence[Mapping],
                        documents: Sequence[int] | None = None,
                        threads: int | None = None) -> Figure:
    """Left: each request's time to first token, one line per configuration (requests in arrival
    order; with ``documents``, the x labels say which document each request asked about). Right: the
    MiB the host tier moved at each step that moved any, offload below and reload on top.

    ttft_s: {config: [seconds per request]}; moves: rows of `moves_per_step` (may be empty).
    """
    if not ttft_s or any(len(v) == 0 for v in ttft_s.values()):
        _fail("render_offload_ttft", "ttft_s", "is empty or has a configuration without requests")
    lengths = {len(v) for v in ttft_s.values()}
    if len(lengths) != 1:
        _fail("render_offload_ttft", "ttft_s",
              f"has configurations with different request counts {sorted(lengths)}: "
              "run the same requests in each")
    n = lengths.pop()
    if documents is not None and len(documents) != n:
        _fail("render_offload_ttft", "documents",
              f"has {len(documents)} entries for {n} requests: give one per request")
    fig, axes = _new_figure((12.0, 4.4), 1, 2)
    ax = axes[0][0]
    for k, (config, times) in enumerate(ttft_s.items()):
        ax.plot(range(n), [t * MS for t in times], "o-", color=PALETTE[k % len(PALETTE)],
                label=config, gid=f"ttft:{config}", markersize=4)
    if documents is not None:
        ax.set_xticks(range(n), [f"d{d}" for d in documents], fontsize=7)
    suffix = f" ({threads} torch thread{'s' if threads != 1 else ''})" if threads else ""
    ax.set(xlabel="request, in arrival order"
                  + (" (its document)" if documents is not None else ""),
           ylabel="TTFT (ms)", ylim=(0, None), title="Time to first token per request" + suffix)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(ttft_s), fontsize=8)
    ax = axes[0][1]
    if moves:
        _mib_bars(ax, moves)
    else:
        ax.text(0.5, 0.5, "no block moved", ha="center", va="center", transform=ax.transAxes)
        ax.set(title="Bytes moved per step", xlabel="engine step")
    return fig


def _model_lines(ax, models: Mapping[str, float], xs: tuple[float, float]) -> None:
    for k, (name, ratio) in enumerate(models.items()):
        ys = [x * GB * ratio / TFLOP for x in xs]  # peak = ratio x bandwidth
        color = PALETTE[(k + 2) % len(PALETTE)]
        ax.plot(xs, ys, "-", color=color, linewidth=1.8, gid=f"model:{name}",
                label=f"{name}: {ratio:,.0f} FLOPs per KV byte")


def _machine_points(ax, machines: Sequence[Mapping]) -> None:
    for k, m in enumerate(machines):
        x, y = m["link_bytes_per_s"] / GB, m["flops_per_s"] / TFLOP
        nominal = bool(m.get("nominal"))
        ax.plot([x], [y], "o", markersize=9, color="black",
                markerfacecolor="white" if nominal else "black", gid=f"machine:{m['name']}",
                zorder=5)
        above = k % 2 == 1  # alternate above / below the dot, so neighbours' labels do not collide
        ax.annotate(m["name"] + ("\n(nominal)" if nominal else "\n(measured)"), (x, y),
                    textcoords="offset points", xytext=(0, 9 if above else -9), fontsize=8,
                    ha="center", va="bottom" if above else "top",
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})


def _axis_range(values: list[float], default: tuple[float, float]) -> tuple[float, float]:
    return (min([default[0], *(v / AXIS_MARGIN for v in values)]),
            max([default[1], *(v * AXIS_MARGIN for v in values)]))


def render_break_even(models: Mapping[str, float], machines: Sequence[Mapping]) -> Figure:
    """Compute (TFLOP/s) against link bandwidth (GB/s), log-log. Each model is the line where
    copying a block back takes as long as recomputing it (y = its FLOPs per KV byte x bandwidth): a
    machine ABOVE a model's line should recompute that model's blocks, a machine BELOW it should
    copy them.

    models: {name: FLOPs per KV byte} (`recompute_cost(...).flops_per_kv_byte`);
    machines: [{"name", "flops_per_s", "link_bytes_per_s", "nominal": bool}]
    (hollow dots: spec-sheet numbers).
    """
    if not models:
        _fail("render_break_even", "models", "is empty: give {name: FLOPs per KV byte}")
    for m in machines:
        missing = [k for k in ("name", "flops_per_s", "link_bytes_per_s") if k not in m]
        if missing:
            _fail("render_break_even", "machines", f"entry {m!r} lacks {missing}")
    xlim = _axis_range([m["link_bytes_per_s"] / GB for m in machines], BANDWIDTH_RANGE_GB_S)
    ylim = _axis_range([m["flops_per_s"] / TFLOP for m in machines], COMPUTE_RANGE_TFLOP_S)
    fig, axes = _new_figure((8.5, 7.0))
    ax = axes[0][0]
    _model_lines(ax, models, xlim)
    _machine_points(ax, machines)
    ax.set(xscale="log", yscale="log", xlim=xlim, ylim=ylim,
           xlabel="link bandwidth, host -> device (GB/s)", ylabel="compute (TFLOP/s)")
    ax.set_title("Copy a KV block back, or prefill it again?\n"
                 "a machine above a model's line should recompute its blocks; "
                 "below it, copy them back", fontsize=10)
    ax.grid(True, which="major", color="0.9")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=8,
              title="break-even of each model")
    return fig

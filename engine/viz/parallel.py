"""Figures for chapter 08: splitting a model over devices, and routing requests over replicas.

    render_layout_memory          per-GPU memory of placement layouts
                                  (engine/companions/placement.py): weights, the activation reserve
                                  and the KV cache left, against the card's memory
    render_tensor_parallel_layer  one Llama layer cut TP ways: which matrices are split by columns,
                                  which by rows, what each rank computes alone, and where the two
                                  all-reduces go
    render_pipeline_timeline      a real pipelined step (a `StageTimeline`): one row per stage, one
                                  box per micro-batch, the idle time (the bubble) shaded, measured
                                  against the formula
    render_comm_per_token         the time a token's tensor-parallel traffic takes on each
                                  interconnect, against the time a GPU needs to read its weights
                                  once (a decode step's floor)
    render_step_breakdown         measured step times per configuration, split into time inside
                                  collectives (all-reduce, send/recv, the plan's broadcast) and
                                  the rest
    render_routing                replicas behind a router: the prefix-cache hit share per policy,
                                  and the work each replica got

How to read the tensor-parallel picture: we draw a weight as the matrix x is multiplied by, [in,
out]. A column-parallel weight is cut into vertical strips (each rank computes some of the OUTPUT
features, whole); a row-parallel weight into horizontal strips (each rank uses some of the INPUT
features and gets a partial sum of every output). The strip a rank holds is filled with its colour::

    column-parallel [E, out]        row-parallel [in, E]
        ┌──┬──┐                        ┌─────┐
        │r0│r1│                        │ r0  │
        │  │  │                        ├─────┤
        └──┴──┘                        │ r1  │   ─► partial sums ─► all-reduce
                                       └─────┘

The inputs are plain data: placement `Layout`s, a `ModelConfig`, `StageTimeline`s (or their span
lists), numbers the notebook measured. This file only draws; the formulas live in
engine/companions/placement.py, engine/parallel/comm.py and engine/parallel/pipeline.py.

Artists carry a `gid`: memory bars "weights:<label>", "reserve:<label>", "kv:<label>" and "memory";
tensor-parallel glyph strips "slice:<matrix>:<rank>" (matrix qkv, o, gate_up, down), boxes
"attention:<rank>", "act:<rank>", "input:<rank>", "output:<rank>", "allreduce:1" and "allreduce:2";
pipeline boxes "mb:<panel>:<stage>:<micro-batch>" and bubbles "bubble:<panel>:<stage>"; interconnect
bars "comm:<name>" and the line "weight_read"; step bars "compute:<kind>:<config>" and
"comm:<kind>:<config>"; routing bars "hit:<policy>" and "load:<policy>:<replica>".
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from engine.config import ModelConfig
from engine.parallel.tensor_parallel import check_tensor_parallel
from engine.viz._figure import fail as _fail
from engine.viz._figure import new_figure as _new_figure

# a 12-point title fits about this many characters per inch of figure: wrap beyond it
CHARS_PER_INCH = 9

GB = 1e9  # placement counts memory in decimal GB, as datasheets do
MS, US = 1e3, 1e6  # seconds -> milliseconds, microseconds
RANK_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive", "tab:cyan")
MAX_TP_DRAWN = len(RANK_COLORS)  # one row per rank: more than 8 rows stop being readable
SHARED_COLOR, ALLREDUCE_COLOR, BUBBLE_COLOR = "0.85", "tab:red", "0.9"
MEMORY_COLORS = {"weights": "tab:blue", "reserve": "0.7", "kv": "tab:green"}
COMM_COLOR, COMPUTE_COLOR = "tab:red", "tab:blue"
# tensor-parallel diagram: a box, and the distance between rank rows
BOX_W, BOX_H, ROW_GAP = 0.84, 0.74, 1.25
GLYPH_W, GLYPH_H = 0.34, 0.34  # the small matrix drawn inside a weight's box
MIN_LABEL_MS = 0.06  # a pipeline box narrower than this share of the panel gets no text inside


# ---- placement: memory per GPU -------------------------------------------------------------------


def _layout_label(x) -> str:
    return (f"TP={x.tp}\nPP={x.pp}\n×{x.replicas}"
            + (f"\n({x.idle_devices} idle)" if x.idle_devices else ""))


def render_layout_memory(layouts: Sequence, title: str = "") -> Figure:
    """One stacked bar per layout (engine.companions.placement's `Layout`): weights + activation
    reserve + the KV cache left, in GB per GPU, with the card's memory as a black line. Where the
    weights overflow, the stack rises above the line; a split that is impossible (TP not dividing
    the heads) is named, not drawn. Below each bar: how many full-context sequences the layout
    caches at once (over all its replicas)."""
    func = "render_layout_memory"
    if not layouts:
        _fail(func, "layouts",
              "is empty: give engine.companions.placement Layouts (e.g. candidate_layouts(...))")
    for x in layouts:
        if not all(hasattr(x, k) for k in ("tp", "pp", "weight_bytes_per_device",
                                           "kv_budget_bytes_per_device")):
            _fail(func, "layouts",
                  f"holds {type(x).__name__}, not an engine.companions.placement Layout")
    fig, axes = _new_figure((max(6.0, 1.05 * len(layouts) + 2.0), 4.8))
    ax, top = axes[0][0], 0.0
    for i, x in enumerate(layouts):
        label = f"TP={x.tp} PP={x.pp}"
        if x.weight_bytes_per_device is None:
            ax.text(i, 1.0, "split\nimpossible", ha="center", va="bottom", fontsize=7,
                    color="tab:red")
            continue
        weights, reserve = x.weight_bytes_per_device / GB, x.reserve_bytes_per_device / GB
        kv = max(0.0, x.kv_budget_bytes_per_device / GB)
        memory = weights + reserve + x.kv_budget_bytes_per_device / GB
        bottom = 0.0
        for kind, height in (("weights", weights), ("reserve", reserve), ("kv", kv)):
            ax.bar(i, height, bottom=bottom, color=MEMORY_COLORS[kind], width=0.7,
                   gid=f"{kind}:{label}", edgecolor="tab:red" if not x.fits else "none",
                   linewidth=1.5)
            bottom += height
        ax.plot([i - 0.45, i + 0.45], [memory, memory], color="black", linewidth=2, gid="memory")
        verdict = f"{x.sequences:,} seq" if x.fits else "does not\nfit"
        ax.annotate(verdict, (i, max(bottom, memory)), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8, color="black" if x.fits else "tab:red")
        top = max(top, bottom, memory)
    handles = [Patch(facecolor=MEMORY_COLORS[kind], label=name) for kind, name in (
        ("weights", "weights"), ("reserve", "activation reserve"), ("kv", "KV cache"))]
    handles.append(Line2D([], [], color="black", linewidth=2, label="the card's memory"))
    if not all(x.fits for x in layouts):
        handles.append(Patch(facecolor="white", edgecolor="tab:red", linewidth=1.5,
                             label="does not fit"))
    ax.set_xticks(range(len(layouts)), [_layout_label(x) for x in layouts], fontsize=8)
    first = layouts[0]
    ax.set(ylabel="GB per GPU", ylim=(0, max(top, 1.0) * 1.15), xlim=(-0.6, len(layouts) - 0.4),
           title=_wrap(title or f"{first.model} on {first.num_devices} x {first.device}: memory "
                       f"per GPU (above each bar: how many sequences of {first.context_tokens:,} "
                       "tokens fit)", fig))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8,
              ncol=min(len(handles), max(2, int(fig.get_figwidth() // 2))), frameon=False)
    return fig


def _wrap(title: str, fig: Figure) -> str:
    """The title broken into lines that fit the figure's width."""
    return textwrap.fill(title, int(fig.get_figwidth() * CHARS_PER_INCH))


# ---- tensor parallel: one layer ------------------------------------------------------------------


def _box(ax, x: float, y: float, text: str, color, gid: str, fontsize: float = 7.5,
         width: float = BOX_W, height: float = BOX_H, text_y: float = 0.0) -> None:
    ax.add_patch(Rectangle((x - width / 2, y - height / 2), width, height, facecolor=color,
                           edgecolor="0.3", linewidth=0.8, gid=gid))
    ax.text(x, y + text_y, text, ha="center", va="center", fontsize=fontsize)


def _glyph(ax, x: float, y: float, rank: int, tp: int, split: str, name: str) -> None:
    """A small [in, out] matrix inside a weight's box: tp strips (vertical for a column split,
    horizontal for a row split), this rank's strip filled."""
    left, bottom = x - GLYPH_W / 2, y - GLYPH_H / 2 + 0.04
    ax.add_patch(Rectangle((left, bottom), GLYPH_W, GLYPH_H, facecolor="white", edgecolor="0.3",
                           linewidth=0.6))
    for k in range(tp):
        if split == "column":
            rect = (left + k * GLYPH_W / tp, bottom), GLYPH_W / tp, GLYPH_H
        else:  # row k from the top
            rect = (left, bottom + (tp - 1 - k) * GLYPH_H / tp), GLYPH_W, GLYPH_H / tp
        ax.add_patch(Rectangle(*rect, facecolor=RANK_COLORS[rank] if k == rank else "white",
                               edgecolor="0.5", linewidth=0.4,
                               gid=f"slice:{name}:{rank}" if k == rank else None))


def _arrow(ax, x0: float, x1: float, y0: float, y1: float | None = None) -> None:
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y0 if y1 is None else y1), arrowstyle="-|>",
                                 mutation_scale=8, color="0.35", linewidth=0.8, shrinkA=0,
                                 shrinkB=0))


def _tp_columns(config: ModelConfig, tp: int) -> list[tuple[str, str, str]]:
    """(kind, name, caption) of each column of the diagram, left to right,
    with this model's shapes."""
    E, D, H, Hkv, I = (config.hidden_size, config.head_dim, config.num_attention_heads,
                       config.num_key_value_heads, config.intermediate_size)
    qkv = f"{H * D // tp}+{2 * Hkv * D // tp}"
    return [("input", "x", f"x [T, {E}]\nthe same on\nevery rank"),
            ("column", "qkv", f"column-parallel\nWq Wk Wv slice\n[{E}, {qkv}]"),
            ("attention", "", "attention on\nits own heads:\nno communication"),
            ("row", "o", f"row-parallel\nWo slice\n[{H * D // tp}, {E}]"),
            ("allreduce", "1", f"all-reduce 1:\nadds the partial\nresults [T, {E}]"),
            ("column", "gate_up", f"column-parallel\nWgate, Wup slices\n[{E}, {I // tp}] each"),
            ("act", "", "silu(g) * u on\nits own channels:\nno communication"),
            ("row", "down", f"row-parallel\nWdown slice\n[{I // tp}, {E}]"),
            ("allreduce", "2", f"all-reduce 2:\nadds the partial\nresults [T, {E}]"),
            ("output", "", f"x + attn + mlp\n[T, {E}], the same\non every rank")]


def _rank_text(kind: str, config: ModelConfig, rank: int, tp: int) -> str:
    H, Hkv, I = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    h, kv, ch = H // tp, Hkv // tp, I // tp
    if kind == "attention":
        kv_text = (f"KV head {rank * kv}" if kv == 1
                   else f"KV heads {rank * kv}-{(rank + 1) * kv - 1}")
        return f"q heads\n{rank * h}-{(rank + 1) * h - 1}\n{kv_text}"
    if kind == "act":
        return f"channels\n{rank * ch}-{(rank + 1) * ch - 1}"
    return {"input": "x", "output": "out"}.get(kind, "")


def render_tensor_parallel_layer(config: ModelConfig, tp: int) -> Figure:
    """One decoder layer of `config` cut `tp` ways, one row per rank (rank 0 on top), data flowing
    left to right: column-parallel Wq/Wk/Wv, attention on the rank's own heads, row-parallel Wo,
    all-reduce, then column-parallel Wgate/Wup, silu on the rank's own channels, row-parallel Wdown,
    all-reduce. The shapes in the captions are this model's, per rank (T is the number of tokens in
    the step)."""
    func = "render_tensor_parallel_layer"
    if not isinstance(config, ModelConfig):
        _fail(func, "config", "must be a ModelConfig (model.config or a MODEL_PRESETS entry), got "
              f"{type(config).__name__}")
    if isinstance(tp, bool) or not isinstance(tp, int) or not 2 <= tp <= MAX_TP_DRAWN:
        _fail(func, "tp",
              f"must be an integer in [2, {MAX_TP_DRAWN}] (one row per rank), got {tp!r}")
    try:
        check_tensor_parallel(config, tp)
    except ValueError as e:
        _fail(func, "tp", f"cannot split this model: {e}")
    columns = _tp_columns(config, tp)
    fig, axes = _new_figure((14.0, 2.3 + 1.05 * tp))
    ax = axes[0][0]
    ys = [(tp - 1 - r) * ROW_GAP for r in range(tp)]  # rank 0 on top
    for c, (kind, name, caption) in enumerate(columns):
        if kind == "allreduce":
            span = ys[0] - ys[-1] + BOX_H
            _box(ax, c, (ys[0] + ys[-1]) / 2, "all-\nreduce\nΣ", ALLREDUCE_COLOR,
                 f"allreduce:{name}", 8, width=0.55, height=span)
        for r, y in enumerate(ys):
            if kind in ("column", "row"):
                _box(ax, c, y, "", "white", f"{kind}:{name}:{r}")
                _glyph(ax, c, y, r, tp, kind, name)
                label = {"qkv": "Wq Wk Wv", "o": "Wo", "gate_up": "Wgate Wup",
                         "down": "Wdown"}[name]
                ax.text(c, y - BOX_H / 2 + 0.08, label, ha="center", va="bottom", fontsize=7)
            elif kind != "allreduce":
                color = SHARED_COLOR if kind in ("input", "output") else RANK_COLORS[r]
                _box(ax, c, y, _rank_text(kind, config, r, tp), color, f"{kind}:{r}",
                     fontsize=7.5 if kind in ("attention", "act") else 9)
            if c + 1 < len(columns):
                _arrow(ax, c + (0.28 if kind == "allreduce" else BOX_W / 2), c + 1 - (
                    0.28 if columns[c + 1][0] == "allreduce" else BOX_W / 2), y)
        ax.text(c, ys[-1] - BOX_H / 2 - 0.12, caption, ha="center", va="top", fontsize=7.5)
    for r, y in enumerate(ys):
        ax.text(-0.62, y, f"rank {r}", ha="right", va="center", fontsize=9, color=RANK_COLORS[r],
                weight="bold")
    ax.set(xlim=(-1.25, len(columns) - 0.45),
           ylim=(ys[-1] - BOX_H / 2 - 0.6, ys[0] + BOX_H / 2 + 0.15))
    ax.axis("off")
    name = config.name or "the model"
    ax.set_title(f"Tensor parallel, TP = {tp}: one layer of {name} (E = {config.hidden_size}, "
                 f"H = {config.num_attention_heads}, Hkv = {config.num_key_value_heads}, "
                 f"I = {config.intermediate_size}); weights drawn as [in, out], "
                 "each rank's share filled", fontsize=10)
    return fig


# ---- pipeline parallel: a step's timeline --------------------------------------------------------


def _spans_of(timeline, func: str, label: str) -> list[tuple[int, int, float, float]]:
    spans = list(getattr(timeline, "spans", timeline))
    if not spans:
        _fail(func, f"timelines[{label!r}]",
              "has no spans: take engine.runner.timeline right after a step that "
              "ran something on a pipeline-parallel engine")
    for s in spans:
        if len(s) != 4 or s[3] < s[2]:
            _fail(func, f"timelines[{label!r}]",
                  f"has a span {s!r}; each must be (stage, micro_batch, start_s, "
                  "end_s) with end_s >= start_s")
    return spans


def _idle_gaps(busy: list[tuple[float, float]], start: float,
               end: float) -> list[tuple[float, float]]:
    """The parts of [start, end] not covered by any (s, e) in busy."""
    gaps, t = [], start
    for s, e in sorted(busy):
        if s > t:
            gaps.append((t, s))
        t = max(t, e)
    return gaps + ([(t, end)] if end > t else [])


def _draw_pipeline(ax, label: str, spans: list, t0_all: float) -> str:
    stages = sorted({s[0] for s in spans})
    micro = sorted({s[1] for s in spans})
    start, end = min(s[2] for s in spans), max(s[3] for s in spans)
    width_ms = (end - start) * MS
    for stage in stages:
        y = len(stages) - 1 - stages.index(stage)  # stage 0 on top
        busy = [(s[2], s[3]) for s in spans if s[0] == stage]
        for a, b in _idle_gaps(busy, start, end):
            ax.add_patch(Rectangle(((a - t0_all) * MS, y - 0.4), (b - a) * MS, 0.8,
                                   facecolor=BUBBLE_COLOR, hatch="///", edgecolor="0.6",
                                   linewidth=0, gid=f"bubble:{label}:{stage}"))
        for st, mb, a, b in spans:
            if st != stage:
                continue
            color = RANK_COLORS[micro.index(mb) % len(RANK_COLORS)]
            ax.add_patch(Rectangle(((a - t0_all) * MS, y - 0.4), (b - a) * MS, 0.8, facecolor=color,
                                   edgecolor="black", linewidth=0.6,
                                   gid=f"mb:{label}:{stage}:{mb}"))
            if (b - a) * MS >= MIN_LABEL_MS * width_ms:
                ax.text((a + b - 2 * t0_all) / 2 * MS, y, f"mb {mb}", ha="center", va="center",
                        fontsize=8, color="white")
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in reversed(stages)])
    ax.set_ylim(-0.6, len(stages) - 0.4)
    P, M = len(stages), len(micro)
    bubble = _bubble(spans)
    return (f"{label}: P = {P} stages, M = {M} micro-batch{'es' if M > 1 else ''}; step "
            f"{width_ms:.0f} ms, bubble {bubble:.0%} (formula (P-1)/(M+P-1) = "
            f"{(P - 1) / (M + P - 1):.0%})")


def _bubble(spans: list) -> float:
    """1 - busy / (stages x span): the same as StageTimeline.bubble_fraction,
    for plain span lists too."""
    start, end = min(s[2] for s in spans), max(s[3] for s in spans)
    stages = {s[0] for s in spans}
    return (1.0 - sum(s[3] - s[2] for s in spans) / (len(stages) * (end - start))
            if end > start else 0.0)


def render_pipeline_timeline(timelines: Mapping) -> Figure:
    """One panel per pipelined step, e.g. {"M = 1": timeline, "M = 4": timeline}: a row per stage
    (stage 0 on top), a box per micro-batch from when that stage started it to when it finished,
    coloured by micro-batch; the stage's idle time within the step hatched (the bubble). Each
    panel's title gives the step's length and its bubble (1 - busy / (P x step span)) next to the
    formula (P - 1) / (M + P - 1) for equal stages and no communication. The panels share one
    time axis (ms from each step's start), so a shorter step ends further left. A panel may also
    be a schedule built by hand (say the formula's, from a measured step's work): label it so.

    timelines: {label: StageTimeline or its spans [(stage, micro_batch, start_s, end_s), ...]}.
    """
    func = "render_pipeline_timeline"
    if not timelines:
        _fail(func, "timelines",
              "is empty: give {label: engine.runner.timeline} of at least one pipelined step")
    spans = {label: _spans_of(t, func, label) for label, t in timelines.items()}
    fig, axes = _new_figure((10.0, 1.0 + 1.5 * len(spans)
                                   + 0.2 * sum(len({s[0] for s in v}) for v in spans.values())),
                            nrows=len(spans), sharex=True)
    for ax, (label, sp) in zip((row[0] for row in axes), spans.items(), strict=True):
        t0 = min(s[2] for s in sp)
        ax.set_title(_draw_pipeline(ax, label, sp, t0), fontsize=9.5)
        ax.set_xlim(0, max((max(s[3] for s in v) - min(s[2] for s in v)) * MS
                           for v in spans.values()) * 1.02)
    axes[-1][0].set_xlabel("time since the step's first stage started (ms)")
    axes[0][0].add_patch(Rectangle((0, 0), 0, 0, facecolor=BUBBLE_COLOR, hatch="///",
                                   edgecolor="0.6", label="idle stage (the bubble)"))
    axes[0][0].legend(loc="upper right", fontsize=8)
    return fig


# ---- communication per token ---------------------------------------------------------------------


def render_comm_per_token(comm_s_per_token: Mapping[str, float], weight_read_s_per_token: float,
                          title: str = "") -> Figure:
    """Horizontal bars (log scale): how long one token's tensor-parallel traffic takes on each
    interconnect (bytes / bandwidth, latency not counted), and a dashed line at the time a GPU needs
    to read its share of the weights once, the floor of a batch-1 decode step. A bar right of the
    line: the link, not the memory, sets the pace of decode. Each bar says its time and its ratio to
    the weight read.

    comm_s_per_token: {interconnect name: seconds per token} (e.g. Layout.comm_s_per_token for
    each); weight_read_s_per_token: seconds (e.g. Layout.weight_read_s_per_token).
    """
    func = "render_comm_per_token"
    if not comm_s_per_token:
        _fail(func, "comm_s_per_token", "is empty: give {interconnect: seconds per token}")
    for name, s in comm_s_per_token.items():
        if not s > 0:
            _fail(func, f"comm_s_per_token[{name!r}]",
                  f"must be > 0 seconds (a log axis), got {s!r}")
    if not weight_read_s_per_token > 0:
        _fail(func, "weight_read_s_per_token",
              f"must be > 0 seconds, got {weight_read_s_per_token!r}")
    names = list(comm_s_per_token)
    fig, axes = _new_figure((9.0, 1.4 + 0.5 * len(names)))
    ax = axes[0][0]
    read_us = weight_read_s_per_token * US
    for i, name in enumerate(names):
        us = comm_s_per_token[name] * US
        ax.barh(i, us, color=COMM_COLOR if us > read_us else "tab:gray", gid=f"comm:{name}",
                height=0.6)
        ax.text(us * 1.15, i, f"{us:,.0f} µs ({us / read_us:.2g}x the weight read)" if us >= 1 else
                f"{us:.2g} µs ({us / read_us:.2g}x the weight read)", va="center", fontsize=8,
                bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1})
    ax.axvline(read_us, color="black", linestyle="--", gid="weight_read",
               label=f"reading the weights once: {read_us:,.0f} µs per token")
    values = [s * US for s in comm_s_per_token.values()] + [read_us]
    ax.set(xscale="log", xlim=(min(values) / 3, max(values) * 40), ylim=(-0.6, len(names) - 0.4),
           xlabel="µs per token (log scale)",
           title=_wrap(title or "Tensor-parallel traffic per token, by interconnect", fig))
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    return fig


# ---- measured step times -------------------------------------------------------------------------


def render_step_breakdown(rows: Sequence[Mapping], title: str = "") -> Figure:
    """Measured step time per configuration, one panel per kind of step (e.g. prefill, decode): the
    lower part of each bar is time outside collectives (compute, Python), the red upper part time
    inside them (waiting in all-reduce, send/recv and the plan's broadcast, as rank 0's CommStats
    counted it).

    rows: [{"config": "TP=2", "kind": "decode", "step_s": median seconds,
    "comm_s": median seconds}, ...].
    """
    func = "render_step_breakdown"
    if not rows:
        _fail(func, "rows", "is empty: give [{config, kind, step_s, comm_s}, ...]")
    for r in rows:
        missing = [k for k in ("config", "kind", "step_s", "comm_s") if k not in r]
        if missing:
            _fail(func, "rows", f"entry {r!r} lacks {missing}")
        if not 0 <= r["comm_s"] <= r["step_s"]:
            _fail(func, "rows",
                  f"entry {r['config']!r}/{r['kind']!r}: comm_s={r['comm_s']!r} must be within "
                  f"[0, step_s={r['step_s']!r}] (time in collectives is part of the step)")
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = _new_figure((5.0 * len(kinds) + 0.5, 4.4), ncols=len(kinds))
    for ax, kind in zip(axes[0], kinds, strict=True):
        mine = [r for r in rows if r["kind"] == kind]
        for i, r in enumerate(mine):
            comm, rest = r["comm_s"] * MS, (r["step_s"] - r["comm_s"]) * MS
            ax.bar(i, rest, color=COMPUTE_COLOR, gid=f"compute:{kind}:{r['config']}",
                   label="outside collectives" if i == 0 else None)
            ax.bar(i, comm, bottom=rest, color=COMM_COLOR, gid=f"comm:{kind}:{r['config']}",
                   label="inside collectives" if i == 0 else None)
            share = r["comm_s"] / r["step_s"] if r["step_s"] else 0.0
            ax.text(i, rest + comm, f"{rest + comm:.1f} ms\n{share:.0%} comm", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xticks(range(len(mine)), [r["config"] for r in mine], fontsize=8)
        top = max(r["step_s"] for r in mine) * MS
        ax.set(ylabel="median step time (ms)", ylim=(0, top * 1.3), title=f"{kind} steps")
        ax.legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# ---- replicas and routing ------------------------------------------------------------------------


def render_routing(results: Mapping[str, Mapping], load_label: str = "busy seconds") -> Figure:
    """Replicas under one workload, one routing policy per colour. Left: the share of prompt tokens
    each policy's replicas found in their prefix caches. Right: the work each replica got
    (`load_label`), with the busiest replica's share of the total above each group: 1 / N is a
    perfect balance.

    results: {policy: {"hit_rate": 0..1, "load": [per replica]}}.
    """
    func = "render_routing"
    if not results:
        _fail(func, "results", "is empty: give {policy: {'hit_rate': ..., 'load': [...]}}")
    sizes = set()
    for policy, r in results.items():
        if not 0 <= r.get("hit_rate", -1) <= 1:
            _fail(func, f"results[{policy!r}]['hit_rate']",
                  f"must be a share in [0, 1], got {r.get('hit_rate')!r}")
        load = list(r.get("load", []))
        if not load or min(load) < 0 or sum(load) <= 0:
            _fail(func, f"results[{policy!r}]['load']",
                  f"must list each replica's work (>= 0, not all 0), got {load!r}")
        sizes.add(len(load))
    if len(sizes) != 1:
        _fail(func, "results",
              f"policies have different replica counts {sorted(sizes)}: run the same pool size")
    n = sizes.pop()
    policies = list(results)
    fig, axes = _new_figure((11.0, 4.2), ncols=2, gridspec_kw={"width_ratios": [1, 1.6]})
    left, right = axes[0]
    for i, policy in enumerate(policies):
        rate = results[policy]["hit_rate"]
        left.bar(i, rate * 100, color=f"C{i}", gid=f"hit:{policy}")
        left.text(i, rate * 100 + 1, f"{rate:.0%}", ha="center", va="bottom", fontsize=9)
    left.set_xticks(range(len(policies)), [p.replace("_", " ") for p in policies], fontsize=8)
    left.set(ylabel="prompt tokens found in the prefix cache (%)", ylim=(0, 105),
             title="prefix-cache hits")
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        load = list(results[policy]["load"])
        xs = [k + (i - (len(policies) - 1) / 2) * width for k in range(n)]
        bars = right.bar(xs, load, width=width, color=f"C{i}", label=policy.replace("_", " "))
        for k, bar in enumerate(bars):
            bar.set_gid(f"load:{policy}:{k}")
        busiest = max(load) / sum(load)
        right.text(xs[load.index(max(load))], max(load), f"{busiest:.0%}", ha="center", va="bottom",
                   fontsize=8)
    right.set_xticks(range(n), [f"replica {k}" for k in range(n)])
    top = max(max(r["load"]) for r in results.values())
    right.set(ylabel=load_label, ylim=(0, top * 1.25),
              title="work per replica (label: the busiest one's share; "
                    f"1/{n} = {1 / n:.0%} is even)")
    right.legend(loc="upper right", fontsize=8)
    return fig

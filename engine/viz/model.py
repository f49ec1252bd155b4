"""Figures for chapter 00: the model itself, drawn from its real numbers.

    render_architecture(config)       a block diagram of the decoder with the config's numbers in it
    render_parameter_breakdown(table) where the bytes are: one bar per component (`parameter_table`)
    render_loss_curve(training_log)   how tinylab learned: loss and throughput per training step

Every function returns a closed matplotlib Figure: a notebook shows it as a cell's last value, a
script saves it with `fig.savefig(...)`. Artists a test may look for carry a `gid` (the attention
box is "box:attention", the bar of the MLP's up projection is "bar:MLP up",
the raw loss line "loss").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from engine.config import ModelConfig
from engine.viz.training import whole_run

MB = 10**6  # decimal megabytes, like engine.companions.memory's GB
PERCENT = 100.0
# moving-average window over the loss: enough to see the trend through batch noise
SMOOTH_STEPS = 25
BOX_HEIGHT = 0.62  # in diagram units (one unit per row of the diagram)
BOX_WIDTH = 6.4
LAYER_COLOR, ATTN_COLOR, MLP_COLOR = "#eef3fb", "#cfe0f7", "#d9f0d3"
NORM_COLOR, EDGE_COLOR = "#f3f3f3", "#fbe7c6"  # EDGE: the embedding and the LM head at either end
TIED_COLOR = "0.6"


def _new_figure(figsize, ncols: int = 1):
    """A figure that pyplot does not keep: we return it, and the notebook displays it once."""
    fig, axes = plt.subplots(1, ncols, figsize=figsize, layout="constrained")
    plt.close(fig)
    return fig, axes


# ---------------------------------------------------------------------------- architecture


def attention_kind(config: ModelConfig) -> str:
    """MHA (every query head has its own K/V head), MQA (one K/V head for all) or GQA
    (in between)."""
    if config.num_key_value_heads == config.num_attention_heads:
        return "MHA"
    return "MQA" if config.num_key_value_heads == 1 else "GQA"


def _diagram_rows(c: ModelConfig) -> list[tuple[str, str, str, str]]:
    """(gid, text, colour, right-hand note) for each box, top to bottom;
    None colour = plain text."""
    E, F, H, Hkv, D, V = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                          c.num_key_value_heads, c.head_dim, c.vocab_size)
    attn_params = 2 * E * H * D + 2 * E * Hkv * D
    tied = " (tied: the embedding matrix, reused)" if c.tie_word_embeddings else ""
    return [
        ("input", "token ids  [B, T]", None, ""),
        ("box:embed", f"embed_tokens: a lookup in a V × E = {V:,} × {E} table", EDGE_COLOR,
         f"{V * E:,} params"),
        ("box:norm1", f"RMSNorm (E = {E})", NORM_COLOR, ""),
        ("box:attention",
         f"attention ({attention_kind(c)}, RoPE): H = {H} q heads, Hkv = {Hkv} kv heads, D = {D}\n"
         f"q: {E} → {H}·{D}   k, v: {E} → {Hkv}·{D}   o: {H}·{D} → {E}",
         ATTN_COLOR, f"{attn_params:,} params per layer"),
        ("add1", "+ residual", None, ""),
        ("box:norm2", f"RMSNorm (E = {E})", NORM_COLOR, ""),
        ("box:mlp", f"SwiGLU MLP: down(silu(gate(x)) · up(x))\nE → F → E = {E} → {F} → {E}",
         MLP_COLOR, f"{3 * E * F:,} params per layer"),
        ("add2", "+ residual", None, ""),
        ("box:final_norm", f"norm: RMSNorm (E = {E})", NORM_COLOR, ""),
        ("box:lm_head", f"lm_head: E → V = {E} → {V:,}{tied}", EDGE_COLOR,
         "0 new params" if c.tie_word_embeddings else f"{V * E:,} params"),
        ("output", "logits  [B, T, V]: a score for every next token", None, ""),
    ]


def render_architecture(config: ModelConfig) -> Figure:
    """The decoder as boxes, top to bottom, with `config`'s numbers written in.

        token ids → embed → L × [ RMSNorm → attention → + → RMSNorm → SwiGLU → + ]
                  → norm → lm_head → logits
    """
    rows = _diagram_rows(config)
    fig, ax = _new_figure((9.5, 0.75 * len(rows) + 0.6))
    n = len(rows)
    ys = [n - 1 - i for i in range(n)]  # top row at y = n - 1
    layer_rows = [i for i, (gid, *_) in enumerate(rows)
                  if gid in ("box:norm1", "box:attention", "add1", "box:norm2", "box:mlp", "add2")]
    top, bottom = ys[layer_rows[0]] + 0.5, ys[layer_rows[-1]] - 0.5
    frame = FancyBboxPatch((-BOX_WIDTH / 2 - 0.35, bottom), BOX_WIDTH + 0.7, top - bottom,
                           boxstyle="round,pad=0.05", facecolor=LAYER_COLOR, edgecolor="0.4",
                           linestyle="--", gid="box:layers")
    ax.add_patch(frame)
    ax.text(-BOX_WIDTH / 2 - 0.55, (top + bottom) / 2,
            f"× L = {config.num_hidden_layers}\ndecoder\nlayers",
            ha="right", va="center", fontsize=11, fontweight="bold", gid="label:layers")
    for (gid, text, color, note), y in zip(rows, ys, strict=True):
        if color is not None:
            ax.add_patch(FancyBboxPatch((-BOX_WIDTH / 2, y - BOX_HEIGHT / 2), BOX_WIDTH, BOX_HEIGHT,
                                        boxstyle="round,pad=0.03", facecolor=color, edgecolor="0.3",
                                        gid=gid))
        ax.text(0, y, text, ha="center", va="center", fontsize=9, gid=f"text:{gid}")
        if note:
            ax.text(BOX_WIDTH / 2 + 0.5, y, note, ha="left", va="center", fontsize=8.5, color="0.3")
    for y_from, y_to in zip(ys[:-1], ys[1:], strict=True):
        ax.annotate("", xy=(0, y_to + 0.33), xytext=(0, y_from - 0.33),
                    arrowprops={"arrowstyle": "->", "color": "0.35", "lw": 1})
    gids = [gid for gid, *_ in rows]
    for start, end in (("box:norm1", "add1"), ("box:norm2", "add2")):
        _residual(ax, ys[gids.index(start)] + 0.5, ys[gids.index(end)])
    ax.set_xlim(-BOX_WIDTH / 2 - 2.4, BOX_WIDTH / 2 + 2.6)
    ax.set_ylim(-0.6, n - 0.4)
    ax.axis("off")
    ax.set_title(f"{config.architecture}: {config.num_params():,} parameters, "
                 f"context {config.max_position_embeddings:,} tokens", fontsize=11)
    return fig


def _residual(ax, y_from: float, y_to: float) -> None:
    """The skip connection: from the arrow above a norm, around the block, into the `+` below it."""
    x_side = -BOX_WIDTH / 2 - 0.15
    ax.plot([0, x_side, x_side], [y_from, y_from, y_to], color="tab:red", lw=1, gid="residual")
    ax.annotate("", xy=(-0.75, y_to), xytext=(x_side, y_to),
                arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1})


# ---------------------------------------------------------------------------- parameters


def render_parameter_breakdown(table: Sequence[Mapping]) -> Figure:
    """One horizontal bar per component of `engine.lab.inspect_model.parameter_table`: its bytes,
    with megabytes and share written on it. A tied component (0 bytes of its own) is labelled as
    such."""
    if not table:
        raise ValueError("table is empty: pass the rows of "
                         "engine.lab.inspect_model.parameter_table(model)")
    fig, ax = _new_figure((8.5, 0.45 * len(table) + 1.4))
    names = [r["component"] for r in table]
    sizes = np.array([r["bytes"] for r in table], dtype=float) / MB
    y = np.arange(len(table))[::-1]  # first component on top
    bars = ax.barh(y, sizes, color=[_component_color(n) for n in names])
    for bar, name in zip(bars, names, strict=True):
        bar.set_gid(f"bar:{name}")
    widest = sizes.max() if sizes.max() > 0 else 1.0
    for yi, size, r in zip(y, sizes, table, strict=True):
        label = (f"  {size:.2f} MB · {r['share']:.1f}%" if r["params"]
                 else f"  {r['note'] or 'no parameters'}")
        ax.text(size, yi, label, va="center", fontsize=8.5,
                color="black" if r["params"] else TIED_COLOR)
    ax.set_yticks(y, names)
    ax.set_xlim(0, widest * 1.45)  # room for the labels right of the longest bar
    total_bytes, total_params = sum(r["bytes"] for r in table), sum(r["params"] for r in table)
    per_param = total_bytes / total_params if total_params else 0
    ax.set_xlabel("MB (10^6 bytes)")
    ax.set_title(f"where the bytes are: {total_params:,} parameters × {per_param:g} bytes = "
                 f"{total_bytes / MB:.2f} MB", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _component_color(name: str) -> str:
    if name.startswith("attention"):
        return "tab:blue"
    if name.startswith("MLP"):
        return "tab:green"
    if name in ("embeddings", "lm_head"):
        return "tab:orange"
    return "tab:gray"


# ---------------------------------------------------------------------------- training


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean over a centred window of `window` values (narrower at the ends,
    so no point is dropped)."""
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(len(values))
    lo = np.maximum(idx - window // 2, 0)
    hi = np.minimum(idx + window - window // 2, len(values))
    return (cumsum[hi] - cumsum[lo]) / (hi - lo)


def render_loss_curve(training_log: Mapping) -> Figure:
    """Training loss per step (raw and smoothed) and training throughput,
    from a `training_log.json`.

    The log is what `engine.lab.training.train` writes: "loss" and "tokens_per_s" per step, "steps",
    and the "config" (batch_rows × context_tokens tokens per step, used for a tokens-seen axis).
    A resumed run nests its earlier parts under "previous"; we draw the whole run from its first
    step (`engine.viz.training.whole_run`), with a dotted line where each later part began.
    """
    if training_log.get("previous"):
        training_log = whole_run(dict(training_log))
    loss = np.asarray(training_log.get("loss") or [], dtype=float)
    if loss.size == 0:
        raise ValueError("training_log['loss'] is missing or empty: "
                         "pass the parsed training_log.json")
    steps = np.asarray(training_log.get("steps") or range(loss.size), dtype=float)
    if steps.size != loss.size:
        raise ValueError(f"training_log: 'steps' has {steps.size} entries "
                         f"but 'loss' has {loss.size}")
    fig, (ax, ax_tps) = _new_figure((11.0, 4.0), ncols=2)
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="loss per step", gid="loss")
    ax.plot(steps, _moving_average(loss, SMOOTH_STEPS), color="tab:blue", lw=2,
            label=f"mean over {SMOOTH_STEPS} steps", gid="loss:smooth")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (nats per target token)")
    tail = min(SMOOTH_STEPS, loss.size)
    ax.legend(title=f"loss {loss[0]:.2f} at step {steps[0]:,.0f} → {loss[-tail:].mean():.2f} "
                    f"(last {tail} steps)", title_fontsize=9)
    ax.grid(alpha=0.3)
    cfg = training_log.get("config") or {}
    if cfg.get("batch_rows") and cfg.get("context_tokens"):
        per_step = cfg["batch_rows"] * cfg["context_tokens"]
        top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step / MB,
                                                   lambda t: t * MB / per_step))
        top.set_xlabel("tokens seen (millions)")
    tps = training_log.get("tokens_per_s") or []
    if len(tps) == loss.size:
        ax_tps.plot(steps, tps, color="tab:orange", gid="tokens_per_s")
    for a in (ax, ax_tps):
        for step in training_log.get("resumed_at", []):
            a.axvline(step, color="grey", ls=":", lw=1, gid=f"resumed:{step}")
            # halfway up: clear of the legend and of the curves, which lie low by then
            a.annotate(f"resumed at step {step:,}", (step, 0.5),
                       xycoords=("data", "axes fraction"), rotation=90, fontsize=8, color="grey",
                       ha="right", va="center")
    ax_tps.set_xlabel("training step")
    ax_tps.set_ylabel("tokens per second (average so far)")
    ax_tps.grid(alpha=0.3)
    seconds = training_log.get("train_seconds")
    ax_tps.set_title(f"{seconds / 60:.1f} minutes of training" if seconds else "throughput",
                     fontsize=10)
    return fig

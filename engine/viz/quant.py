"""Figures for chapter 07: what quantization does to weights, what it costs in bytes,
time and quality.

    render_weight_histogram   one weight matrix's values on a log count axis, with the 16 levels a
                              per-tensor int4 grid would give them (most weights share a few levels)
    render_channel_max        max |value| per input channel, of the activations and of the weights:
                              the outlier channels that per-tensor scales and W8A8 struggle with
    render_granularity_error  quantization error against bits per weight (scales and zeros
                              included), one point per (bits, granularity)
    render_gemv_bytes         bytes a GEMV reads per output: fp32, bf16,
                              dequantize-then-matmul, fused
    render_layer_speed        speed-up over fp32 of each scheme, per layer shape, decode and prefill
    render_bytes_breakdown    a model's weight bytes by kind, one bar per scheme
                              (what was NOT quantized)
    render_quality            one small panel per quality metric, one bar per scheme,
                              fp32 as a dashed line
    render_gptq_error         a layer's output error, GPTQ against round to nearest, per kind
                              of input text
    render_kv_int8            KV int8: bytes per token per KV dtype (scales included),
                              and decode step time

The functions draw the numbers they are given (the notebook measures them) and return a Figure that
pyplot does not keep. Artists carry a ``gid`` so tests can find them:
a bar is "bar:<panel>:<label>".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from kernels.quant_matmul.reference import INT4_LEVELS, int4_scale_and_zero

HIST_BINS = 201  # odd, so one bin is centred on 0
TOP_CHANNELS = 5  # outlier channels named in the channel-max figure
LEVEL_COLOR, LEVEL_ALPHA = "tab:red", 0.35
REFERENCE_STYLE = {"color": "black", "ls": "--", "lw": 1.2}
PANEL_INCHES = 3.2  # width of one small panel (quality metrics, speed panels)
# room above the tallest and below the shortest speed-up bar (a factor: log axis)
SPEED_MARGIN = 1.4
VALUE_HEADROOM = 1.35  # a quality panel's top: 35% above its highest bar, room for the value labels
QUALITY_COLUMNS = 3  # quality panels per row
QUALITY_PANEL_INCHES = 3.4  # width of one quality panel: room for the value printed past each bar
LOG_SPAN = 100  # a panel whose values span more than this factor gets a log axis (e.g. KL: 1e-4..1)
VALUE_FONT, TICK_FONT, TITLE_FONT = 8.5, 9, 10  # points: readable at the notebook's width
FIGSIZE = (8.0, 4.2)
BYTES_PER_MIB = 2**20
KIND_COLORS = {"quantized linears": "tab:green", "quantized lm_head": "tab:olive",
               "float linears": "tab:blue", "embedding and lm_head": "tab:orange",
               "norms and other": "tab:gray"}


def _new_figure(figsize=FIGSIZE, ncols: int = 1, nrows: int = 1):
    """A figure that pyplot does not keep: we return it, and the notebook displays it once."""
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, layout="constrained", squeeze=False)
    plt.close(fig)
    return fig, axes.ravel()


def _require(func: str, field: str, ok: bool, got) -> None:
    if not ok:
        raise ValueError(f"{func}: {field} {got}")


# ---- the weights themselves ----------------------------------------------------------------------


def per_tensor_int4_levels(weight: torch.Tensor) -> np.ndarray:
    """The 16 values a per-tensor int4 grid (through the matrix's min and max) can represent."""
    scale, zero = int4_scale_and_zero(weight.min().float(), weight.max().float())
    return ((torch.arange(INT4_LEVELS + 1) - zero) * scale).numpy()


def render_weight_histogram(weight: torch.Tensor, name: str) -> Figure:
    """Histogram of every value of ``weight`` (log counts),
    with the per-tensor int4 levels drawn on it."""
    _require("render_weight_histogram", "weight", weight.dim() == 2 and weight.numel() > 0,
             f"must be a non-empty 2-D matrix, got shape {tuple(weight.shape)}")
    values = weight.detach().float().flatten().numpy()
    limit = float(np.abs(values).max())
    fig, (ax,) = _new_figure()
    ax.hist(values, bins=np.linspace(-limit, limit, HIST_BINS), color="tab:blue", gid="hist")
    levels = per_tensor_int4_levels(weight.detach())
    for i, level in enumerate(levels):
        ax.axvline(level, color=LEVEL_COLOR, alpha=LEVEL_ALPHA, lw=1, gid=f"level:{i}",
                   label="the 16 per-tensor int4 levels" if i == 0 else None)
    std = float(values.std())
    ax.set(yscale="log", xlabel="weight value", ylabel="count (log)",
           title=f"{name}: {values.size:,} weights, std {std:.3g}, max |w| {limit:.3g} "
                 f"({limit / std:.0f} std)")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def render_channel_max(activation_max: torch.Tensor, weight_max: torch.Tensor, name: str) -> Figure:
    """Two panels over the input channels j of one layer: max |x_j| (activations, over calibration
    tokens) and max |W[:, j]| (weights). The TOP_CHANNELS largest of each are marked and named."""
    _require("render_channel_max", "activation_max", activation_max.shape == weight_max.shape and
             activation_max.dim() == 1,
             f"and weight_max must both be [K], got {tuple(activation_max.shape)} "
             f"and {tuple(weight_max.shape)}")
    fig, axes = _new_figure((FIGSIZE[0], 5.2), nrows=2)
    for ax, (what, values, color) in zip(axes,
                                         (("activations max |x_j|", activation_max, "tab:purple"),
                                          ("weights max |W[:, j]|", weight_max, "tab:blue")),
                                         strict=True):
        v = values.detach().float().numpy()
        ax.bar(np.arange(v.size), v, width=1.0, color=color, gid=f"channels:{what.split()[0]}")
        top = np.argsort(v)[::-1][:TOP_CHANNELS]
        ax.scatter(top, v[top], color="tab:red", zorder=3, s=14, gid=f"top:{what.split()[0]}")
        median = float(np.median(v))
        ax.axhline(median, **REFERENCE_STYLE)
        ax.set(ylabel=f"{what} (log)", yscale="log", xlim=(-1, v.size),
               title=f"{what.split()[0]}: largest channels {list(map(int, top))}, "
                     f"{v[top[0]] / median:.0f}x the median {median:.3g} (dashed)")
        # 6 rather than 6x10^0
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    axes[-1].set_xlabel(f"input channel j of {name}")
    return fig


def render_granularity_error(rows: Sequence[Mapping]) -> Figure:
    """Relative error ||W - dequant(quant(W))|| / ||W|| against bits per weight, metadata included.

    Each row: {"label": "int4 per-group 128", "bits": 4 or 8, "bits_per_weight": float,
    "error": float}.
    """
    _require("render_granularity_error", "rows", bool(rows), "is empty; quantize at least one way")
    for r in rows:
        _require("render_granularity_error", f"row {r.get('label')!r}",
                 r["error"] > 0 and r["bits_per_weight"] > 0,
                 "needs error > 0 and bits_per_weight > 0 (a log axis), "
                 f"got {r['error']!r}, {r['bits_per_weight']!r}")
    fig, (ax,) = _new_figure()
    for r in rows:
        color = "tab:orange" if r["bits"] == 4 else "tab:blue"
        ax.scatter([r["bits_per_weight"]], [r["error"]], color=color, s=40, zorder=3,
                   gid=f"point:{r['label']}")
        ax.annotate(r["label"], (r["bits_per_weight"], r["error"]), textcoords="offset points",
                    xytext=(6, 2), fontsize=8)
    for bits, color in ((4, "tab:orange"), (8, "tab:blue")):
        ax.scatter([], [], color=color, label=f"int{bits}")
    xs = [r["bits_per_weight"] for r in rows]
    ax.set(yscale="log", xlim=(min(xs) - 0.5, max(xs) + 2.5),
           xlabel="bits per weight (scales and zeros included)",
           ylabel="relative error ||W - W_q|| / ||W||",
           title="Finer granularity: a few more bits, far less error")
    ax.legend(loc="upper right")
    ax.grid(True, which="both", alpha=0.3)
    return fig


# ---- bytes and time ------------------------------------------------------------------------------


def render_gemv_bytes(bytes_per_output: Mapping[str, float], K: int) -> Figure:
    """Horizontal bars: bytes a GEMV reads (and writes) per output, by way of computing it."""
    _require("render_gemv_bytes", "bytes_per_output", bool(bytes_per_output), "is empty")
    labels, values = list(bytes_per_output), [float(v) for v in bytes_per_output.values()]
    fp32 = bytes_per_output.get("fp32")
    fig, (ax,) = _new_figure((FIGSIZE[0], 0.45 * len(labels) + 1.4))
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        color = "tab:red" if "naive" in label else "tab:green" if "fused" in label else "tab:gray"
        ax.barh(i, value, color=color, gid=f"bar:bytes:{label}")
        ratio = f"  ({value / fp32:.2f}x fp32)" if fp32 else ""
        ax.text(value, i, f" {value:,.0f} B{ratio}", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set(xlim=(0, max(values) * 1.45), xlabel=f"bytes moved per output (K = {K:,} inputs)",
           title="A GEMV's time is its bytes: dequantize-then-matmul moves MORE than fp32")
    return fig


def render_layer_speed(rows: Sequence[Mapping], baseline: str = "fp32") -> Figure:
    """Speed-up over ``baseline`` (its time / the scheme's time), one panel per mode ("decode",
    "prefill"), one group of bars per layer shape. Each row: {"mode", "shape", "scheme", "ms"}."""
    _require("render_layer_speed", "rows", bool(rows), "is empty; time at least one layer")
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    schemes = [s for s in dict.fromkeys(r["scheme"] for r in rows) if s != baseline]
    ms = {(r["mode"], r["shape"], r["scheme"]): r["ms"] for r in rows}
    missing = [(m, s) for m in modes for s in shapes if (m, s, baseline) not in ms]
    _require("render_layer_speed", "rows", not missing,
             f"lack the baseline {baseline!r} for {missing}")
    fig, axes = _new_figure((max(FIGSIZE[0], PANEL_INCHES * 1.6 * len(modes)), 4.4),
                            ncols=len(modes))
    ratios = [ms[(m, s, baseline)] / v for (m, s, scheme), v in ms.items() if scheme != baseline]
    # one scale for all panels
    ylim = (min(ratios + [1.0]) / SPEED_MARGIN, max(ratios + [1.0]) * SPEED_MARGIN)
    width = 0.8 / max(len(schemes), 1)
    for ax, mode in zip(axes, modes, strict=True):
        for j, scheme in enumerate(schemes):
            xs = [i for i, s in enumerate(shapes) if (mode, s, scheme) in ms]
            ys = [ms[(mode, shapes[i], baseline)] / ms[(mode, shapes[i], scheme)] for i in xs]
            bars = ax.bar([x + (j - (len(schemes) - 1) / 2) * width for x in xs], ys, width,
                          color=f"C{j}", label=scheme if mode == modes[0] else None)
            for x, bar in zip(xs, bars, strict=True):
                bar.set_gid(f"bar:{mode}:{shapes[x]}:{scheme}")
        ax.axhline(1.0, **REFERENCE_STYLE)
        ax.set_xticks(range(len(shapes)), [_two_lines(s) for s in shapes], fontsize=8)
        ax.set(yscale="log", ylim=ylim, ylabel=f"speed-up over {baseline} (log)", title=f"{mode}")
        # 0.2x rather than 2x10^-1
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=min(len(schemes), 4), fontsize=8)
    return fig


def _two_lines(label: str) -> str:
    """"real down 576x1536" -> "real down\n576x1536":
    long tick labels side by side would overlap."""
    head, _, tail = label.rpartition(" ")
    return f"{head}\n{tail}" if head else label


def render_bytes_breakdown(breakdowns: Mapping[str, Mapping[str, int]], model_name: str) -> Figure:
    """Stacked horizontal bars, one per scheme: the model's weight MiB by kind
    (``engine.loading.quantization.weight_bytes_breakdown``),
    so what stayed in floating point shows."""
    _require("render_bytes_breakdown", "breakdowns", bool(breakdowns), "is empty")
    fig, (ax,) = _new_figure((FIGSIZE[0], 0.55 * len(breakdowns) + 1.6))
    total_max = max(sum(b.values()) for b in breakdowns.values()) / BYTES_PER_MIB
    for i, (scheme, parts) in enumerate(breakdowns.items()):
        left = 0.0
        for kind, color in KIND_COLORS.items():
            mib = parts.get(kind, 0) / BYTES_PER_MIB
            ax.barh(i, mib, left=left, color=color, gid=f"bar:{scheme}:{kind}",
                    label=kind if i == 0 else None)
            left += mib
        ax.text(left, i, f" {left:.1f} MiB", va="center", fontsize=8)
    ax.set_yticks(range(len(breakdowns)), list(breakdowns))
    ax.invert_yaxis()
    ax.set(xlim=(0, total_max * 1.25), xlabel="weight MiB",
           title=f"{model_name}: weight bytes by kind")
    ax.legend(loc="lower right", fontsize=8)
    return fig


# ---- quality -------------------------------------------------------------------------------------


def render_quality(rows: Sequence[Mapping], reference: str = "fp32") -> Figure:
    """One panel per (task, metric), one horizontal bar per scheme (named on the left), its value
    printed at its end; the ``reference`` scheme's value as a dashed line.

    Each row: {"scheme", "task", "metric", "value"} (``engine.lab.eval.evaluate_model`` rows or
    ``engine.loading.quantization.compare_logits`` numbers, plus the scheme). A panel whose values
    are all positive and span more than ``LOG_SPAN`` times gets a log axis, so small values show."""
    _require("render_quality", "rows", bool(rows), "is empty; evaluate at least one scheme")
    panels = list(dict.fromkeys((r["task"], r["metric"]) for r in rows))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    value = {(r["scheme"], r["task"], r["metric"]): float(r["value"]) for r in rows}
    ncols = min(len(panels), QUALITY_COLUMNS)
    nrows = -(-len(panels) // ncols)
    fig, axes = _new_figure((QUALITY_PANEL_INCHES * ncols + 1.4,
                             (0.32 * len(schemes) + 1.0) * nrows), ncols=ncols, nrows=nrows)
    for n, (ax, (task, metric)) in enumerate(zip(axes, panels, strict=False)):
        values = [value.get((s, task, metric)) for s in schemes]
        shown = [v for v in values if v is not None]
        log = min(shown) > 0 and max(shown) > LOG_SPAN * min(shown)
        for i, v in enumerate(values):
            if v is not None:
                ax.barh(i, v, color=f"C{i}", gid=f"bar:{task}/{metric}:{schemes[i]}")
                ax.text(v, i, f" {v:.3g}", va="center", fontsize=VALUE_FONT)
        if (reference, task, metric) in value:
            ax.axvline(value[(reference, task, metric)], **REFERENCE_STYLE)
        if log:
            ax.set_xscale("log")
            ax.set_xlim(min(shown) / 2, max(shown) * VALUE_HEADROOM ** 4)
        else:
            ax.set_xlim(min(0.0, min(shown)), max(max(shown), 0.0) * VALUE_HEADROOM or 1.0)
        ax.set_yticks(range(len(schemes)), schemes if n % ncols == 0 else [""] * len(schemes),
                      fontsize=TICK_FONT)
        ax.set_ylim(len(schemes) - 0.5, -0.5)  # the first scheme on top
        ax.tick_params(axis="x", labelsize=TICK_FONT)
        ax.set_title(f"{task}: {metric}" + (" (log)" if log else ""), fontsize=TITLE_FONT)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Quality by scheme (dashed: {reference})")
    return fig


def render_gptq_error(rows: Sequence[Mapping]) -> Figure:
    """Output error ||x W_q^T - x W^T|| / ||x W^T|| per layer, one bar per method (RTN, GPTQ),
    one panel per kind of input text ("data"). Each row: {"layer", "method", "data", "error"}."""
    _require("render_gptq_error", "rows", bool(rows), "is empty; measure at least one layer")
    datas = list(dict.fromkeys(r["data"] for r in rows))
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    error = {(r["data"], r["layer"], r["method"]): float(r["error"]) for r in rows}
    fig, axes = _new_figure((QUALITY_PANEL_INCHES * len(datas) + 2.0, 0.5 * len(layers) + 1.8),
                            ncols=len(datas))
    height = 0.8 / len(methods)
    top = max(error.values()) * VALUE_HEADROOM
    for n, (ax, data) in enumerate(zip(axes, datas, strict=True)):
        for j, method in enumerate(methods):
            for i, layer in enumerate(layers):
                if (data, layer, method) not in error:
                    continue
                y, v = i + (j - (len(methods) - 1) / 2) * height, error[(data, layer, method)]
                ax.barh(y, v, height, color=f"C{j}", label=method if i == 0 and n == 0 else None,
                        gid=f"bar:{data}:{layer}:{method}")
                ax.text(v, y, f" {v:.3f}", va="center", fontsize=VALUE_FONT)
        ax.set_yticks(range(len(layers)), layers if n == 0 else [""] * len(layers),
                      fontsize=TICK_FONT)
        ax.set_ylim(len(layers) - 0.5, -0.5)
        ax.set_xlim(0, top)
        ax.tick_params(axis="x", labelsize=TICK_FONT)
        ax.set_xlabel("relative output error", fontsize=TICK_FONT)
        ax.set_title(data, fontsize=TITLE_FONT)
    fig.legend(loc="outside lower center", ncols=len(methods), fontsize=TICK_FONT)
    fig.suptitle("int4 per group: GPTQ against round to nearest, on a layer's real inputs")
    return fig


# ---- KV int8 -------------------------------------------------------------------------------------


def render_kv_int8(bytes_per_token: Mapping[str, Mapping[str, float]],
                   step_ms: Mapping[str, Mapping[str, float]], backend_note: str = "") -> Figure:
    """Left: KV bytes per token, {model: {kv dtype: bytes}}; right: an engine decode step's time,
    {model: {kv dtype: ms}}. One group of bars per model, one bar per KV dtype."""
    for field, data in (("bytes_per_token", bytes_per_token), ("step_ms", step_ms)):
        _require("render_kv_int8", field, bool(data) and all(bool(v) for v in data.values()),
                 "must map each model to {kv dtype: value}, got an empty mapping")
    fig, axes = _new_figure((FIGSIZE[0] + 1.5, 3.6), ncols=2)
    panels = ((axes[0], "bytes", bytes_per_token, "KV bytes per token (all layers)", "{:,.0f} B"),
              (axes[1], "step", step_ms, "decode step, ms (median)", "{:.2f}"))
    for ax, panel, data, ylabel, fmt in panels:
        models = list(data)
        dtypes = list(dict.fromkeys(d for v in data.values() for d in v))
        width = 0.8 / len(dtypes)
        for j, dtype in enumerate(dtypes):
            color = f"C{j}"
            for i, model in enumerate(models):
                if dtype not in data[model]:
                    continue
                x, value = i + (j - (len(dtypes) - 1) / 2) * width, float(data[model][dtype])
                ax.bar(x, value, width, color=color, label=dtype if i == 0 else None,
                       gid=f"bar:{panel}:{model}:{dtype}")
                ax.text(x, value, fmt.format(value), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(models)), models)
        ax.set_ylim(0, max(v for d in data.values() for v in d.values()) * VALUE_HEADROOM)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_title("int8 K/V: a quarter of fp32, plus one scale per token and head", fontsize=9)
    axes[1].set_title("...but the torch path dequantizes before it attends" + backend_note,
                      fontsize=9)
    return fig

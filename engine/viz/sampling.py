"""Figures for chapter 01: what sampling does to the next-token distribution,
and what each step costs.

    render_sampling_stages   the distribution after each stage:
                             raw -> temperature -> top-k -> top-p -> min-p
    sampling_widget          sliders for those four knobs, redrawing render_sampling_stages
    render_cumulative_mass   how many of the most likely tokens hold the probability
                             (the tail's length)
    render_loop_trace        the loop step by step:
                             each step's top candidates and the token it chose
    render_step_times        per-step time against sequence length (the naive loop's growing cost)

Every function returns a closed matplotlib Figure: nothing pops up by itself, a notebook shows it by
making it a cell's last value (or with `display(fig)`), a script saves it with `fig.savefig(...)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from engine.sampling import STAGES, TOP_K_OFF, SamplingParams, probs_after_each_stage, top_p_filter
from engine.tokenizer import Tokenizer

# tokens per panel: enough to see the tail the filters cut, few enough to read the labels
TOP_SHOWN = 20
TOP_CANDIDATES = 5  # candidates per step in the loop trace
# raw softmax first, then the filter stages in the order the sampler applies them
PANELS = ("raw", *STAGES)
KEPT_COLOR = "tab:blue"
DROPPED_COLOR = "0.85"  # light grey: the ghost of a token a filter removed
CHOSEN_COLOR = "tab:orange"
# running-median window: one stray slow step (a GC pause, a busy core) cannot bend the line
SMOOTH_STEPS = 9
MS_PER_S = 1000.0
# above 2 the distribution of a small model is nearly flat: nothing new to see
TEMPERATURE_SLIDER_MAX = 2.0
SPACE, NEWLINE = "\u2423", "\u21b5"  # visible stand-ins, so " the" and "the" do not look alike


# ---- token labels --------------------------------------------------------------------------------


def token_label(tokenizer: Tokenizer | None, token_id: int) -> str:
    """How we print a token: its text with spaces and newlines made visible;
    `#id` without a tokenizer."""
    if tokenizer is None:
        return f"#{token_id}"
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if not text or "\ufffd" in text:  # a byte-level piece of a longer character: show the raw piece
        text = tokenizer.token_strings([token_id])[0] or f"#{token_id}"
    return text.replace(" ", SPACE).replace("\n", NEWLINE)


# ---- the sampling stages -------------------------------------------------------------------------


def _stage_title(stage: str, params: SamplingParams) -> str:
    if stage == "raw":
        return "raw softmax"
    if params.greedy:
        return f"{stage}: greedy (T=0), argmax only"
    if stage == "temperature":
        return f"temperature T={params.temperature:g}"
    if stage == "top_k":
        return "top-k off" if params.top_k in TOP_K_OFF else f"top-k k={params.top_k}"
    if stage == "top_p":
        return "top-p off (p=1)" if params.top_p >= 1 else f"top-p p={params.top_p:g}"
    return "min-p off" if params.min_p <= 0 else f"min-p {params.min_p:g}"


def _draw_stage(ax, probs: torch.Tensor, before: torch.Tensor, shown: torch.Tensor,
                title: str) -> None:
    """One panel: kept tokens as coloured bars;
    dropped ones as grey ghosts of their earlier height."""
    y = np.arange(len(shown))
    kept = probs[shown] > 0  # [top]
    ghost = torch.where(kept, torch.zeros_like(before[shown]), before[shown])
    ax.barh(y, ghost.numpy(), color=DROPPED_COLOR, hatch="//", edgecolor="0.6", label="dropped")
    colors = [KEPT_COLOR if k else DROPPED_COLOR for k in kept.tolist()]
    ax.barh(y, probs[shown].numpy(), color=colors, label="after this stage")
    n_kept, n_shown = int((probs > 0).sum()), int(kept.sum())
    hidden = f", {n_kept - n_shown} not shown" if n_kept > n_shown else ""
    ax.set_title(f"{title}\n{n_kept} of {probs.numel()} kept{hidden}", fontsize=9)
    ax.set_xlabel("probability")


def render_sampling_stages(logits_1d: torch.Tensor, params: SamplingParams,
                           tokenizer: Tokenizer | None = None, top: int = TOP_SHOWN) -> Figure:
    """Bar charts of the next-token distribution after each sampling stage, side by side.

    We show the `top` most likely tokens of the raw distribution (no stage reorders them:
    temperature keeps the order and the filters only cut its tail), the most likely at the top. In
    each panel a blue bar is a kept token's probability after that stage (the survivors are
    renormalized, so they grow); a grey hatched bar is a token dropped by then, drawn at its height
    before the filters (after temperature; the raw height when greedy).
    """
    logits_1d = logits_1d.detach().float().cpu().reshape(-1)  # [V]
    stages = probs_after_each_stage(logits_1d, params)
    shown = torch.argsort(logits_1d, descending=True, stable=True)[:top]  # [top] token ids
    fig, axes = plt.subplots(1, len(PANELS), sharey=True, sharex=True,
                             figsize=(2.8 * len(PANELS), 1.2 + 0.28 * len(shown)), squeeze=False)
    before = stages["raw" if params.greedy else "temperature"]  # [V] what the filters start from
    for ax, stage in zip(axes[0], PANELS, strict=True):
        _draw_stage(ax, stages[stage], before, shown, _stage_title(stage, params))
    first = axes[0][0]
    first.set_yticks(np.arange(len(shown)), [token_label(tokenizer, int(i)) for i in shown])
    first.invert_yaxis()  # most likely on top
    top_prob = max(float(stages[s][shown].max()) for s in PANELS)
    first.set_xlim(0, top_prob * 1.1)
    handles = [Rectangle((0, 0), 1, 1, facecolor=KEPT_COLOR),
               Rectangle((0, 0), 1, 1, facecolor=DROPPED_COLOR, edgecolor="0.6", hatch="//")]
    fig.legend(handles, ["kept (renormalized)", "dropped (its height before the filters)"],
               loc="lower center", ncol=2)
    fig.suptitle(f"The next-token distribution after each sampling stage (top {len(shown)} of "
                 f"{logits_1d.numel()} tokens)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    plt.close(fig)
    return fig


def sampling_widget(logits_1d: torch.Tensor, tokenizer: Tokenizer | None = None,
                    top: int = TOP_SHOWN, params: SamplingParams | None = None):
    """Sliders for temperature, top-k, top-p and min-p that redraw `render_sampling_stages`.

    Needs ipywidgets (imported here, so the rest of the module works without it). Returns the
    widget; a notebook shows it with `display(...)`. top_k 0 means off, temperature 0 means greedy.
    """
    import ipywidgets as widgets

    from engine.viz.widgets import interactive_figure

    start = params or SamplingParams(temperature=1.0)
    sliders = {
        "temperature": widgets.FloatSlider(value=start.temperature, min=0.0,
                                           max=TEMPERATURE_SLIDER_MAX, step=0.05,
                                           description="temperature"),
        "top_k": widgets.IntSlider(value=max(start.top_k, 0), min=0, max=top, description="top_k"),
        "top_p": widgets.FloatSlider(value=start.top_p, min=0.05, max=1.0, step=0.05,
                                     description="top_p"),
        "min_p": widgets.FloatSlider(value=start.min_p, min=0.0, max=1.0, step=0.01,
                                     description="min_p"),
    }

    # a PNG image widget, not interactive_output: nbclient's ipywidgets message race (nbclient
    # issue 312) can stall an executed notebook on an Output widget (engine/viz/widgets.py)
    figure = interactive_figure(
        lambda **knobs: render_sampling_stages(logits_1d, SamplingParams(**knobs), tokenizer, top),
        sliders)
    controls = list(sliders.values())
    return widgets.VBox([widgets.HBox(controls[:2]), widgets.HBox(controls[2:]), figure])


# ---- how long is the tail? -----------------------------------------------------------------------


def tokens_to_cover(logits_1d: torch.Tensor, mass: float) -> int:
    """How many of the most likely tokens it takes to hold probability `mass`: what top-p=mass keeps
    (we ask the sampler's own `top_p_filter`,
    so the boundary token and ties count as it counts them)."""
    if not 0 < mass <= 1:
        raise ValueError(f"mass={mass!r} must be in (0, 1]: "
                         "a share of the probability, as top_p is")
    logits_1d = logits_1d.detach().float().cpu().reshape(-1)  # [V]
    return int(torch.isfinite(top_p_filter(logits_1d, mass)).sum())


def render_cumulative_mass(logits: Mapping[str, torch.Tensor],
                           masses: Sequence[float] = (0.8, 0.95)) -> Figure:
    """The probability held by the k most likely tokens, against k (log scale),
    one line per distribution.

        mass ^            ______________ a peaked, short-tailed distribution
         1.0 |     ____.-'       ...---'' a long tail: hundreds of tokens to reach 0.95
             |  .-'   ..--''
             | /  .-''
             +------------------------> k, the number of most likely tokens kept (log)

    A dot marks, for each of `masses`, how many tokens top-p with that p keeps (`tokens_to_cover`).
    logits: {label: next-token logits [V]}; the vocabularies may differ in size.
    """
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, logits_1d) in enumerate(logits.items()):
        logits_1d = logits_1d.detach().float().cpu().reshape(-1)  # [V]
        cumulative = (torch.softmax(logits_1d, dim=-1)
                      .sort(descending=True).values.cumsum(0).numpy())  # [V]
        ax.plot(np.arange(1, len(cumulative) + 1), cumulative, color=f"C{i}", linewidth=2,
                label=f"{label} (vocabulary {len(cumulative):,})")
        for mass in masses:
            k = tokens_to_cover(logits_1d, mass)
            ax.plot([k], [cumulative[k - 1]], "o", color=f"C{i}")
            ax.annotate(f"top-p {mass:g}: {k:,}", (k, cumulative[k - 1]),
                        textcoords="offset points", xytext=(6, -12), fontsize=8, color=f"C{i}")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("k: the k most likely tokens (log scale)")
    ax.set_ylabel("probability they hold together")
    ax.set_title("How many tokens hold the next token's probability (dots: what top-p keeps)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    plt.close(fig)
    return fig


# ---- the loop, step by step ----------------------------------------------------------------------


def render_loop_trace(probs_per_step: Sequence[torch.Tensor] | torch.Tensor,
                      chosen_ids: Sequence[int], tokenizer: Tokenizer | None = None,
                      top: int = TOP_CANDIDATES) -> Figure:
    """One row per generation step: the `top` most likely next tokens, and the token the loop chose.

        step 0 | '4' 0.81 | '3' 0.07 | ... || chosen '4' 0.81
        step 1 | '3' 0.64 | ...              <- the chosen candidate has an orange frame

    probs_per_step: the next-token distribution [V] of each step (rows of [S, V]); chosen_ids: [S].
    The last column repeats the chosen token, so a sampled token from outside the top shows too.
    """
    probs = torch.stack([p.detach().float().cpu().reshape(-1) for p in probs_per_step])  # [S, V]
    if len(chosen_ids) != probs.shape[0]:
        raise ValueError(f"chosen_ids has {len(chosen_ids)} entries but probs_per_step has "
                         f"{probs.shape[0]} steps; give one chosen token per step")
    top_p, top_i = torch.topk(probs, top, dim=-1)  # [S, top] each
    chosen_p = probs[torch.arange(probs.shape[0]), torch.as_tensor(list(chosen_ids))]  # [S]
    grid = torch.cat([top_p, chosen_p[:, None]], dim=1).numpy()  # [S, top + 1]
    fig, ax = plt.subplots(figsize=(1.5 * (top + 1) + 1, 0.6 + 0.5 * len(grid)))
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for s, (ids, chosen) in enumerate(zip(top_i.tolist(), chosen_ids, strict=True)):
        for r, tid in enumerate([*ids, int(chosen)]):
            ink = "white" if grid[s, r] > 0.6 else "black"
            ax.text(r, s, f"{token_label(tokenizer, tid)}\n{grid[s, r]:.2f}", ha="center",
                    va="center", fontsize=8, color=ink)
        if int(chosen) in ids:
            r = ids.index(int(chosen))
            frame = Rectangle((r - 0.5, s - 0.5), 1, 1, fill=False, edgecolor=CHOSEN_COLOR,
                              linewidth=2.5)
            ax.add_patch(frame)
    ax.axvline(top - 0.5, color="black", linewidth=2)
    ax.set_xticks(np.arange(top + 1), [f"#{r + 1}" for r in range(top)] + ["chosen"])
    ax.set_yticks(np.arange(len(grid)), [f"step {s}" for s in range(len(grid))])
    ax.set_title("Each step: the most likely next tokens (probability), "
                 "and the one the loop picked")
    fig.tight_layout()
    plt.close(fig)
    return fig


# ---- what each step costs ------------------------------------------------------------------------


def running_median(values: Sequence[float], window: int = SMOOTH_STEPS) -> np.ndarray:
    """Median over a centred window that shrinks at the ends,
    so a straight line stays exactly straight."""
    values = np.asarray(values, dtype=float)
    n, half = len(values), window // 2
    out = np.empty(n)
    for i in range(n):
        w = min(half, i, n - 1 - i)
        out[i] = np.median(values[i - w:i + w + 1])
    return out


def step_time_slope_ms(step_times_s: Sequence[float]) -> float:
    """How many milliseconds each extra token of sequence adds to a step
    (fit to the smoothed curve).

    Step 0 (the prompt's prefill) is left out: it is a different kind of step in a cached loop.
    """
    if len(step_times_s) < 3:
        raise ValueError(f"need at least 3 step times to fit a slope, got {len(step_times_s)}")
    smooth = running_median(np.asarray(step_times_s[1:]) * MS_PER_S)
    return float(np.polyfit(np.arange(len(smooth)), smooth, 1)[0])


def render_step_times(step_times_s: Sequence[float] | Mapping[str, Sequence[float]],
                      label: str = "naive", prompt_len: int | None = None) -> Figure:
    """Time of each generation step against the length of the sequence at that step.

    step_times_s: one run's step times (named `label`), or {label: step times} for several runs in
    one plot. With `prompt_len`, the x axis is the sequence length (step i runs with prompt_len + i
    tokens); without, it is the step number. Dots are the measured steps, the line their running
    median; the legend gives each run's slope (ms per extra token, step 0 excluded).
    """
    runs = dict(step_times_s) if isinstance(step_times_s, Mapping) else {label: step_times_s}
    offset = prompt_len or 0
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, times) in enumerate(runs.items()):
        color = f"C{i}"
        x = offset + np.arange(len(times))
        y = np.asarray(times, dtype=float) * MS_PER_S
        ax.plot(x, y, ".", color=color, alpha=0.35)
        slope = f": {step_time_slope_ms(times):+.3f} ms per extra token" if len(times) >= 3 else ""
        ax.plot(x, running_median(y), "-", color=color, linewidth=2, label=f"{name}{slope}")
    ax.set_xlabel("tokens in the sequence at this step" if prompt_len
                  else "step (tokens generated so far)")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Time per generation step (dots: measured; line: running median)")
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig

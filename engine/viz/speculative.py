"""Figures for chapter 12: speculative decoding, from what it costs to what one verify step did.

    render_verify_cost        a verify step's seconds against the tokens it feeds (k + 1), as a
                              multiple of one plain decode step, per model: the roofline's promise
    render_acceptance_rule    a target p and a draft q over the same tokens; min(p, q) is what a
                              guess keeps, max(0, p - q) what a rejection's residual draw adds,
                              and the two stack up to exactly p
    render_lossless           histograms of speculative samples against p, one panel per rule,
                              with the chi-square test's p-value
    render_expected_length    mean tokens per verify step against k: measured, and
                              (1 - alpha^(k + 1)) / (1 - alpha)
    render_speedup            decode speed-up against k (per workload) and against the batch size
    render_acceptance_by_position   per workload: the share of verify steps that kept guess i
    render_verify_step        one step of a trace: the tokens each request fed, which guesses the
                              target kept, and the tokens it emitted
    verify_step_player        a slider over a trace's verify steps (ipywidgets)

How to read a verify step (k = 4, the guesses g1..g4 fed after the last real token o)::

    fed             o      g1     g2     g3     g4       one forward, k + 1 rows
                    |      |      |      |
    target after    g1     g2     t                      its choice after each fed token
    guesses         kept   kept   REJECTED  discarded     g3 != t: the walk stops there
    emitted         g1 g2 t                              3 tokens from one step

Artists carry a `gid`: "fed:<request>:<i>" and "out:<request>:<i>" in the verify step; the rest
say what they are ("cost:<model>", "p:<i>", "kept:<i>", ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch import Tensor

from engine.lab.speculative import expected_tokens_per_step
from engine.trace import Trace
from engine.viz._figure import fail as _fail
from engine.viz._figure import need_rows as _need
from engine.viz._figure import new_figure as _new_figure

MS = 1e3  # seconds -> milliseconds
TOP_SHOWN = 10  # tokens drawn one by one in a distribution figure; the rest share one bar
TARGET_COLOR, DRAFT_COLOR = "tab:blue", "tab:orange"
KEPT_COLOR, RESIDUAL_COLOR = "tab:green", "tab:red"
REJECTED_COLOR, DISCARDED_COLOR, FED_COLOR = "tab:red", "0.85", "0.7"
OWN_COLOR = "tab:blue"  # the target's own token in a verify step (a correction or the bonus)
CELL_W, CELL_H = 1.0, 0.7  # a token cell of the verify-step picture, in axis units
BLOCK_GAP = 0.8  # vertical space between two requests' blocks
MAX_REQUESTS_SHOWN = 4  # requests drawn in one verify-step picture (the first ones scheduled)
MAX_LABEL_CHARS = 8  # characters of a token's text printed in its cell
PLAYER_INTERVAL_MS = 800  # the verify-step player's pace
LEGEND_HEADROOM = 1.3  # the y range above the tallest bar: room for the legend, clear of the bars
# p-values below this print as "< 1e-16": that small, a p-value only says "not drawn from p", and
# its digits are beyond what the chi-square approximation can vouch for
SMALLEST_P_SHOWN = 1e-16


def _threads_note(threads: int | None) -> str:
    return f" ({threads} torch thread{'s' if threads != 1 else ''})" if threads else ""


# ---- why it works --------------------------------------------------------------------------------


def render_verify_cost(costs: Mapping[str, Sequence[Mapping]], threads: int | None = None,
                       key: str = "step_s") -> Figure:
    """A verify step's cost against the tokens it feeds, relative to the same model's plain decode
    step (k = 0), one line per model; the dashed line is k + 1 plain steps (what decoding those
    tokens one by one would cost). The gap between them is what speculation can win.

    costs: {model: rows of engine.lab.speculative.verify_step_costs}, each with a k = 0 row."""
    if not costs:
        _fail("render_verify_cost", "costs", "is empty: give {model: rows}")
    fig, axes = _new_figure((7.5, 4.4))
    ax = axes[0][0]
    top = 1
    for model, rows in costs.items():
        _need("render_verify_cost", rows, ("k", key))
        rows = sorted(rows, key=lambda r: r["k"])
        plain = next((r[key] for r in rows if r["k"] == 0), None)
        if plain is None:
            _fail("render_verify_cost", "costs", f"[{model!r}] has no k = 0 row: the plain step "
                  "every other k is compared with")
        ks = [r["k"] for r in rows]
        ratio = [r[key] / plain for r in rows]
        ax.plot(ks, ratio, "o-", label=f"{model} (plain step {plain * MS:.1f} ms)",
                gid=f"cost:{model}")
        top = max(top, *ks)
    ks = list(range(top + 1))
    ax.plot(ks, [k + 1 for k in ks], "--", color="0.5", label="k + 1 plain decode steps",
            gid="k_plus_one")
    ax.axhline(1, color="0.3", linewidth=0.8)
    ax.set(xlabel="guesses verified per step, k (the step feeds k + 1 tokens)",
           ylabel="step time / plain decode step", xticks=ks, ylim=(0, top + 1.5),
           title="What a verify step costs" + _threads_note(threads))
    ax.legend(loc="upper left", fontsize=8)
    return fig


# ---- the acceptance rule -------------------------------------------------------------------------


def _check_distributions(func: str, p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    p, q = p.detach().double().cpu().reshape(-1), q.detach().double().cpu().reshape(-1)
    if p.shape != q.shape:
        _fail(func, "q", f"has {q.numel()} entries, p has {p.numel()}: both must cover the "
              "same vocabulary")
    for name, d in (("p", p), ("q", q)):
        if (d < 0).any() or abs(float(d.sum()) - 1) > 1e-3:
            _fail(func, name, f"must be a distribution (non-negative, sum 1), sums to "
                  f"{float(d.sum()):.4f}")
    return p, q


def _shown_tokens(p: Tensor, q: Tensor, top: int) -> list[int]:
    """The `top` tokens with the largest max(p, q), most likely under p first."""
    chosen = torch.topk(torch.maximum(p, q), min(top, p.numel())).indices.tolist()
    return sorted(chosen, key=lambda i: (-float(p[i]), -float(q[i])))


def _labels(ids: Sequence[int], labels: Sequence[str] | None) -> list[str]:
    """Tick labels: each token's text (spaces as "·", an empty text as "<id>"), then "rest"."""
    if not labels:
        return [str(i) for i in ids] + ["rest"]
    return [repr(labels[i].replace(" ", "·"))[1:-1] or f"<{i}>" for i in ids] + ["rest"]


def render_acceptance_rule(p: Tensor, q: Tensor, labels: Sequence[str] | None = None,
                           top: int = TOP_SHOWN, title: str = "") -> Figure:
    """Left: the target's p and the draft's q over the tokens either likes most (the others
    share the last bar). Right: the chance each token is emitted, split by how: a guess kept
    (min(p, q): drawn from q, kept with min(1, p/q)) or drawn from the residual after a
    rejection (max(0, p - q)). Each stack reaches p exactly (the outline): that is the
    rule's proof. alpha = sum min(p, q) is the chance that a guess is kept.

    labels: one string per vocabulary id (e.g. each token's text), else ids are printed."""
    p, q = _check_distributions("render_acceptance_rule", p, q)
    ids = _shown_tokens(p, q, top)
    rest = [i for i in range(p.numel()) if i not in set(ids)]

    def bars(d: Tensor) -> list[float]:
        return [float(d[i]) for i in ids] + [float(d[rest].sum()) if rest else 0.0]

    kept, extra = torch.minimum(p, q), (p - q).clamp(min=0)
    x = list(range(len(ids) + 1))
    names = _labels(ids, labels)
    fig, axes = _new_figure((12.0, 4.4), 1, 2, sharey=True)
    left, right = axes[0]
    w = 0.4
    left.bar([i - w / 2 for i in x], bars(p), w, color=TARGET_COLOR, label="p: the target",
             gid="p")
    left.bar([i + w / 2 for i in x], bars(q), w, color=DRAFT_COLOR, label="q: the draft",
             gid="q")
    left.set(ylabel="probability", title="Two models, one next token")
    right.bar(x, bars(kept), 0.7, color=KEPT_COLOR, label="min(p, q): a guess of it is kept",
              gid="kept")
    right.bar(x, bars(extra), 0.7, bottom=bars(kept), color=RESIDUAL_COLOR, alpha=0.75,
              label="max(0, p - q): drawn after a rejection", gid="residual")
    right.bar(x, bars(p), 0.7, fill=False, edgecolor="black", linewidth=1.2,
              label="p (the target's own chance)", gid="p_outline")
    alpha = float(kept.sum())
    right.set(title=f"How a token gets out: α = Σ min(p, q) = {alpha:.2f}")
    left.set_ylim(0, max(bars(p) + bars(q)) * LEGEND_HEADROOM)  # shared: both panels
    for ax in (left, right):
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def render_lossless(p: Tensor, counts: Mapping[str, Tensor],
                    tests: Mapping[str, tuple] | None = None, labels: Sequence[str] | None = None,
                    top: int = TOP_SHOWN) -> Figure:
    """One panel per rule: the share of its samples that were each token (bars) against the
    target's p (black marks). tests: {rule: engine.lab.speculative.chi_square's (statistic,
    dof, p-value)}, printed in the panel's title.

    counts: {rule: samples per vocabulary id [V]}."""
    if not counts:
        _fail("render_lossless", "counts", "is empty: give {rule: counts per token}")
    p = p.detach().double().cpu().reshape(-1)
    ids = torch.topk(p, min(top, p.numel())).indices.tolist()
    rest = [i for i in range(p.numel()) if i not in set(ids)]
    x = list(range(len(ids) + 1))
    fig, axes = _new_figure((5.6 * len(counts), 4.4), 1, len(counts), sharey=True)
    for ax, (rule, c) in zip(axes[0], counts.items(), strict=True):
        c = c.detach().double().cpu().reshape(-1)
        if c.shape != p.shape or float(c.sum()) <= 0:
            _fail("render_lossless", "counts", f"[{rule!r}] must hold samples over p's "
                  f"{p.numel()} tokens")
        share = c / c.sum()
        ax.bar(x, [float(share[i]) for i in ids] + [float(share[rest].sum())], 0.7,
               color=KEPT_COLOR, alpha=0.8, label=f"{int(c.sum()):,} samples", gid=f"share:{rule}")
        ax.plot(x, [float(p[i]) for i in ids] + [float(p[rest].sum())], "_", color="black",
                markersize=22, markeredgewidth=2.5, label="p: the target", gid=f"target:{rule}")
        note = ""
        if tests and rule in tests:
            stat, dof, pval = tests[rule]
            shown = f"{pval:.2g}" if pval >= SMALLEST_P_SHOWN else f"< {SMALLEST_P_SHOWN:.0e}"
            note = f"\nchi-square {stat:.1f} on {dof} dof, p-value {shown}"
        ax.set_title(rule + note, fontsize=10)
        ax.set_xticks(x, _labels(ids, labels), rotation=45, ha="right", fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
    axes[0][0].set_ylabel("share of the samples")
    highest = max(max(float(p[i]) for i in ids), float(p[rest].sum()) if rest else 0.0,
                  *(b.get_height() for ax in axes[0] for b in ax.patches))
    axes[0][0].set_ylim(0, highest * LEGEND_HEADROOM)  # shared: every panel
    return fig


# ---- what it buys --------------------------------------------------------------------------------


def render_expected_length(rows: Sequence[Mapping], alphas: Mapping[str, float]) -> Figure:
    """Mean tokens per verify step against k: the measured points of each workload (rows:
    {"workload", "k", "tokens_per_step"}) and, in the same colour, the formula
    (1 - alpha^(k + 1)) / (1 - alpha) for that workload's alpha (alphas: {workload: alpha});
    the dotted line k + 1 is every guess kept (it leaves the frame: no workload comes close)."""
    _need("render_expected_length", rows, ("workload", "k", "tokens_per_step"))
    names = list(dict.fromkeys(r["workload"] for r in rows))
    unknown = sorted(set(alphas) - set(names))
    if unknown:
        _fail("render_expected_length", "alphas", f"names workload(s) {unknown} that no row has")
    ks = list(range(max(r["k"] for r in rows) + 1))
    fig, axes = _new_figure((10.0, 4.6))
    ax = axes[0][0]
    highest = max(r["tokens_per_step"] for r in rows)
    for n, name in enumerate(names):
        color = f"C{n}"
        mine = sorted((r for r in rows if r["workload"] == name), key=lambda r: r["k"])
        ax.plot([r["k"] for r in mine], [r["tokens_per_step"] for r in mine], "o", color=color,
                markersize=7, gid=f"measured:{name}")
        label = name
        if name in alphas:
            a = alphas[name]
            formula = [expected_tokens_per_step(a, k) for k in ks]
            highest = max(highest, *formula)
            ax.plot(ks, formula, "-", color=color, alpha=0.6, gid=f"formula:{name}")
            label += f" (α = {a:.2f})"
        ax.plot([], [], "o-", color=color, label=label)  # one legend entry per workload
    ax.plot(ks, [k + 1 for k in ks], ":", color="0.5", label="every guess kept: k + 1")
    ax.plot([], [], "o", color="0.3", label="dots: measured")
    ax.plot([], [], "-", color="0.3", alpha=0.6, label="lines: the formula")
    ax.set(xlabel="guesses per step, k", ylabel="tokens emitted per verify step",
           xticks=ks, ylim=(0, highest * 1.1),
           title="Tokens per verify step, and the formula (1 - α^(k+1)) / (1 - α)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return fig


def render_speedup(by_k: Sequence[Mapping], by_batch: Sequence[Mapping],
                   threads: int | None = None, switch_off_at: int | None = None) -> Figure:
    """Left: decode speed with speculation / without, against k, one line per workload (rows
    {"workload", "k", "speedup"}). Right: the same against the batch size, one line per setting
    (rows {"setting", "batch", "speedup"}), e.g. always on vs switched off in full batches; a
    dotted line at `switch_off_at` (disable_by_batch_size). Above 1 speculation pays."""
    _need("render_speedup", by_k, ("workload", "k", "speedup"))
    _need("render_speedup", by_batch, ("setting", "batch", "speedup"))
    fig, axes = _new_figure((12.0, 4.4), 1, 2)
    left, right = axes[0]
    sweeps = ((by_k, left, "workload", "k"), (by_batch, right, "setting", "batch"))
    for series, ax, key, x in sweeps:
        for name in dict.fromkeys(r[key] for r in series):
            mine = sorted((r for r in series if r[key] == name), key=lambda r: r[x])
            ax.plot([r[x] for r in mine], [r["speedup"] for r in mine], "o-", label=name,
                    gid=f"speedup:{name}")
        ax.axhline(1, color="0.3", linewidth=0.8)
        ax.legend(loc="best", fontsize=8)
        ax.set_ylim(0, max(1.5, max(r["speedup"] for r in series) * 1.15))
    left.set(xlabel="guesses per step, k", ylabel="decode tokens/s: speculative / plain",
             xticks=sorted({r["k"] for r in by_k}), title="Speed-up against k, batch 1"
             + _threads_note(threads))
    batches = sorted({r["batch"] for r in by_batch})
    if switch_off_at is not None:
        right.axvline(switch_off_at, color="0.4", linestyle=":", gid="switch_off",
                      label=f"disable_by_batch_size = {switch_off_at}")
        right.legend(loc="best", fontsize=8)
    right.set_xscale("log", base=2)
    right.set(xlabel="requests decoding together (max_num_seqs)", xticks=batches,
              title="Speed-up against the batch size")
    right.set_xticklabels([str(b) for b in batches])
    return fig


def render_acceptance_by_position(stats: Mapping[str, object]) -> Figure:
    """Grouped bars: for each workload, the share of verify steps that kept guess 1, 2, ..., k
    (a guess is only kept if every one before it was, so the bars fall). stats: {workload:
    engine.companions.metrics.SpecDecodeStats}; the legend gives each mean acceptance length."""
    if not stats:
        _fail("render_acceptance_by_position", "stats", "is empty: give {workload: stats}")
    k = max(len(s.accepted_per_position) for s in stats.values())
    if k == 0:
        _fail("render_acceptance_by_position", "stats", "hold no guesses: serve with speculation")
    fig, axes = _new_figure((8.0, 4.4))
    ax = axes[0][0]
    width = 0.8 / len(stats)
    for n, (name, s) in enumerate(stats.items()):
        shares = s.acceptance_by_position() + [0.0] * (k - len(s.accepted_per_position))
        xs = [i + 1 + (n - (len(stats) - 1) / 2) * width for i in range(k)]
        ax.bar(xs, shares, width, color=f"C{n}", gid=f"position:{name}",
               label=f"{name}: {s.mean_acceptance_length:.2f} tokens per verify step")
    ax.set(xlabel="guess position i", ylabel="share of verify steps that kept guess i",
           xticks=list(range(1, k + 1)), ylim=(0, 1.05),
           title="Which workloads accept: kept guesses by position")
    ax.legend(loc="upper right", fontsize=8)
    return fig


# ---- one verify step -----------------------------------------------------------------------------


def verify_steps(trace: Trace) -> list[int]:
    """The indices of the trace's steps in which some request verified guesses."""
    return [i for i, s in enumerate(trace.steps) if any(x.draft_token_ids for x in s.scheduled)]


def _last_token_before(trace: Trace, step: int, request_id: str) -> int | None:
    """The token a decode fed first at `step`: the last one the request emitted before it."""
    for report in reversed(trace.steps[:step]):
        for s in report.scheduled:
            if s.request_id == request_id and s.new_token_ids:
                return s.new_token_ids[-1]
    return None


def _token_text(token: int | None, tokenizer) -> str:
    if token is None:
        return "?"
    if tokenizer is None:
        return str(token)
    text = tokenizer.decode([token]).replace(" ", "·").replace("\n", "⏎") or f"<{token}>"
    return text if len(text) <= MAX_LABEL_CHARS else text[:MAX_LABEL_CHARS - 1] + "…"


def _cell(ax, x: float, y: float, text: str, color, gid: str, edge: str = "0.4") -> None:
    ax.add_patch(Rectangle((x, y), CELL_W * 0.94, CELL_H, facecolor=color, edgecolor=edge,
                           gid=gid))
    ax.text(x + CELL_W * 0.47, y + CELL_H / 2, text, ha="center", va="center", fontsize=8)


def _draw_verify_block(ax, y: float, s, fed_first: int | None, tokenizer) -> None:
    """One request's two rows: what it fed (top) and what the target chose after each (bottom)."""
    guesses, kept = s.draft_token_ids, s.num_accepted or 0
    fed = [fed_first, *guesses]
    for i, token in enumerate(fed):
        color = (FED_COLOR if i == 0 else KEPT_COLOR if i <= kept
                 else REJECTED_COLOR if i == kept + 1 else DISCARDED_COLOR)
        _cell(ax, i * CELL_W, y, _token_text(token, tokenizer), color, f"fed:{s.request_id}:{i}")
    for i, token in enumerate(s.new_token_ids):
        color = KEPT_COLOR if i < kept else OWN_COLOR
        _cell(ax, i * CELL_W, y - CELL_H - 0.15, _token_text(token, tokenizer), color,
              f"out:{s.request_id}:{i}")
    bonus = kept == len(guesses) and len(s.new_token_ids) > kept
    verdict = (f"kept {kept} of {len(guesses)}" + (" + the bonus token" if bonus else "")
               + f": {len(s.new_token_ids)} token{'s' if len(s.new_token_ids) != 1 else ''}")
    ax.text(-0.15, y + CELL_H / 2, f"{s.request_id} fed", ha="right", va="center", fontsize=8)
    ax.text(-0.15, y - CELL_H / 2 - 0.15, "target chose", ha="right", va="center", fontsize=8)
    ax.text(len(fed) * CELL_W + 0.2, y - 0.1, verdict, ha="left", va="center", fontsize=8)


def render_verify_step(trace: Trace, step: int, tokenizer=None) -> Figure:
    """One step of a trace, verify by verify: per request (the first MAX_REQUESTS_SHOWN), the
    tokens fed (its last token, then its guesses: kept, the first rejected, the rest discarded)
    and under each the token the target chose after it (green: it equals the next guess, which is
    kept; blue: the target's own token, a correction or the bonus). Requests that decoded without
    guesses show one fed token. tokenizer: print token text instead of ids."""
    if not trace.steps:
        _fail("render_verify_step", "trace", "has no steps: run the engine first")
    if not -len(trace) <= step < len(trace):
        _fail("render_verify_step", "step", f"{step} is outside the trace's steps "
              f"0..{len(trace) - 1}")
    step %= len(trace)
    decodes = [s for s in trace[step].scheduled if s.phase == "decode"][:MAX_REQUESTS_SHOWN]
    if not decodes:
        _fail("render_verify_step", "step", f"{step} decodes nothing (a prefill step): pick one "
              f"of verify_steps(trace), e.g. {verify_steps(trace)[:5]}")
    width = max(len(s.draft_token_ids) + 1 for s in decodes)
    block = 2 * CELL_H + 0.15 + BLOCK_GAP
    fig, axes = _new_figure((max(8.0, 2.6 + 1.05 * width + 2.4), 0.9 + 1.35 * len(decodes)))
    ax = axes[0][0]
    for n, s in enumerate(decodes):
        _draw_verify_block(ax, -n * block, s, _last_token_before(trace, step, s.request_id),
                           tokenizer)
    ax.set_xlim(-0.1, width * CELL_W + 2.6)
    ax.set_ylim(-(len(decodes) - 1) * block - CELL_H - 0.3, CELL_H + 0.1)
    ax.axis("off")
    ax.legend(handles=[Patch(color=FED_COLOR, label="the last real token"),
                       Patch(color=KEPT_COLOR, label="guess kept"),
                       Patch(color=REJECTED_COLOR, label="first rejected guess"),
                       Patch(color=DISCARDED_COLOR, label="discarded after it"),
                       Patch(color=OWN_COLOR, label="the target's own token")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5, fontsize=8, frameon=False)
    ax.set_title(f"Step {step}: one forward verifies every guess", fontsize=10)
    return fig


def verify_step_player(trace: Trace, tokenizer=None, interval_ms: int = PLAYER_INTERVAL_MS):
    """A Play button and a slider over the trace's verify steps, redrawing `render_verify_step`.
    Needs ipywidgets (imported here). Without widgets, draw `render_verify_step` at a few of
    `verify_steps(trace)`."""
    import ipywidgets as widgets

    from engine.viz.widgets import interactive_figure

    steps = verify_steps(trace)
    if not steps:
        _fail("verify_step_player", "trace", "has no verify step: serve with speculation")
    play = widgets.Play(value=0, min=0, max=len(steps) - 1, step=1, interval=interval_ms,
                        description="play")
    slider = widgets.IntSlider(value=0, min=0, max=len(steps) - 1, description="verify step")
    widgets.jslink((play, "value"), (slider, "value"))
    figure = interactive_figure(lambda i: render_verify_step(trace, steps[i], tokenizer),
                                {"i": slider})
    return widgets.VBox([widgets.HBox([play, slider]), figure])

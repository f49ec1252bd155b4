"""The model card's figure: what tinylab could do at each step of its training.

    probe_history        the probe rows of a training log, earlier parts
                         (chained through "previous") first
    loss_history         (steps, losses) of the same chain
    whole_run            the chain as one log from its first step: steps, losses, throughput
                         since the start, seconds of all parts (what `render_loss_curve` draws)
    render_probe_curve   left: the fixed probe's exact rates per task against the step; right: the
                         training loss; both mark where the lookup curriculum ends and the decay
                         starts

    python -m engine.viz.training runs/scratch        # writes runs/scratch/recall_curve.png

The probe (`engine/lab/training.py: probe`) is teacher-forced on held-out documents that `eval` does
not score, so its numbers track the eval table but are not it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from engine.viz._figure import fail, new_figure

# probe key -> legend label (the keys `probe` writes)
PROBE_SERIES = {
    "recall": "recall, all lengths",
    "recall_long": "recall, prompts of 256+ tokens",
    "recall_6facts": "recall, 6-fact prompts",
    "arith": "arith",
    "json": "json (whole object exact)",
}
# the loss is noisy step to step (4 rows per step): a running mean over this many
LOSS_SMOOTHING_STEPS = 50


def _chain(log: dict) -> list[dict]:
    """The parts of a training log, oldest first
    (a resumed part keeps its predecessor in "previous")."""
    parts = []
    while log:
        parts.append(log)
        log = log.get("previous")
    return parts[::-1]


def probe_history(log: dict) -> list[dict]:
    """Every probe row of the chain, by step;
    a later part's row wins where two parts probed the same step."""
    rows = {row["step"]: row for part in _chain(log) for row in part.get("probe", [])}
    return [rows[s] for s in sorted(rows)]


def loss_history(log: dict) -> tuple[list[int], list[float]]:
    """(steps, losses) of the chain; a later part's value wins where parts overlap
    (a resumed run)."""
    loss = {s: v for part in _chain(log)
            for s, v in zip(part.get("steps", []), part.get("loss", []), strict=False)}
    steps = sorted(loss)
    return steps, [loss[s] for s in steps]


def _throughput_since_start(parts: list[dict], first_step: int) -> dict[int, float]:
    """Tokens per second from the run's first step to each step, across resumed parts.

    Each part logs its own average since *it* started: step s of a part that began at step s0
    has tokens_per_s = (s + 1 - s0) * tokens_per_step / elapsed. We undo that to get the part's
    elapsed seconds, add the wall seconds of the parts before it, and divide the tokens of the
    whole run so far by the sum. A part without a throughput series leaves the result empty."""
    result, before_s = {}, 0.0
    for part in parts:
        steps, tps = part.get("steps", []), part.get("tokens_per_s", [])
        cfg = part.get("config", {})
        per_step = cfg.get("batch_rows", 0) * cfg.get("context_tokens", 0)
        if not steps or len(tps) != len(steps) or not per_step or not all(tps):
            return {}
        start = part.get("resumed_from_step", steps[0])
        elapsed = [(s + 1 - start) * per_step / v for s, v in zip(steps, tps, strict=True)]
        result.update({s: (s + 1 - first_step) * per_step / (before_s + e)
                       for s, e in zip(steps, elapsed, strict=True)})
        before_s += part.get("train_seconds", elapsed[-1])
    return result


def whole_run(log: dict) -> dict:
    """One log for the whole training run, however many times it was resumed.

    A resumed run's `training_log.json` holds only its last part at the top level, the earlier
    ones nested under "previous"; drawn as it is, the curve would start where the last part
    started. Here every series runs from the first step (a later part wins where two overlap),
    "train_seconds" / "cpu_seconds" are the sums over the parts, "config" is the last part's,
    and "resumed_at" lists the steps where a new part began."""
    parts = _chain(log)
    steps, losses = loss_history(log)
    tps = _throughput_since_start(parts, steps[0]) if steps else {}
    merged = {"config": log.get("config", {}), "steps": steps, "loss": losses,
              "tokens_per_s": [round(tps[s]) for s in steps] if tps else [],
              "probe": probe_history(log),
              "resumed_at": [p["resumed_from_step"] for p in parts[1:] if "resumed_from_step" in p]}
    for key in ("train_seconds", "cpu_seconds"):
        if any(key in p for p in parts):
            merged[key] = round(sum(p.get(key, 0.0) for p in parts), 1)
    return merged


def _marks(log: dict) -> list[tuple[int, str]]:
    """Vertical lines: where the lookup curriculum ends and the learning-rate decay starts
    (last part's config)."""
    cfg, marks = log.get("config", {}), []
    if cfg.get("curriculum_steps"):
        marks.append((cfg["curriculum_steps"], "drills end, rows 256 -> 512"))
    if cfg.get("decay_steps"):
        steps = max(1, cfg["total_tokens"] // (cfg["batch_rows"] * cfg["context_tokens"]))
        marks.append((steps - cfg["decay_steps"], "learning rate decays"))
    return marks


def render_probe_curve(log: dict, title: str = "tinylab during training") -> Figure:
    """Two panels: the probe's exact rates against the step, and the running-mean training loss."""
    history = probe_history(log)
    if not history:
        fail("render_probe_curve", "log", "has no probe rows (train with probe_every > 0)")
    fig, axes = new_figure((12, 4.8), 1, 2)
    ax, ax_loss = axes[0]
    for key, label in PROBE_SERIES.items():
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            x, y = zip(*points, strict=True)
            ax.plot(x, y, marker="o", markersize=3, label=label, gid=f"probe:{key}")
    ax.set(xlabel="training step", ylabel="exact answers on the probe", ylim=(-0.02, 1.02),
           title=f"probe: {len(history)} measurements, n = "
                 f"{log.get('config', {}).get('probe_n', '?')} per task")
    steps, losses = loss_history(log)
    k = min(LOSS_SMOOTHING_STEPS, len(losses))
    smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
    ax_loss.plot(steps[k - 1:], smooth, color="black", gid="loss")
    ax_loss.set(xlabel="training step", ylabel=f"training loss (mean of {k} steps)", ylim=(0, None),
                title="loss on the supervised tokens")
    for a in (ax, ax_loss):
        for step, text in _marks(log):
            a.axvline(step, color="grey", linestyle=":", linewidth=1)
            a.annotate(text, (step, 0.98), xycoords=("data", "axes fraction"), rotation=90,
                       fontsize=8, color="grey", ha="right", va="top")
        a.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=len(PROBE_SERIES),
               fontsize=9)
    fig.suptitle(title)
    return fig


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m engine.viz.training <folder with training_log.json>")
    folder = Path(argv[0])
    log_path = folder / "training_log.json"
    if not log_path.exists():
        sys.exit(f"{log_path} does not exist: "
                 "give the folder `python -m engine train-tinylab --out` wrote")
    out = folder / "recall_curve.png"
    render_probe_curve(json.loads(log_path.read_text())).savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The model card's training figure: probe rows and losses gathered across resumed parts, and drawn."""

import pytest

from engine.viz.model import render_loss_curve
from engine.viz.training import loss_history, probe_history, render_probe_curve, whole_run


def _log() -> dict:
    first = {"steps": [0, 1, 2, 3], "loss": [4.0, 3.0, 2.0, 1.5],
             "probe": [{"step": 2, "recall": 0.1, "arith": 0.5}, {"step": 4, "recall": 0.2, "arith": 0.6}]}
    # resumed at step 3 (its step-3 loss replaces the first part's) and probed step 4 again
    return {"previous": first, "steps": [3, 4, 5], "loss": [1.4, 1.2, 1.0],
            "probe": [{"step": 4, "recall": 0.3, "arith": 0.7}, {"step": 6, "recall": 0.5, "arith": 0.8}],
            "config": {"probe_n": 48, "curriculum_steps": 2, "decay_steps": 2, "total_tokens": 6 * 8,
                       "batch_rows": 2, "context_tokens": 4}}


def test_the_chain_is_read_oldest_first_and_a_later_part_wins():
    assert [(r["step"], r["recall"]) for r in probe_history(_log())] == [(2, 0.1), (4, 0.3), (6, 0.5)]
    assert loss_history(_log()) == ([0, 1, 2, 3, 4, 5], [4.0, 3.0, 2.0, 1.4, 1.2, 1.0])


def test_the_figure_draws_each_probed_task_and_the_loss():
    fig = render_probe_curve(_log())
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    assert list(lines["probe:recall"].get_ydata()) == [0.1, 0.3, 0.5]
    assert list(lines["probe:arith"].get_xdata()) == [2, 4, 6]
    assert "probe:json" not in lines  # not probed in this log: no empty series
    assert len(lines["loss"].get_ydata()) >= 1


def test_a_log_without_probes_is_refused_by_name():
    with pytest.raises(ValueError, match="render_probe_curve: log has no probe rows"):
        render_probe_curve({"steps": [0], "loss": [1.0]})


def _resumed_log() -> dict:
    # 2 rows x 4 tokens = 8 tokens a step. Part 1 ran steps 0-1 in 1 s each; part 2, resumed at step 2, took 1 s for
    # step 2 and 3 s for step 3. Each part logs tokens/s since ITS start: part 2's step 3 is 2 * 8 / 4 s = 4.
    cfg = {"batch_rows": 2, "context_tokens": 4}
    first = {"config": cfg, "steps": [0, 1], "loss": [6.9, 5.0], "tokens_per_s": [8, 8], "resumed_from_step": 0,
             "train_seconds": 2.0, "cpu_seconds": 3.0}
    return {"config": cfg, "previous": first, "steps": [2, 3], "loss": [4.0, 3.0], "tokens_per_s": [8, 4],
            "resumed_from_step": 2, "train_seconds": 4.0, "cpu_seconds": 7.0}


def test_whole_run_starts_at_step_zero_and_adds_up_the_parts_seconds():
    run = whole_run(_resumed_log())
    assert run["steps"] == [0, 1, 2, 3] and run["loss"] == [6.9, 5.0, 4.0, 3.0]
    assert (run["train_seconds"], run["cpu_seconds"], run["resumed_at"]) == (6.0, 10.0, [2])


def test_whole_run_throughput_counts_every_token_since_step_zero():
    # step 2: 3 steps x 8 tokens in 2 s + 1 s = 8 tokens/s; step 3: 32 tokens in 2 s + 4 s = 5.33 -> 5
    assert whole_run(_resumed_log())["tokens_per_s"] == [8, 8, 8, 5]


def test_the_loss_curve_of_a_resumed_run_is_drawn_from_step_zero():
    fig = render_loss_curve(_resumed_log())
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    assert list(lines["loss"].get_xdata()) == [0, 1, 2, 3] and lines["loss"].get_ydata()[0] == 6.9
    assert "resumed:2" in lines
    assert "0.1 minutes" in fig.axes[1].get_title()  # 2 s + 4 s in all

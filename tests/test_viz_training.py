"""The model card's training figure: probe rows and losses gathered across resumed parts, and drawn."""

import pytest

from engine.viz.training import loss_history, probe_history, render_probe_curve


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

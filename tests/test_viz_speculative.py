"""Chapter 12's figures draw exactly the numbers they are given: the acceptance rule's stacks add up to p, the
formula line is the formula, and a verify step's cells say which guesses the target kept, rejected and
discarded, from the trace alone."""

import matplotlib.colors as mcolors
import pytest
import torch

from engine.companions.metrics import SpecDecodeStats
from engine.lab.speculative import expected_tokens_per_step
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.sampling import SamplingParams
from engine.trace import ScheduledRequest, StepReport, Trace
from engine.viz.speculative import (
    DISCARDED_COLOR,
    FED_COLOR,
    KEPT_COLOR,
    OWN_COLOR,
    REJECTED_COLOR,
    render_acceptance_by_position,
    render_acceptance_rule,
    render_expected_length,
    render_lossless,
    render_speedup,
    render_verify_cost,
    render_verify_step,
    verify_step_player,
    verify_steps,
)


def _patches(fig, gid):
    return [p for ax in fig.axes for p in ax.patches if p.get_gid() == gid]


def _line(fig, gid):
    return next(line for ax in fig.axes for line in ax.lines if line.get_gid() == gid)


def _hex(patch):
    return mcolors.to_hex(patch.get_facecolor())


def test_the_cost_figure_draws_each_model_against_its_own_plain_step():
    costs = {"a": [{"k": 0, "step_s": 0.002}, {"k": 2, "step_s": 0.003}, {"k": 1, "step_s": 0.0025}],
             "b": [{"k": 0, "step_s": 0.040}, {"k": 2, "step_s": 0.048}]}
    fig = render_verify_cost(costs, threads=1)
    line = _line(fig, "cost:a")
    assert list(line.get_xdata()) == [0, 1, 2] and list(line.get_ydata()) == pytest.approx([1.0, 1.25, 1.5])
    assert list(_line(fig, "cost:b").get_ydata()) == pytest.approx([1.0, 1.2])
    assert list(_line(fig, "k_plus_one").get_ydata()) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"render_verify_cost: costs \['c'\] has no k = 0 row"):
        render_verify_cost({"c": [{"k": 1, "step_s": 0.1}]})


P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
Q = torch.tensor([0.2, 0.5, 0.05, 0.05, 0.2])


def test_the_rule_figure_stacks_kept_and_residual_up_to_p_token_by_token():
    fig = render_acceptance_rule(P, Q, top=3)
    # the three tokens with the largest max(p, q) are 0, 1, 4 (0.5, 0.5, 0.2); ordered by p: 0, 1, 4; rest = 2, 3
    kept = [b.get_height() for b in _patches(fig, "kept")]
    extra = [b.get_height() for b in _patches(fig, "residual")]
    target = [b.get_height() for b in _patches(fig, "p_outline")]
    assert kept == pytest.approx([0.2, 0.2, 0.05, 0.05 + 0.05])
    assert extra == pytest.approx([0.3, 0.0, 0.0, 0.10 + 0.05])
    assert [k + e for k, e in zip(kept, extra, strict=True)] == pytest.approx(target)
    assert target == pytest.approx([0.5, 0.2, 0.05, 0.25])
    assert [b.get_height() for b in _patches(fig, "q")] == pytest.approx([0.2, 0.5, 0.2, 0.1])
    assert "α = Σ min(p, q) = 0.55" in fig.axes[1].get_title()


def test_the_rule_figure_prints_token_text_and_refuses_what_is_not_a_distribution():
    fig = render_acceptance_rule(P, Q, labels=[" a", "b", "", "d", "e"], top=5)
    names = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert names == ["·a", "b", "<2>", "d", "e", "rest"]
    with pytest.raises(ValueError, match="render_acceptance_rule: q must be a distribution"):
        render_acceptance_rule(P, Q * 2)
    with pytest.raises(ValueError, match="render_acceptance_rule: q has 4 entries, p has 5"):
        render_acceptance_rule(P, Q[:4] / Q[:4].sum())


def test_the_lossless_figure_draws_each_rules_shares_against_p_with_its_test():
    counts = {"right": torch.tensor([50, 20, 15, 10, 5]), "wrong": torch.tensor([10, 60, 10, 10, 10])}
    fig = render_lossless(P, counts, tests={"right": (0.0, 4, 1.0), "wrong": (900.0, 4, 0.0)}, top=2)
    assert [b.get_height() for b in _patches(fig, "share:right")] == pytest.approx([0.5, 0.2, 0.3])
    assert [b.get_height() for b in _patches(fig, "share:wrong")] == pytest.approx([0.1, 0.6, 0.3])
    assert list(_line(fig, "target:wrong").get_ydata()) == pytest.approx([0.5, 0.2, 0.3])
    assert "p-value 1" in fig.axes[0].get_title() and "p-value < 1e-16" in fig.axes[1].get_title()
    assert "chi-square" not in render_lossless(P, counts, top=2).axes[0].get_title()


def test_the_length_figure_draws_the_formula_for_each_workloads_alpha():
    rows = [{"workload": "w", "k": 1, "tokens_per_step": 1.5}, {"workload": "w", "k": 3, "tokens_per_step": 2.0},
            {"workload": "v", "k": 2, "tokens_per_step": 1.1}]
    fig = render_expected_length(rows, {"w": 0.6})
    assert list(_line(fig, "measured:w").get_ydata()) == [1.5, 2.0]
    assert list(_line(fig, "formula:w").get_ydata()) == pytest.approx(
        [expected_tokens_per_step(0.6, k) for k in range(4)])
    assert [line for ax in fig.axes for line in ax.lines if line.get_gid() == "formula:v"] == []
    with pytest.raises(ValueError, match=r"alphas names workload\(s\) \['x'\]"):
        render_expected_length(rows, {"x": 0.5})


def test_the_speedup_figure_draws_both_sweeps_and_the_switch():
    by_k = [{"workload": "json", "k": 4, "speedup": 1.6}, {"workload": "json", "k": 1, "speedup": 1.3}]
    by_batch = [{"setting": "on", "batch": 16, "speedup": 0.3}, {"setting": "on", "batch": 1, "speedup": 1.5}]
    fig = render_speedup(by_k, by_batch, switch_off_at=8)
    assert list(_line(fig, "speedup:json").get_xdata()) == [1, 4]
    assert list(_line(fig, "speedup:on").get_ydata()) == [1.5, 0.3]
    assert list(_line(fig, "switch_off").get_xdata()) == [8, 8]
    with pytest.raises(ValueError, match=r"render_speedup: rows lack the key\(s\) \['speedup'\]"):
        render_speedup([{"workload": "json", "k": 1}], by_batch)


def test_the_position_bars_are_the_share_of_drafts_that_kept_each_guess():
    stats = {"good": SpecDecodeStats(10, 40, 18, (8, 6, 3, 1), 28), "poor": SpecDecodeStats(5, 10, 1, (1, 0), 6)}
    fig = render_acceptance_by_position(stats)
    assert [b.get_height() for b in _patches(fig, "position:good")] == pytest.approx([0.8, 0.6, 0.3, 0.1])
    assert [b.get_height() for b in _patches(fig, "position:poor")] == pytest.approx([0.2, 0.0, 0.0, 0.0])
    assert "2.80 tokens per verify step" in " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())


def _trace(draft, kept, new):
    """A prefill that emitted token 7, a plain decode that emitted 8, then one verify step (step 2)."""
    return Trace(steps=[StepReport(0, 0.0, 1.0, scheduled=[ScheduledRequest("r0", "prefill", 0, 5, 1, [7])]),
                        StepReport(1, 1.0, 2.0, scheduled=[ScheduledRequest("r0", "decode", 5, 6, 1, [8])]),
                        StepReport(2, 2.0, 3.0, scheduled=[ScheduledRequest("r0", "decode", 6, 7 + len(draft),
                                                                            len(new), new, draft, kept)])])


def test_a_verify_step_shows_kept_rejected_and_discarded_guesses_and_the_targets_own_token():
    fig = render_verify_step(_trace([5, 6, 9, 9], 2, [5, 6, 4]), 2)
    fed = [_patches(fig, f"fed:r0:{i}")[0] for i in range(5)]
    out = [_patches(fig, f"out:r0:{i}")[0] for i in range(3)]
    colors = [mcolors.to_hex(c) for c in (FED_COLOR, KEPT_COLOR, KEPT_COLOR, REJECTED_COLOR, DISCARDED_COLOR)]
    assert [_hex(p) for p in fed] == colors
    assert [_hex(p) for p in out] == [mcolors.to_hex(c) for c in (KEPT_COLOR, KEPT_COLOR, OWN_COLOR)]
    assert _patches(fig, "out:r0:3") == []
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts[:5] == ["8", "5", "6", "9", "9"]  # the last real token: the latest one emitted before
    assert "kept 2 of 4: 3 tokens" in texts


def test_a_verify_step_that_keeps_every_guess_adds_the_bonus_token():
    fig = render_verify_step(_trace([5, 6], 2, [5, 6, 8]), 2)
    assert _hex(_patches(fig, "out:r0:2")[0]) == mcolors.to_hex(OWN_COLOR)
    assert "kept 2 of 2 + the bonus token: 3 tokens" in [t.get_text() for t in fig.axes[0].texts]


def test_a_step_without_decodes_names_the_verify_steps_to_pick_instead():
    trace = _trace([5, 6], 1, [5, 3])
    assert verify_steps(trace) == [2]
    with pytest.raises(ValueError, match=r"render_verify_step: step 0 decodes nothing .* e.g. \[2\]"):
        render_verify_step(trace, 0)
    with pytest.raises(ValueError, match="render_verify_step: step 3 is outside"):
        render_verify_step(trace, 3)


def test_every_verify_step_of_a_real_run_draws_one_output_cell_per_emitted_token():
    model, tok = load_model("tinylab")
    engine = LLMEngine(model, tok, engine_config(speculative_config={"method": "ngram",
                                                                     "num_speculative_tokens": 3}))
    prompt = 'Make JSON: age 31, called Ana.\nJSON: {"name": "Ana", "age": 31}\nMake JSON: called Ben, age 40.\nJSON:'
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24), request_id="r0")
    while engine.has_unfinished_requests():
        engine.step()
    steps = verify_steps(engine.trace)
    assert steps
    for i in steps:
        s = engine.trace[i].scheduled[0]
        fig = render_verify_step(engine.trace, i, tok)
        assert len([p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("out:")]) == s.tokens_out
        assert len([p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("fed:")]) == s.tokens_in


def test_the_player_steps_through_the_verify_steps_only():
    widgets = pytest.importorskip("ipywidgets", reason="the player needs ipywidgets")
    box = verify_step_player(_trace([5, 6], 1, [5, 3]))
    controls, figure = box.children
    assert isinstance(figure.children[0], widgets.Image) and figure.children[0].value
    assert controls.children[1].max == 0  # one verify step: index 0 of verify_steps

"""Chapter 01 figures: they render, and they show the right thing.

The distributions are hand-made (logits = log p, so softmax gives back p) and every expected height,
count and label below is worked out by hand in the comments, not copied from the code's output.
"""

import io
import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from engine.viz import sampling as viz

# Six tokens, most likely first; the words make the tick labels easy to check.
PROBS = [0.35, 0.25, 0.15, 0.10, 0.08, 0.07]
WORDS = ["cat", " dog", "a\nb", "sun", " moon", "tree"]
PANEL = {name: i for i, name in enumerate(("raw", "temperature", "top_k", "top_p", "min_p"))}
ATOL = 1e-6


def logits_of(probs):
    return torch.tensor(probs).log()


@pytest.fixture
def words():
    """A real engine Tokenizer over a tiny word-level vocabulary: id i is WORDS[i]."""
    vocab = {w: i for i, w in enumerate(WORDS)} | {"<unk>": len(WORDS)}
    return Tokenizer(HFTokenizer(WordLevel(vocab, unk_token="<unk>")), None, [])


def bars(fig, stage, which="after this stage"):
    """Bar lengths of one panel's container (horizontal bars: the length is the width)."""
    ax = fig.axes[PANEL[stage]]
    (container,) = [c for c in ax.containers if c.get_label() == which]
    return np.array([patch.get_width() for patch in container])


def rendered(fig):
    fig.savefig(io.BytesIO(), format="png")  # a full draw: layout, text, everything
    return fig


def test_top_p_panel_shows_exactly_the_tokens_top_p_keeps_renormalized():
    # p = 0.7: mass before each token is 0, .35, .60, .75, ... so the first three are kept (.15 crosses
    # 0.7 and stays); they are renormalized by .75.
    fig = rendered(viz.render_sampling_stages(logits_of(PROBS), SamplingParams(top_p=0.7)))
    after = bars(fig, "top_p")
    assert np.count_nonzero(after) == 3
    np.testing.assert_allclose(after, [0.35 / 0.75, 0.25 / 0.75, 0.15 / 0.75, 0, 0, 0], atol=ATOL)
    # The dropped ones are drawn as ghosts at their height before the filters.
    np.testing.assert_allclose(bars(fig, "top_p", "dropped"), [0, 0, 0, 0.10, 0.08, 0.07], atol=ATOL)
    assert "3 of 6 kept" in fig.axes[PANEL["top_p"]].get_title()


def test_each_filter_panel_counts_what_that_filter_and_the_ones_before_it_keep():
    # top_k=4 keeps .35 .25 .15 .10; min_p=0.5 then needs >= .5 * (.35/.85) of the renormalized
    # top-4, i.e. p >= .175 before renormalizing: .35 and .25 stay.
    fig = viz.render_sampling_stages(logits_of(PROBS), SamplingParams(top_k=4, min_p=0.5))
    assert np.count_nonzero(bars(fig, "raw")) == 6
    assert np.count_nonzero(bars(fig, "top_k")) == 4
    assert np.count_nonzero(bars(fig, "top_p")) == 4  # top_p = 1: off, nothing more dropped
    np.testing.assert_allclose(bars(fig, "min_p"), [0.35 / 0.6, 0.25 / 0.6, 0, 0, 0, 0], atol=ATOL)


def test_temperature_panel_is_the_softmax_of_the_scaled_logits():
    # T = 2: exp(log(p) / 2) = sqrt(p), normalized.
    fig = viz.render_sampling_stages(logits_of(PROBS), SamplingParams(temperature=2.0))
    roots = np.sqrt(PROBS)
    np.testing.assert_allclose(bars(fig, "temperature"), roots / roots.sum(), atol=ATOL)
    np.testing.assert_allclose(bars(fig, "raw"), PROBS, atol=ATOL)


def test_greedy_keeps_only_the_most_likely_token_in_every_filter_panel():
    shuffled = [0.10, 0.35, 0.07, 0.25, 0.15, 0.08]  # the argmax is token 1, drawn first (top row)
    fig = viz.render_sampling_stages(logits_of(shuffled), SamplingParams(temperature=0))
    for stage in ("temperature", "top_k", "top_p", "min_p"):
        np.testing.assert_allclose(bars(fig, stage), [1, 0, 0, 0, 0, 0], atol=ATOL)
    # Ghosts are the raw heights of the dropped tokens, sorted: .25 .15 .10 .08 .07.
    np.testing.assert_allclose(bars(fig, "min_p", "dropped"), [0, 0.25, 0.15, 0.10, 0.08, 0.07], atol=ATOL)
    assert "greedy" in fig.axes[PANEL["temperature"]].get_title()


def test_tick_labels_are_the_token_strings_most_likely_first(words):
    shuffled = [0.07, 0.35, 0.25, 0.10, 0.15, 0.08]  # order by probability: 1 2 4 3 5 0
    fig = rendered(viz.render_sampling_stages(logits_of(shuffled), SamplingParams(), words))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["\u2423dog", "a\u21b5b", "\u2423moon", "sun", "tree", "cat"]
    assert fig.axes[0].yaxis_inverted()  # the most likely token is at the top


def test_without_a_tokenizer_the_labels_are_token_ids_and_top_limits_the_bars():
    fig = viz.render_sampling_stages(logits_of(PROBS), SamplingParams(top_p=0.7), top=2)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["#0", "#1"]
    assert len(bars(fig, "raw")) == 2
    assert "3 of 6 kept, 1 not shown" in fig.axes[PANEL["top_p"]].get_title()


def test_renderers_leave_no_figure_open_in_pyplot():
    plt.close("all")
    viz.render_sampling_stages(logits_of(PROBS), SamplingParams())
    viz.render_step_times([0.01, 0.02, 0.03])
    viz.render_loop_trace([torch.tensor(PROBS)], [0])
    assert plt.get_fignums() == []


def test_loop_trace_shows_each_steps_top_tokens_and_frames_the_chosen_one(words):
    steps = [torch.tensor(PROBS), torch.tensor(PROBS[::-1])]
    # Step 0 chose its most likely token (cat, .35). Step 1's distribution is reversed: tree .35,
    # moon .25, sun .15, then a\nb .10; it chose a\nb (rank 4, outside the top 3): no frame, but the
    # chosen column still shows it.
    fig = rendered(viz.render_loop_trace(steps, [0, 2], words, top=3))
    ax = fig.axes[0]
    cells = [t.get_text() for t in ax.texts]  # row by row: 3 candidates, then the chosen column
    assert cells[:4] == ["cat\n0.35", "\u2423dog\n0.25", "a\u21b5b\n0.15", "cat\n0.35"]
    assert cells[4:] == ["tree\n0.35", "\u2423moon\n0.25", "sun\n0.15", "a\u21b5b\n0.10"]
    frames = [p for p in ax.patches if not p.get_fill()]
    assert [(f.get_x(), f.get_y()) for f in frames] == [(-0.5, -0.5)]  # step 0, rank 1 only


def test_loop_trace_needs_one_chosen_token_per_step():
    with pytest.raises(ValueError, match="chosen_ids has 1 entries but probs_per_step has 2"):
        viz.render_loop_trace([torch.tensor(PROBS)] * 2, [0])


def test_running_median_keeps_a_line_straight_and_ignores_one_spike():
    line = np.arange(10) * 0.5 + 3
    np.testing.assert_allclose(viz.running_median(line, window=5), line)
    # window 3 at index 3: median(3, 100, 5) = 5; the ends keep their own value.
    np.testing.assert_allclose(viz.running_median([1, 2, 3, 100, 5, 6, 7], window=3), [1, 2, 3, 5, 6, 6, 7])


def test_slope_is_milliseconds_per_extra_token_and_skips_the_prefill_step():
    # 10 ms + 0.2 ms per token, with a slow prefill step 0 that must not tilt the fit.
    times = [0.5] + [0.010 + 0.0002 * i for i in range(1, 40)]
    assert math.isclose(viz.step_time_slope_ms(times), 0.2, rel_tol=1e-9)
    assert abs(viz.step_time_slope_ms([0.5] + [0.01] * 30)) < 1e-12
    with pytest.raises(ValueError, match="at least 3"):
        viz.step_time_slope_ms([0.1, 0.2])


def test_step_times_plot_one_curve_per_run_against_sequence_length():
    naive = [0.010 + 0.0002 * i for i in range(30)]
    cached = [0.010] * 30
    fig = rendered(viz.render_step_times({"naive": naive, "cached": cached}, prompt_len=12))
    ax = fig.axes[0]
    dots = [line for line in ax.lines if line.get_linestyle() == "None"]
    assert len(dots) == 2
    np.testing.assert_allclose(dots[0].get_xdata(), np.arange(12, 42))
    np.testing.assert_allclose(dots[0].get_ydata(), np.array(naive) * 1000)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["naive: +0.200 ms per extra token", "cached: +0.000 ms per extra token"]
    assert "sequence" in ax.get_xlabel()


def test_one_run_of_step_times_takes_its_label_and_counts_steps_without_a_prompt_length():
    fig = viz.render_step_times([0.01, 0.02], label="naive")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["naive"]  # too short for a slope
    np.testing.assert_allclose(ax.lines[0].get_xdata(), [0, 1])


def test_widget_has_the_four_sliders_and_redraws_with_their_values(monkeypatch):
    pytest.importorskip("ipywidgets")
    seen = []
    from matplotlib.figure import Figure

    def fake_render(logits, params, tok, top):
        seen.append(params)
        return Figure(figsize=(2, 1))  # the widget shows it as a PNG

    monkeypatch.setattr(viz, "render_sampling_stages", fake_render)
    widget = viz.sampling_widget(logits_of(PROBS), params=SamplingParams(temperature=0.7, top_p=0.9))
    sliders = {w.description: w for box in widget.children[:2] for w in box.children}
    assert set(sliders) == {"temperature", "top_k", "top_p", "min_p"}
    assert seen[-1].temperature == pytest.approx(0.7) and seen[-1].top_p == pytest.approx(0.9)
    sliders["top_k"].value = 3
    assert seen[-1].top_k == 3 and seen[-1].temperature == pytest.approx(0.7)


@pytest.mark.parametrize("mass, kept", [(0.3, 1), (0.35, 1), (0.5, 2), (0.6, 2), (0.61, 3), (0.9, 5), (1.0, 6)])
def test_tokens_to_cover_counts_what_top_p_keeps_boundary_token_included(mass, kept):
    # PROBS sorted: cumulative 0.35 0.60 0.75 0.85 0.93 1.00; the token that crosses `mass` is kept.
    assert viz.tokens_to_cover(logits_of(PROBS), mass) == kept


def test_tokens_to_cover_rejects_a_mass_outside_zero_to_one():
    with pytest.raises(ValueError, match="mass=1.5"):
        viz.tokens_to_cover(logits_of(PROBS), 1.5)


def test_cumulative_mass_draws_each_distributions_sorted_running_sum_and_marks_top_p():
    shuffled = [PROBS[i] for i in (3, 0, 5, 1, 4, 2)]  # the curve must not depend on the token order
    flat = [(20 - i) / 210 for i in range(20)]  # 20/210, 19/210, ... 1/210: cumulative 20, 39, 57, ... /210
    fig = rendered(viz.render_cumulative_mass({"peaked": logits_of(shuffled), "flat": logits_of(flat)},
                                              masses=(0.45, 0.8)))
    ax = fig.axes[0]
    curves = [line for line in ax.lines if line.get_linestyle() == "-"]
    assert [c.get_label() for c in curves] == ["peaked (vocabulary 6)", "flat (vocabulary 20)"]
    np.testing.assert_allclose(curves[0].get_ydata(), np.cumsum(PROBS), atol=ATOL)
    np.testing.assert_allclose(curves[1].get_xdata(), np.arange(1, 21))
    dots = [(int(line.get_xdata()[0]), line.get_color()) for line in ax.lines if line.get_marker() == "o"]
    assert dots == [(2, "C0"), (4, "C0"), (6, "C1"), (12, "C1")]  # 105/210 >= 0.45, 174/210 >= 0.8
    assert ax.get_xscale() == "log"
    assert "top-p 0.8: 12" in [t.get_text() for t in ax.texts]

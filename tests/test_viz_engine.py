"""Chapter 05's figures: drawn from real engine traces, they show each request's life, the preemptions,
the queues and the block pool of the step asked for; the numbers behind them are right."""

import pytest
from matplotlib.figure import Figure

from engine.companions.metrics import requests_from_trace, trace_metrics
from engine.lab.workloads import Arrival, run_arrivals
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine.trace import Trace
from engine.viz.engine import (
    STATE_COLORS,
    describe_step,
    preemption_steps,
    render_blocks,
    render_queues,
    render_step,
    render_step_durations,
    render_sweep,
    render_timeline,
    render_timeline_comparison,
    step_states,
    timeline_spans,
    trace_player,
)
from engine_fixtures import random_model

# 5 requests of 10 prompt + 12 output tokens (6 blocks of 4 each at the end) in a pool of 12 blocks:
# two fit at their longest, so the later ones must be preempted as everybody grows.
NUM_REQUESTS = 5
POOL = dict(num_blocks=12, block_size=4)




def _run(mode: str, name: str = "r") -> Trace:
    engine = LLMEngine(random_model(seed=2), None, engine_config(model="random", max_num_seqs=4,
                                                                 preemption_mode=mode, **POOL))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    arrivals = [Arrival(step=2 * k, prompt=list(range(3 + k, 13 + k)), params=params,
                        request_id=f"{name}{k}") for k in range(NUM_REQUESTS)]
    return run_arrivals(engine, arrivals)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return _run("recompute")


@pytest.fixture(scope="module")
def swap_trace() -> Trace:
    return _run("swap")


def _span_patches(fig: Figure) -> list:
    return [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("span:")]


def test_the_fixture_trace_has_a_preemption(trace):
    assert preemption_steps(trace), "the tiny pool should force at least one preemption"


def test_the_timeline_has_one_row_per_request_in_arrival_order(trace):
    ax = render_timeline(trace).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(ax.get_yticks()) == NUM_REQUESTS
    assert labels == [f"r{k}" for k in range(NUM_REQUESTS)]


def test_step_states_agree_with_the_traces_own_state_at(trace):
    for i, report in enumerate(trace.steps):
        states = step_states(report)
        for rid in trace.request_ids():
            want = trace.state_at(rid, i)
            if want in STATE_COLORS:
                assert states.get(rid) == want, (i, rid)
            else:  # absent or finished: not drawn
                assert states.get(rid) in (None, "finished"), (i, rid)


def test_each_request_is_drawn_without_gaps_from_its_arrival_to_its_last_token(trace):
    spans = timeline_spans(trace)
    fig = render_timeline(trace)
    patches = _span_patches(fig)
    for row in requests_from_trace(trace):
        rid, row_spans = row.request_id, spans[row.request_id]
        assert row_spans[0].start == row.arrival_step == 2 * int(rid[1:])  # arrived at its step
        assert row_spans[-1].stop == row.finish_step + 1
        assert all(a.stop == b.start for a, b in zip(row_spans, row_spans[1:], strict=False))
        drawn = [p for p in patches if p.get_gid().startswith(f"span:{rid}:")]
        assert len(drawn) == len(row_spans)
        assert sum(p.get_width() for p in drawn) == row.finish_step + 1 - row.arrival_step


def test_a_recompute_preemption_shows_as_a_preempted_span_and_a_marker(trace):
    step, victim, mode = preemption_steps(trace)[0]
    assert mode == "recompute"
    fig = render_timeline(trace)
    gids = {p.get_gid() for p in _span_patches(fig)}
    assert f"span:{victim}:preempted" in gids
    markers = [line for line in fig.axes[0].lines if line.get_gid() == f"preempted:{victim}"]
    assert markers and markers[0].get_xdata()[0] == step + 0.5
    # the preempted span starts in the step the preemption happened
    assert any(s.state == "preempted" and s.start == step for s in timeline_spans(trace)[victim])


def test_a_swap_preemption_shows_as_a_swapped_span(swap_trace):
    _step, victim, mode = preemption_steps(swap_trace)[0]
    assert mode == "swap"
    assert f"span:{victim}:swapped" in {p.get_gid() for p in _span_patches(render_timeline(swap_trace))}


def test_upto_step_draws_nothing_after_that_step(trace):
    upto = len(trace) // 2
    patches = _span_patches(render_timeline(trace, upto_step=upto))
    assert patches and max(p.get_x() + p.get_width() for p in patches) <= upto + 1
    assert len(render_timeline(trace, upto_step=upto).axes[0].get_yticks()) == NUM_REQUESTS  # rows stay put


def test_render_blocks_draws_the_block_tables_of_that_step(trace):
    i = max(range(len(trace)), key=lambda k: trace[k].blocks.used)  # the fullest step
    fig = render_blocks(trace, i)
    gids = {p.get_gid() for ax in fig.axes for p in ax.patches}
    held = {b for table in trace[i].blocks.tables.values() for b in table}
    assert held and {f"fill:{b}" for b in held} <= gids
    assert not {f"fill:{b}" for b in range(POOL["num_blocks"]) if b not in held} & gids
    assert sum(g.startswith("block:") for g in gids) == POOL["num_blocks"]


def test_render_queues_draws_the_counts_and_one_red_line_per_preemption(trace):
    fig = render_queues(trace)
    ax_q, ax_kv = fig.axes[0], fig.axes[1]
    lines = {p.get_gid(): p for ax in (ax_q, ax_kv) for p in ax.patches}
    waiting = [len(r.queues.waiting) for r in trace.steps]
    assert list(lines["queue:waiting"].get_data().values) == waiting
    assert list(lines["queue:blocks_used"].get_data().values) == [r.blocks.used for r in trace.steps]
    assert max(lines["queue:blocks_used"].get_data().values) <= POOL["num_blocks"]
    red = [line for line in ax_q.lines if line.get_gid() == "preemption"]
    assert len(red) == len(preemption_steps(trace))


def test_render_step_shows_the_timeline_queues_and_grid_of_step_i(trace):
    i = preemption_steps(trace)[0][0]
    fig = render_step(trace, i)
    assert len(fig.axes) == 4  # timeline, queues, KV use, block grid
    assert fig._suptitle.get_text() == describe_step(trace[i])
    assert "preempted" in fig._suptitle.get_text()
    assert max(p.get_x() + p.get_width() for p in _span_patches(fig)) <= i + 1


def test_the_comparison_draws_one_timeline_per_trace(trace, swap_trace):
    fig = render_timeline_comparison({"recompute": trace, "swap": swap_trace})
    assert len(fig.axes) == 2
    half = Trace(steps=trace.steps[:len(trace) // 2])
    shared = render_timeline_comparison({"whole run": trace, "first half": half}).axes
    assert shared[0].get_xlim() == shared[1].get_xlim() == (0, len(trace))  # the longer run is not cut
    assert fig.axes[0].get_title().startswith("recompute") and "tokens/step" in fig.axes[0].get_title()


def test_a_saved_trace_draws_the_same_timeline(trace, tmp_path):
    trace.save(tmp_path / "t.json")
    again = render_timeline(Trace.load(tmp_path / "t.json"))
    assert sorted(p.get_gid() for p in _span_patches(again)) == sorted(
        p.get_gid() for p in _span_patches(render_timeline(trace)))


@pytest.mark.parametrize("render", [render_blocks, render_step])
def test_a_step_outside_the_trace_is_refused_with_the_range(trace, render):
    with pytest.raises(ValueError, match=rf"i={len(trace)} is outside the trace's steps 0..{len(trace) - 1}"):
        render(trace, len(trace))


def test_an_empty_trace_is_refused():
    with pytest.raises(ValueError, match="no steps"):
        render_timeline(Trace())


def test_render_steps_block_grid_labels_stay_inside_their_cells_even_with_long_request_ids():
    # chapter 05's ids ("batch-1", "vip-0") overprinted their neighbours in a 16-column grid
    from engine.viz.blocks import CELL_FONT_PT
    from test_viz_blocks import labels_outside_their_cells

    long_ids = _run("recompute", name="batch-1")
    for i in (0, preemption_steps(long_ids)[0][0], len(long_ids) - 1):
        fig = render_step(long_ids, i)
        assert labels_outside_their_cells(fig) == [], f"step {i}"
        grid_axes = [ax for ax in fig.axes if any((p.get_gid() or "").startswith("block:") for p in ax.patches)]
        labels = [t for t in grid_axes[0].texts if (t.get_gid() or "").startswith("label:")]
        # the panel's columns are chosen for big cells: a 12-block pool has room for full-size labels
        assert [(t.get_visible(), t.get_fontsize()) for t in labels] == [(True, CELL_FONT_PT)] * POOL["num_blocks"]


def test_render_step_marks_step_i_in_every_panel_over_the_bars_that_reach_it(trace):
    i = preemption_steps(trace)[0][0]
    fig = render_step(trace, i)
    nows = [p for ax in fig.axes for p in ax.patches if p.get_gid() == "now"]
    assert len(nows) == 3  # the timeline, the queues and the KV blocks
    for now in nows:  # a Rectangle in data x, axes y
        assert (now.get_x(), now.get_x() + now.get_width()) == (i, i + 1) and now.get_linewidth() > 0
    timeline = fig.axes[0]
    spans = [p for p in timeline.patches if (p.get_gid() or "").startswith("span:")]
    assert all(now.get_zorder() > p.get_zorder() for p in spans for now in nows if now.axes is timeline)
    assert any(p.get_x() + p.get_width() == i + 1 for p in spans), "the running requests end in step i's column"


def test_the_player_needs_ipywidgets_or_builds_play_and_slider(trace):
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            trace_player(trace)
        return
    box = trace_player(trace)
    controls = box.children[0].children
    assert [type(c).__name__ for c in controls] == ["Play", "IntSlider"] and controls[1].max == len(trace) - 1


def test_the_player_shows_render_step_of_the_chosen_step_as_an_image(trace):
    # an Image, not an Output widget: nbconvert/nbmake never answer it, so they cannot stall on it
    widgets = pytest.importorskip("ipywidgets")
    from engine.viz.widgets import figure_png

    box = trace_player(trace)
    slider = box.children[0].children[1]
    image = box.children[1].children[0]
    assert isinstance(image, widgets.Image) and not isinstance(box.children[1], widgets.Output)
    slider.value = len(trace) - 1
    assert image.value == figure_png(render_step(trace, len(trace) - 1))


# ---- comparing runs (the serving numbers themselves are tested in test_metrics.py) -------------------


def test_render_step_durations_draws_each_steps_time_and_tokens(trace, swap_trace):
    fig = render_step_durations({"recompute": trace, "swap": swap_trace})
    stairs = {p.get_gid(): p for ax in fig.axes for p in ax.patches}
    ms = list(stairs["duration:recompute"].get_data().values)
    assert ms == pytest.approx([1e3 * (r.end_time - r.start_time) for r in trace.steps])
    assert list(stairs["tokens:swap"].get_data().values) == [r.num_tokens for r in swap_trace.steps]


def test_render_sweep_draws_one_point_per_row_and_needs_the_knob(trace, swap_trace):
    rows = [{"seats": 2, **trace_metrics(trace)}, {"seats": 4, **trace_metrics(swap_trace)}]
    fig = render_sweep(rows, "seats")
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines}
    assert list(lines["sweep:fairness"].get_xdata()) == [2, 4]
    assert list(lines["sweep:tokens / step"].get_ydata()) == [r["tokens_per_step"] for r in rows]
    assert list(lines["sweep:ttft_p99_s"].get_ydata()) == [1e3 * r["ttft_p99_s"] for r in rows]
    with pytest.raises(ValueError, match="knob 'max_num_seqs'"):
        render_sweep(rows, "max_num_seqs")

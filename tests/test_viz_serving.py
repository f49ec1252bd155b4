"""Chapter 09's figures: built from plain data (RequestTimings, lists of seconds, bench result dicts), they
draw the numbers engine/companions/metrics.py computes, mark the knee by its rule, and name the field of bad input."""

import math

import matplotlib.colors as mcolors
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from engine.companions.metrics import SLO, RequestTiming, by_prompt_length, mean, nearest_rank
from engine.viz.serving import (
    COLORS,
    capacity_knee,
    render_arrivals,
    render_buckets,
    render_capacity_curve,
    render_goodput_vs_throughput,
    render_overload,
    render_percentiles,
    render_request_timeline,
)

# A request that arrives at 1.0 s, is scheduled at 1.2 s, gets tokens at 1.5, 1.6, 1.9 and 2.0 s.
TOKENS = [1.5, 1.6, 1.9, 2.0]
ONE = RequestTiming("r0", 1.0, TOKENS, first_scheduled_time=1.2, finish_time=2.0, finish_reason="length",
                    prompt_tokens=12)
CLIENT = RequestTiming("c1", 1.1, [1.4, 1.45], finish_time=1.45, finish_reason="stop")  # no scheduled time


def _artists(fig):
    return [a for ax in fig.axes for a in (*ax.patches, *ax.lines, *ax.collections, *ax.texts)]


def _gid(fig, gid):
    found = [a for ax in fig.axes for a in (*ax.patches, *ax.lines, *ax.collections, *ax.texts)
             if a.get_gid() == gid]
    assert found, f"no artist with gid {gid!r}"
    return found[0]


def _bracket_x(fig, gid):
    """The x ends of an annotation arrow (its two points, in data coordinates), sorted."""
    arrow = _gid(fig, gid)
    return sorted([arrow.xy[0], arrow.xyann[0]])


def test_the_timeline_brackets_span_the_metrics_definitions():
    fig = render_request_timeline([ONE, CLIENT], annotate=0)
    t0 = 1.0  # the clock starts at the first arrival
    assert _bracket_x(fig, "bracket:queue") == pytest.approx([1.0 - t0, 1.2 - t0])
    assert _bracket_x(fig, "bracket:ttft") == pytest.approx([1.0 - t0, 1.5 - t0])
    assert _bracket_x(fig, "bracket:itl") == pytest.approx([1.6 - t0, 1.9 - t0])  # the longest gap
    assert _bracket_x(fig, "bracket:tpot") == pytest.approx([1.5 - t0, 2.0 - t0])
    assert _bracket_x(fig, "bracket:e2e") == pytest.approx([0.0, 1.0])
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert f"TPOT = mean ITL = {ONE.tpot_s * 1e3:.0f} ms" in texts and "TTFT 500 ms" in texts


def test_the_timeline_draws_spans_and_one_tick_per_token_for_every_request():
    fig = render_request_timeline([ONE, CLIENT], annotate=None)
    queued = _gid(fig, "queued:r0")
    assert queued.get_x() == pytest.approx(0.0) and queued.get_width() == pytest.approx(0.2)
    wait = _gid(fig, "first_token_wait:r0")
    assert wait.get_x() == pytest.approx(0.2) and wait.get_width() == pytest.approx(0.3)
    assert mcolors.to_hex(wait.get_facecolor()) == mcolors.to_hex(COLORS["first_token_wait"])
    assert len(_gid(fig, "tokens:r0").get_segments()) == len(TOKENS)
    gids = {a.get_gid() for a in _artists(fig)}
    assert "queued:c1" not in gids, "client timings have no scheduled time: no queue span is invented"
    assert _gid(fig, "first_token_wait:c1").get_x() == pytest.approx(0.1)
    assert not any((g or "").startswith("bracket:") for g in gids)


@pytest.mark.parametrize("requests, annotate, field", [([], 0, "requests"), ([ONE], 1, "annotate"),
                                                       ([ONE] * 41, None, "requests")])
def test_bad_timeline_input_names_the_field(requests, annotate, field):
    with pytest.raises(ValueError, match=f"render_request_timeline: {field}"):
        render_request_timeline(requests, annotate=annotate)


def test_the_percentile_plot_marks_nearest_rank_p50_p95_p99_and_the_mean():
    values = [0.1] * 90 + [0.5] * 9 + [2.0]  # seconds: a long tail of one
    fig = render_percentiles({"TTFT": values, "TPOT": [0.05, 0.06, math.nan]})
    assert _gid(fig, "p50:TTFT").get_ydata()[0] == pytest.approx(100.0)
    assert _gid(fig, "p95:TTFT").get_ydata()[0] == pytest.approx(500.0)  # the 95th of 100 values
    assert _gid(fig, "p99:TTFT").get_ydata()[0] == pytest.approx(1e3 * nearest_rank(values, 99)) == 500.0
    assert _gid(fig, "mean:TTFT").get_ydata()[0] == pytest.approx(1e3 * mean(values))
    assert list(_gid(fig, "sorted:TPOT").get_ydata()) == pytest.approx([50.0, 60.0])  # nan left out
    assert "P99 / P50 = 5.0x" in fig.axes[0].get_title()


@pytest.mark.parametrize("samples", [{}, {"TTFT": []}, {"TTFT": [math.nan]}])
def test_bad_percentile_input_names_the_field(samples):
    with pytest.raises(ValueError, match="render_percentiles: samples"):
        render_percentiles(samples)


def test_bucket_bars_are_the_nearest_rank_percentiles_of_each_bucket():
    short = [RequestTiming(f"s{i}", 0.0, [0.1 * (i + 1)], prompt_tokens=10) for i in range(5)]
    long = [RequestTiming("l0", 0.0, [3.0], prompt_tokens=300)]
    groups = {"alone": {k: [r.ttft_s for r in v] for k, v in by_prompt_length(short, (64, 256)).items()},
              "mixed": {k: [r.ttft_s for r in v] for k, v in by_prompt_length(short + long, (64, 256)).items()}}
    fig = render_buckets(groups)
    assert _gid(fig, "p50:alone:[0, 64)").get_height() == pytest.approx(300.0)
    assert _gid(fig, "p95:mixed:[0, 64)").get_height() == pytest.approx(500.0)  # 5 values: P95 is the max
    assert _gid(fig, "p99:mixed:[256, inf)").get_height() == pytest.approx(3000.0)
    gids = {a.get_gid() for a in _artists(fig)}
    assert "p50:alone:[256, inf)" not in gids, "an empty bucket gets no bar"
    with pytest.raises(ValueError, match="render_buckets: groups"):
        render_buckets({})


def test_arrival_windows_count_every_arrival_once():
    times = [0.0, 0.1, 0.2, 1.5, 3.9]
    fig = render_arrivals({"bursty": times, "steady": [0.0, 1.0, 2.0, 3.0]}, window_s=1.0)
    heights = [_gid(fig, f"window:bursty:{k}").get_height() for k in range(4)]
    assert heights == [3, 1, 0, 1]
    assert len(_gid(fig, "arrivals:steady").get_segments()) == 4
    for processes, window, field in (({}, 1.0, "processes"), ({"a": [-1.0]}, 1.0, "processes"),
                                     ({"a": [0.0]}, 0.0, "window_s")):
        with pytest.raises(ValueError, match=f"render_arrivals: {field}"):
            render_arrivals(processes, window_s=window)


def test_buckets_of_any_kind_are_named_on_the_axis():
    fig = render_buckets({"TTFT": {"chat": [0.1, 0.2], "batch": [0.4]}}, bucket_kind="tenant")
    assert [ax.get_xlabel() for ax in fig.axes] == ["tenant"] * 3
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["chat", "batch"]
    assert "P95 TTFT per tenant bucket" in [ax.get_title() for ax in fig.axes]


def _row(rate, served, good, ttft99=100.0):
    return {"request_rate": rate, "request_throughput": served, "request_goodput": good, "p50_ttft_ms": 50.0,
            "p99_ttft_ms": ttft99, "p50_tpot_ms": 20.0, "p99_tpot_ms": 30.0}


SWEEP = [_row(math.inf, 3.0, 0.2), _row(1.0, 1.0, 1.0), _row(4.0, 2.9, 1.0, 5000.0), _row(2.0, 1.9, 1.8)]


def test_the_knee_is_the_last_rate_before_goodput_falls_below_90_percent():
    assert capacity_knee(SWEEP) == 2.0  # 1.8 / 1.9 = 95% passes; 1.0 / 2.9 fails; inf is never reached
    assert capacity_knee(SWEEP, min_fraction=0.96) == 1.0
    assert capacity_knee([_row(1.0, 1.0, 0.5), _row(2.0, 2.0, 2.0)]) is None, "a failing lowest rate: no knee"
    with pytest.raises(ValueError, match="capacity_knee: min_fraction"):
        capacity_knee(SWEEP, min_fraction=0.0)


def test_the_capacity_curve_draws_the_sweep_in_rate_order_with_the_knee_and_the_slo():
    fig = render_capacity_curve(SWEEP, SLO(ttft_s=1.0, tpot_s=0.1))
    assert list(_gid(fig, "throughput").get_xdata()) == [1.0, 2.0, 4.0, 8.0]  # inf drawn at 2 x 4 req/s
    assert list(_gid(fig, "goodput").get_ydata()) == [1.0, 1.8, 1.0, 0.2]
    assert list(_gid(fig, "ttft_p99").get_ydata()) == [100.0, 100.0, 5000.0, 100.0]
    assert _gid(fig, "knee").get_xdata()[0] == 2.0
    assert _gid(fig, "slo:ttft").get_ydata()[0] == pytest.approx(1000.0)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2", "4", "inf"]


def test_goodput_vs_throughput_is_one_path_in_rate_order():
    fig = render_goodput_vs_throughput(SWEEP)
    path = _gid(fig, "path")
    assert list(path.get_xdata()) == [1.0, 1.9, 2.9, 3.0] and list(path.get_ydata()) == [1.0, 1.8, 1.0, 0.2]


@pytest.mark.parametrize("render", [render_capacity_curve, render_goodput_vs_throughput])
def test_a_sweep_without_goodput_is_refused_with_what_to_do(render):
    with pytest.raises(ValueError, match=r"rows lack \['request_goodput'\].*SLO"):
        render([{**_row(1.0, 1.0, 1.0), "request_goodput": None}])
    with pytest.raises(ValueError, match="rows is empty"):
        render([])


def _overload_row(protection, load_x, goodput, p99_ttft_s, rejected):
    return {"protection": protection, "load_x": load_x, "goodput_x_capacity": goodput, "p99_ttft_s": p99_ttft_s,
            "rejected_share": rejected}


OVERLOAD = [_overload_row("none", 2.0, 0.1, 18.0, 0.0), _overload_row("protected", 1.0, 0.8, 0.3, 0.0),
            _overload_row("none", 1.0, 0.8, 0.6, 0.0), _overload_row("protected", 2.0, 1.7, 0.8, 0.1)]
QUEUES = {"none@2.0x": [{"t_s": 0.0, "waiting": 0}, {"t_s": 1.0, "waiting": 40}],
          "protected@2.0x": [{"t_s": 0.0, "waiting": 0}, {"t_s": 1.0, "waiting": 3}],
          "none@1.0x": [{"t_s": 0.0, "waiting": 99}]}


def test_the_overload_figure_draws_one_line_per_protection_in_load_order():
    fig = render_overload(OVERLOAD, QUEUES)
    assert list(_gid(fig, "goodput:none").get_xdata()) == [1.0, 2.0]
    assert list(_gid(fig, "goodput:none").get_ydata()) == [0.8, 0.1]
    assert list(_gid(fig, "goodput:protected").get_ydata()) == [0.8, 1.7]
    assert list(_gid(fig, "p99_ttft:none").get_ydata()) == [0.6, 18.0]
    assert list(_gid(fig, "rejected:protected").get_ydata()) == [0.0, 0.1]
    assert fig.axes[1].get_yscale() == "log"
    assert list(_gid(fig, "waiting:none").get_ydata()) == [0, 40], "the queue is drawn at the highest load"
    assert list(_gid(fig, "waiting:protected").get_ydata()) == [0, 3]
    assert len(render_overload(OVERLOAD).axes) == 3, "without series, no queue panel"


def test_overload_rows_without_a_field_are_refused_by_name():
    with pytest.raises(ValueError, match=r"render_overload: rows lack \['p99_ttft_s'\]"):
        render_overload([{**OVERLOAD[0], "p99_ttft_s": None}])
    with pytest.raises(ValueError, match="rows is empty"):
        render_overload([])


def test_the_capacity_curve_draws_p95_when_the_sweep_has_it_and_ttft_always_on_a_log_axis():
    # TTFT from 50 to 100 ms, the SLO at 1000 ms: a span of 20 x, which alone would stay linear
    rows = [{**r, "p95_ttft_ms": 90.0, "p99_ttft_ms": 100.0, "p95_tpot_ms": 25.0} for r in SWEEP]
    fig = render_capacity_curve(rows, SLO(ttft_s=1.0, tpot_s=0.1))
    assert list(_gid(fig, "ttft_p95").get_ydata()) == [90.0] * 4
    assert fig.axes[1].get_yscale() == "log", "a queue multiplies TTFT: log even when the sweep spans little"
    assert fig.axes[2].get_yscale() == "linear", "TPOT within 20 x of its limit stays linear"
    gids = {a.get_gid() for a in _artists(render_capacity_curve(SWEEP, SLO(ttft_s=1.0, tpot_s=0.1)))}
    assert "ttft_p95" not in gids and "ttft_p99" in gids, "rows without P95: no P95 line is invented"


def test_throughput_stays_visible_where_goodput_equals_it():
    fig = render_capacity_curve(SWEEP, SLO(ttft_s=1.0, tpot_s=0.1))
    tp, gp = _gid(fig, "throughput"), _gid(fig, "goodput")
    lines = fig.axes[0].get_lines()
    assert lines.index(tp) < lines.index(gp), "throughput underneath"
    assert tp.get_linewidth() > 2 * gp.get_linewidth(), "and wider, so it shows around goodput"


def test_goodput_path_labels_stay_inside_the_axes_and_apart():
    # the last two rates serve the same: their points coincide past the knee
    rows = [_row(1.0, 1.0, 1.0), _row(2.0, 1.9, 1.8), _row(4.0, 2.9, 0.5), _row(math.inf, 2.9, 0.5)]
    fig = render_goodput_vs_throughput(rows)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    ax_box = fig.axes[0].get_window_extent(renderer)
    boxes = {r: _gid(fig, f"label:{r}").get_window_extent(renderer) for r in ("1", "2", "4", "inf")}
    for rate, box in boxes.items():
        assert ax_box.x0 <= box.x0 and box.x1 <= ax_box.x1, f"the {rate} req/s label leaves the axes"
    assert not boxes["4"].overlaps(boxes["inf"]), "two labels at one point overprint each other"

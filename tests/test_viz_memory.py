"""Chapters 02-03 figures: each one draws the numbers the formulas give, found through the artists' gids.

Expected numbers are worked out by hand in the comments (Llama-3-8B: 8,030,261,248 params, 16.06 GB
in fp16; 2 * 32 layers * 8 KV heads * 128 dims * 2 bytes = 131,072 KV bytes per token).
"""

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from engine.companions.roofline import MachineRoofline
from engine.viz.memory import (
    attention_variants,
    calculator_shape,
    render_attention_variants,
    render_kv_calculator,
    render_prefill_decode_times,
    render_request_timelines,
    render_roofline,
    render_step_time_curves,
    render_token_time_vs_floor,
    render_window_recall,
)

GB = 1e9
L3_WEIGHTS_GB = 16.060522496
L3_KV_GB_PER_TOKEN = 131_072 / GB


def by_gid(fig: Figure, gid: str):
    found = [a for ax in fig.axes for a in ax.get_children() if a.get_gid() == gid]
    assert found, f"no artist with gid {gid!r}"
    return found[0]


# ---- the KV calculator -------------------------------------------------------------------------------


def test_calculator_draws_the_24_80_and_141_gb_cards():
    fig = render_kv_calculator("Llama-3-8B", batch=1, tokens=8192)
    for gb in (24, 80, 141):
        assert np.allclose(by_gid(fig, f"gpu:{gb}").get_ydata(), gb)


def test_calculator_total_is_the_weights_plus_the_formula_along_tokens():
    line = by_gid(render_kv_calculator("Llama-3-8B", batch=2, tokens=8192, vs="tokens"), "total")
    x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
    assert np.allclose(y, L3_WEIGHTS_GB + 2 * x * L3_KV_GB_PER_TOKEN)


def test_calculator_total_is_the_weights_plus_the_formula_along_the_batch():
    line = by_gid(render_kv_calculator("Llama-3-8B", batch=32, tokens=8192, vs="batch"), "total")
    x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
    assert x[0] == 1
    assert np.allclose(y, L3_WEIGHTS_GB + x * 8192 * L3_KV_GB_PER_TOKEN)  # 1.073741824 GB per sequence
    assert y.max() > 141, "the x axis should reach past the point where the largest card is full"


def test_calculator_legend_says_how_many_8k_sequences_fit_per_card():
    # After the 10% reserve: 24 GB: (21.6 - 16.06) / 1.0737 = 5.2 -> 5; 80 GB: (72 - 16.06) / 1.0737
    # = 52.1 -> 52; 141 GB: (126.9 - 16.06) / 1.0737 = 103.2 -> 103.
    fig = render_kv_calculator("Llama-3-8B", batch=32, tokens=8192, vs="batch")
    for gb, n in ((24, 5), (80, 52), (141, 103)):
        assert f": {n} sequences fit" in by_gid(fig, f"gpu:{gb}").get_label()


def test_calculator_marks_the_chosen_point():
    x, y = by_gid(render_kv_calculator("Llama-3-8B", batch=32, tokens=8192, vs="batch"), "chosen").get_data()
    assert x[0] == 32 and y[0] == pytest.approx(L3_WEIGHTS_GB + 32 * 8192 * L3_KV_GB_PER_TOKEN)  # 50.42 GB


def test_a_sliding_window_caps_the_cache():
    # Mistral-7B-v0.1: window 4096, 131,072 B per token, weights 7,241,732,096 * 2 = 14.483464192 GB.
    line = by_gid(render_kv_calculator("Mistral-7B-v0.1", batch=4, tokens=8192, vs="tokens"), "total")
    x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
    assert np.allclose(y[x >= 4096], 14.483464192 + 4 * 4096 * L3_KV_GB_PER_TOKEN)
    assert "any length fits" in by_gid(render_kv_calculator("Mistral-7B-v0.1", 4, 8192), "gpu:80").get_label()


def test_weights_that_do_not_fit_are_said_so():
    # Llama-3-70B: 70,553,706,496 params * 2 bytes = 141.1 GB, more than even the 141 GB card.
    fig = render_kv_calculator("Llama-3-70B", batch=1, tokens=8192)
    for gb in (24, 80, 141):
        assert "weights do not fit" in by_gid(fig, f"gpu:{gb}").get_label()


def test_calculator_sliders_change_the_weights_too():
    # MQA Llama-3-8B: k and v projections shrink from 8 to 1 KV head: 2 * 4096 * 7 * 128 = 7,340,032
    # fewer params per layer, 234,881,024 over 32 layers -> 7,795,380,224.
    assert calculator_shape("Llama-3-8B", kv_heads=1).num_params() == 7_795_380_224
    assert calculator_shape("Llama-3-8B").num_params() == 8_030_261_248


@pytest.mark.parametrize("call, field", [
    (lambda: render_kv_calculator("Llama-3-8B", batch=0), "batch"),
    (lambda: render_kv_calculator("Llama-3-8B", tokens=-5), "tokens"),
    (lambda: render_kv_calculator("Llama-3-8B", tokens=10**9), "tokens"),
    (lambda: render_kv_calculator("Llama-3-8B", vs="layers"), "vs"),
    (lambda: render_kv_calculator("GPT-5"), "preset"),
    (lambda: calculator_shape("Llama-3-8B", kv_heads=3), "kv_heads"),
    (lambda: calculator_shape("Llama-3-8B", layers=0), "layers"),
    (lambda: calculator_shape("Llama-3-8B", head_dim=4096), "head_dim"),
])
def test_out_of_range_calculator_inputs_name_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_widget_redraws_and_reports_bad_inputs():
    widgets = pytest.importorskip("ipywidgets", reason="the widget needs ipywidgets")
    from engine.viz.memory import kv_calculator_widget

    box = kv_calculator_widget()
    controls = {c.description: c for row in box.children[:2] for c in row.children}
    image, message = box.children[2].children  # an Image, not an Output widget (engine/viz/widgets.py)
    assert isinstance(image, widgets.Image) and bytes(image.value).startswith(b"\x89PNG")
    before = bytes(image.value)
    controls["batch"].value = 2
    assert image.value != before
    controls["kv_heads"].value = 3  # 32 query heads cannot be split into 3 groups
    assert "kv_heads must divide heads=32" in message.value
    controls["preset"].value = "Llama-2-7B"  # a preset resets the sliders to its published shape
    assert (controls["layers"].value, controls["kv_heads"].value, controls["head_dim"].value) == (32, 32, 128)


# ---- attention variants ------------------------------------------------------------------------------


def test_attention_variants_are_mha_gqa_and_mqa():
    assert [s.num_key_value_heads for _, s in attention_variants()] == [32, 8, 1]


def test_attention_variant_bars_follow_the_formula():
    # KV of one 8k sequence: 2 * 32 * Hkv * 128 * 2 * 8192 = Hkv * 134,217,728 bytes.
    # Fits on 80 GB after a 10% reserve: Llama-2-7B (72 - 13.477) / 4.295 = 13.6 -> 13;
    # Llama-3-8B 52 (as above); MQA (72 - 15.591) / 0.1342 = 420.3 -> 420.
    fig = render_attention_variants(tokens=8192)
    names = [s.name for _, s in attention_variants()]
    heights = [by_gid(fig, f"kv:{n}").get_height() for n in names]
    assert heights == pytest.approx([4.294967296, 1.073741824, 0.134217728])
    assert [by_gid(fig, f"fits:{n}").get_height() for n in names] == [13, 52, 420]


# ---- the roofline and the chapter-02 timings ---------------------------------------------------------

MACHINE = MachineRoofline(peak_flops=1e11, bandwidth_bytes_per_s=2e10, dtype="fp32", description="made up")


def test_roofline_is_bandwidth_times_intensity_then_flat_at_the_peak():
    fig = render_roofline(MACHINE, [("decode B=1", 0.5, 3e9), ("prefill P=256", 60.0, 5e10)])
    x, y = (np.asarray(d) for d in by_gid(fig, "roof").get_data())
    assert np.allclose(y, np.minimum(1e11, 2e10 * x))
    assert y.max() == 1e11 and x.min() < 0.5 and x.max() > 60
    assert by_gid(fig, "ridge").get_xdata()[0] == pytest.approx(5.0)  # 1e11 / 2e10 FLOP per byte
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"


def test_roofline_places_each_point_where_it_was_measured():
    fig = render_roofline(MACHINE, [("decode B=1", 0.5, 3e9), ("prefill P=256", 60.0, 5e10)])
    assert np.allclose(by_gid(fig, "point:decode B=1").get_offsets(), [[0.5, 3e9]])
    assert np.allclose(by_gid(fig, "point:prefill P=256").get_offsets(), [[60.0, 5e10]])


# Crowded on purpose, as chapter 02's CPU points are: two pairs of decode points almost on top of each other,
# prefill points close together, one point near the ridge (5 FLOP/B) just under the peak.
CROWDED = [("prefill P=16 B=1", 7.0, 3.3e10), ("decode T=17 B=1", 0.50, 3.4e9), ("prefill P=128 B=1", 31.0, 3.3e10),
           ("decode T=129 B=1", 0.53, 3.7e9), ("prefill P=16 B=4", 20.0, 6.8e10), ("decode T=17 B=4", 1.9, 1.16e10),
           ("prefill P=128 B=4", 47.0, 4.8e10), ("decode T=129 B=4", 1.93, 1.12e10), ("prefill near ridge", 5.5, 9e10)]


def _drawn_boxes(fig: Figure, prefix: str) -> dict:
    """Display-space boxes of the axes' texts whose gid starts with `prefix`, after a real draw
    (the text alone: an annotation's own extent would include its leader line)."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    return {t.get_gid(): Text.get_window_extent(t, renderer) for t in fig.axes[0].texts
            if (t.get_gid() or "").startswith(prefix)}


def test_roofline_labels_overlap_neither_each_other_nor_the_ridge_texts():
    fig = render_roofline(MACHINE, CROWDED)
    labels = _drawn_boxes(fig, "label:")
    fixed = _drawn_boxes(fig, "r")  # "ridge-label", "regime:bandwidth", "regime:compute"
    assert len(labels) == len(CROWDED) and set(fixed) == {"ridge-label", "regime:bandwidth", "regime:compute"}
    boxes = list(labels.items()) + list(fixed.items())
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            assert not box_a.overlaps(box_b), f"{a} overprints {b}"


def test_roofline_labels_stay_inside_the_axes_and_off_other_points():
    fig = render_roofline(MACHINE, CROWDED)
    labels = _drawn_boxes(fig, "label:")
    frame = fig.axes[0].get_window_extent()
    markers = {label: fig.axes[0].transData.transform((x, y)) for label, x, y in CROWDED}
    for gid, box in labels.items():
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, gid
        for label, (px, py) in markers.items():
            if f"label:{label}" != gid:
                assert not (box.x0 < px < box.x1 and box.y0 < py < box.y1), f"{gid} covers the point of {label}"


def test_each_roofline_label_points_at_its_own_measurement():
    fig = render_roofline(MACHINE, CROWDED)
    annotations = {t.get_gid(): t for t in fig.axes[0].texts if (t.get_gid() or "").startswith("label:")}
    for label, x, y in CROWDED:
        assert annotations[f"label:{label}"].xy == (x, y)
        assert annotations[f"label:{label}"].get_text() == label


def test_roofline_names_the_regimes_on_their_sides_of_the_ridge():
    fig = render_roofline(MACHINE, CROWDED)
    fixed = _drawn_boxes(fig, "r")
    ridge_x = fig.axes[0].transData.transform((5.0, 1.0))[0]  # 1e11 / 2e10 = 5 FLOP per byte
    assert fixed["regime:bandwidth"].x1 < ridge_x < fixed["regime:compute"].x0
    assert fixed["ridge-label"].x0 < ridge_x < fixed["ridge-label"].x1
    assert "5.0 FLOP/B" in by_gid(fig, "ridge-label").get_text()


def test_roofline_rejects_points_a_log_plot_cannot_show():
    with pytest.raises(ValueError, match="intensity > 0"):
        render_roofline(MACHINE, [("broken", 0.0, 1e9)])


def test_prefill_decode_times_draw_one_line_per_phase_and_batch():
    rows = [{"phase": p, "tokens": t, "batch": b, "ms_per_token": 1.0 / t}
            for p in ("prefill", "decode") for b in (1, 4) for t in (256, 16, 64)]
    fig = render_prefill_decode_times(rows)
    x, y = by_gid(fig, "prefill:4").get_data()
    assert list(x) == [16, 64, 256] and list(y) == [1 / 16, 1 / 64, 1 / 256]
    by_gid(fig, "decode:1")
    with pytest.raises(ValueError, match="phase"):
        render_prefill_decode_times([{"phase": "train", "tokens": 1, "batch": 1, "ms_per_token": 1.0}])


def test_request_timeline_shades_ttft_and_ticks_each_token():
    fig = render_request_timelines({"long prompt": [0.3, 0.004, 0.004], "short prompt": [0.01, 0.005]})
    assert by_gid(fig, "ttft:long prompt").get_width() == pytest.approx(300.0)
    assert np.allclose(by_gid(fig, "tokens:long prompt").get_xdata(), [300.0, 304.0, 308.0])
    assert np.allclose(by_gid(fig, "tokens:short prompt").get_xdata(), [10.0, 15.0])


def test_timeline_summaries_start_below_their_ttft_bars():
    fig = render_request_timelines({"long prompt": [0.3, 0.004, 0.004], "short prompt": [0.01, 0.005]})
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for label in ("long prompt", "short prompt"):
        bar = by_gid(fig, f"ttft:{label}").get_window_extent(renderer)
        text = by_gid(fig, f"summary:{label}").get_window_extent(renderer)
        assert text.y1 < bar.y0, f"the summary of {label!r} overlaps its TTFT bar"
    long_text = by_gid(fig, "summary:long prompt").get_window_extent(renderer)
    short_bar = by_gid(fig, "ttft:short prompt").get_window_extent(renderer)
    assert long_text.y0 > short_bar.y1  # and above the next row's bar


# ---- chapter-03 curves -------------------------------------------------------------------------------


def test_step_time_curves_start_after_the_prefill_at_the_right_length():
    fig = render_step_time_curves({"naive": [0.5, 0.001, 0.002, 0.003], "cached": [0.5, 0.001, 0.001, 0.001]},
                                  prompt_tokens=10)
    x, y = by_gid(fig, "steps:naive").get_data()
    assert list(x) == [11, 12, 13] and np.allclose(y, [1.0, 2.0, 3.0])  # step i sees 10 + i tokens, in ms
    assert "+1.000 ms per extra token" in by_gid(fig, "median:naive").get_label()  # 1 ms more each step
    assert "+0.000 ms per extra token" in by_gid(fig, "median:cached").get_label()
    x, _ = by_gid(render_step_time_curves({"cached": [0.5, 0.001]}, 10, include_prefill=True),
                  "steps:cached").get_data()
    assert list(x) == [10, 11]


def test_window_recall_draws_accuracy_by_length_and_the_windows():
    fig = render_window_recall({"W=64": {256: 0.1, 64: 0.9}}, windows=[64])
    x, y = by_gid(fig, "recall:W=64").get_data()
    assert list(x) == [64, 256] and list(y) == [0.9, 0.1]
    assert by_gid(fig, "window:64").get_xdata()[0] == 64


def test_token_time_bars_are_the_measurements_and_the_floor_is_a_line():
    fig = render_token_time_vs_floor({"python layers": 40.0, "C layers": 20.0}, floor_ms=16.0, title="t")
    ax = fig.axes[0]
    assert [round(p.get_width(), 6) for p in ax.patches] == [40.0, 20.0]
    assert [t.get_text() for t in ax.texts] == ["40.0 ms (2.5x the floor)", "20.0 ms (1.2x the floor)"]
    (line,) = ax.lines
    assert tuple(line.get_xdata()) == (16.0, 16.0)


@pytest.mark.parametrize("bars,floor,field", [({}, 10.0, "ms_per_token"), ({"a": 1.0}, 0.0, "floor_ms")])
def test_token_time_bad_inputs_name_the_field(bars, floor, field):
    with pytest.raises(ValueError, match=field):
        render_token_time_vs_floor(bars, floor, "t")

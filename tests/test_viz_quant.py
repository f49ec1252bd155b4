"""Chapter 07's figures draw what they are given: the int4 levels are the quantizer's own, bars have the
heights of the numbers passed in, and bad inputs are named."""

import numpy as np
import pytest
import torch

from engine.loading.quantization import weight_bytes_breakdown
from engine.viz.quant import (
    BYTES_PER_MIB,
    TOP_CHANNELS,
    per_tensor_int4_levels,
    render_bytes_breakdown,
    render_channel_max,
    render_gemv_bytes,
    render_gptq_error,
    render_granularity_error,
    render_kv_int8,
    render_layer_speed,
    render_quality,
    render_weight_histogram,
)
from kernels.quant_matmul import dequantize, quantize


def _by_gid(fig, gid):
    found = [a for ax in fig.axes for a in (*ax.patches, *ax.lines, *ax.collections) if a.get_gid() == gid]
    assert len(found) == 1, f"expected one artist {gid!r}, found {len(found)}"
    return found[0]


def _weight():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 5] = 0.4  # an outlier that stretches a per-tensor grid
    return w


def test_the_histogram_draws_exactly_the_values_per_tensor_int4_can_represent():
    w = _weight()
    fig = render_weight_histogram(w, "w")
    drawn = sorted(_by_gid(fig, f"level:{i}").get_xdata()[0] for i in range(16))
    represented = sorted(set(dequantize(quantize(w, 4, per_tensor=True)).flatten().tolist()))
    assert all(np.isclose(drawn, v, atol=1e-6).any() for v in represented)  # every used level is drawn
    assert np.allclose(drawn, sorted(per_tensor_int4_levels(w)))
    half_step = (drawn[1] - drawn[0]) / 2  # the grid covers every weight to within half a step
    assert drawn[0] - half_step <= w.min().item() and drawn[-1] + half_step >= w.max().item()


def test_the_histogram_counts_every_weight():
    w = _weight()
    bars = [p for p in render_weight_histogram(w, "w").axes[0].patches]
    assert sum(b.get_height() for b in bars) == w.numel()


def test_channel_max_marks_the_largest_channels():
    act = torch.ones(40)
    act[[7, 30]] = torch.tensor([50.0, 20.0])
    fig = render_channel_max(act, torch.full((40,), 0.1), "layer")
    top = _by_gid(fig, "top:activations").get_offsets()
    assert len(top) == TOP_CHANNELS and list(top[:2, 0]) == [7, 30] and list(top[:2, 1]) == [50.0, 20.0]
    assert "[7, 30," in fig.axes[0].get_title()


def test_channel_max_needs_two_vectors_of_one_length():
    with pytest.raises(ValueError, match="activation_max"):
        render_channel_max(torch.ones(8), torch.ones(9), "layer")


def test_granularity_points_sit_at_their_bits_and_errors():
    rows = [{"label": "int4 per-tensor", "bits": 4, "bits_per_weight": 4.0, "error": 0.7},
            {"label": "int4 per-group 32", "bits": 4, "bits_per_weight": 6.0, "error": 0.08}]
    fig = render_granularity_error(rows)
    assert list(_by_gid(fig, "point:int4 per-group 32").get_offsets()[0]) == [6.0, 0.08]


def test_a_zero_error_cannot_go_on_the_log_axis():
    with pytest.raises(ValueError, match="error > 0"):
        render_granularity_error([{"label": "exact", "bits": 8, "bits_per_weight": 8.0, "error": 0.0}])


def test_gemv_bars_have_the_byte_counts():
    fig = render_gemv_bytes({"fp32": 16384, "int4 naive": 35072, "int4 fused": 2304}, 4096)
    assert _by_gid(fig, "bar:bytes:int4 naive").get_width() == 35072
    assert _by_gid(fig, "bar:bytes:int4 fused").get_facecolor() != _by_gid(fig, "bar:bytes:int4 naive").get_facecolor()


def test_layer_speed_bars_are_the_baseline_time_over_the_scheme_time():
    rows = [{"mode": "decode", "shape": "s", "scheme": "fp32", "ms": 9.0},
            {"mode": "decode", "shape": "s", "scheme": "int4", "ms": 3.0},
            {"mode": "prefill", "shape": "s", "scheme": "fp32", "ms": 10.0},
            {"mode": "prefill", "shape": "s", "scheme": "int4", "ms": 40.0}]
    fig = render_layer_speed(rows)
    assert _by_gid(fig, "bar:decode:s:int4").get_height() == pytest.approx(3.0)
    assert _by_gid(fig, "bar:prefill:s:int4").get_height() == pytest.approx(0.25)


def test_layer_speed_needs_the_baseline_for_every_shape():
    with pytest.raises(ValueError, match="baseline 'fp32'"):
        render_layer_speed([{"mode": "decode", "shape": "s", "scheme": "int4", "ms": 1.0}])


def test_bytes_breakdown_stacks_the_engines_breakdown():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(64, 32, bias=False)])
    model.embed = torch.nn.Embedding(100, 64)
    parts = weight_bytes_breakdown(model)
    fig = render_bytes_breakdown({"fp32": parts}, "toy")
    assert _by_gid(fig, "bar:fp32:float linears").get_width() == pytest.approx(32 * 64 * 4 / BYTES_PER_MIB)
    assert _by_gid(fig, "bar:fp32:embedding and lm_head").get_width() == pytest.approx(100 * 64 * 4 / BYTES_PER_MIB)
    assert _by_gid(fig, "bar:fp32:embedding and lm_head").get_x() == pytest.approx(32 * 64 * 4 / BYTES_PER_MIB)


def test_quality_draws_one_panel_per_metric_and_the_reference_line():
    rows = [{"scheme": s, "task": "arith", "metric": "exact", "value": v} for s, v in (("fp32", 0.9), ("int4", 0.7))]
    rows.append({"scheme": "fp32", "task": "story", "metric": "perplexity", "value": 1.7})
    fig = render_quality(rows)
    assert _by_gid(fig, "bar:arith/exact:int4").get_width() == 0.7
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 2
    dashed = [line for line in visible[0].lines if line.get_linestyle() == "--"]
    assert [line.get_xdata()[0] for line in dashed] == [0.9]


def test_quality_values_are_printed_readably_beside_their_bars():
    rows = [{"scheme": s, "task": "vs fp32", "metric": "top-1 agreement", "value": v}
            for s, v in (("fp32", 1.0), ("int8", 0.998), ("int4-per-tensor", 0.61))]
    ax = render_quality(rows).axes[0]
    labels = {t.get_text().strip(): t for t in ax.texts}
    assert set(labels) == {"1", "0.998", "0.61"}
    assert all(t.get_fontsize() >= 8 for t in labels.values())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fp32", "int8", "int4-per-tensor"]
    assert labels["0.61"].get_position()[0] == 0.61  # at the end of its own bar


def test_quality_uses_a_log_axis_only_for_a_panel_spanning_orders_of_magnitude():
    rows = [{"scheme": s, "task": "vs fp32", "metric": "KL", "value": v} for s, v in (("int8", 1e-4), ("int4", 0.5))]
    rows += [{"scheme": s, "task": "text", "metric": "perplexity", "value": v}
             for s, v in (("int8", 1.4), ("int4", 2.0))]
    fig = render_quality(rows)
    assert [ax.get_xscale() for ax in fig.axes[:2]] == ["log", "linear"]


def test_gptq_bars_have_their_errors_one_colour_per_method():
    rows = [{"layer": "q", "method": m, "data": d, "error": e}
            for m, d, e in (("RTN", "cal", 0.10), ("GPTQ", "cal", 0.06),
                            ("RTN", "other", 0.11), ("GPTQ", "other", 0.09))]
    fig = render_gptq_error(rows)
    assert _by_gid(fig, "bar:cal:q:GPTQ").get_width() == 0.06
    assert _by_gid(fig, "bar:other:q:RTN").get_width() == 0.11
    assert _by_gid(fig, "bar:cal:q:GPTQ").get_facecolor() == _by_gid(fig, "bar:other:q:GPTQ").get_facecolor()
    assert _by_gid(fig, "bar:cal:q:GPTQ").get_facecolor() != _by_gid(fig, "bar:cal:q:RTN").get_facecolor()
    with pytest.raises(ValueError, match="rows"):
        render_gptq_error([])


def test_empty_inputs_are_named():
    for render, arg in ((render_quality, []), (render_layer_speed, []), (render_granularity_error, [])):
        with pytest.raises(ValueError, match="rows"):
            render(arg)


def test_kv_int8_bars_have_the_bytes_and_times_they_were_given():
    fig = render_kv_int8({"tiny": {"fp32": 3072, "int8": 864}, "real": {"fp32": 46080, "int8": 12240}},
                         {"tiny": {"fp32": 2.0, "int8": 2.5}, "real": {"fp32": 40.0, "int8": 44.0}})
    assert _by_gid(fig, "bar:bytes:real:int8").get_height() == 12240
    assert _by_gid(fig, "bar:step:tiny:fp32").get_height() == 2.0
    assert _by_gid(fig, "bar:bytes:tiny:fp32").get_facecolor() != _by_gid(fig, "bar:bytes:tiny:int8").get_facecolor()
    with pytest.raises(ValueError, match="step_ms"):
        render_kv_int8({"tiny": {"fp32": 1}}, {})

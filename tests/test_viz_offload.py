"""The window and host-tier figures: their data comes from real engine traces, and the figures draw exactly the
numbers they are given."""

import matplotlib.colors as mcolors
import pytest
import torch

from engine.config import ModelConfig
from engine.llm_engine import LLMEngine, engine_config
from engine.model import LlamaModel
from engine.sampling import SamplingParams
from engine.viz.offload import (
    GB,
    MIB,
    TFLOP,
    held_blocks_by_length,
    moves_per_step,
    recompute_cost,
    render_blocks_held,
    render_break_even,
    render_offload_ttft,
)

BS, WINDOW = 4, 10
CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1)


def tiny_model() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(ModelConfig(**CFG)).eval()


def run(model, prompts, max_tokens: int = 20, **options) -> LLMEngine:
    eng = LLMEngine(model, None, engine_config(block_size=BS, num_threads=1, **options))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(prompt, params, request_id=f"r{i}")
        while eng.has_unfinished_requests():
            eng.step()
    return eng


def test_held_blocks_are_the_blocks_that_overlap_the_last_w_positions():
    """After a decode step the sequence holds n tokens' slots; the blocks it still needs are those holding
    positions n - W .. n - 1 (the next query, at n - 1 or later, reads only those)."""
    model, prompt = tiny_model(), list(range(3, 29))  # 26 tokens: more than the window
    windowed = held_blocks_by_length(run(model, [prompt], sliding_window=WINDOW).trace, "r0")
    full = held_blocks_by_length(run(model, [prompt]).trace, "r0")
    assert [n for n, _ in windowed] == [n for n, _ in full] and len(full) >= 10
    for n, held in full:
        assert held == -(-n // BS)
    for n, held in windowed[1:]:  # decode steps (the prefill step frees nothing yet)
        assert held == (n - 1) // BS - max(0, n - WINDOW) // BS + 1
        assert held <= -(-WINDOW // BS) + 1
    assert windowed[-1][1] < full[-1][1]


def test_an_unknown_request_is_named_in_the_error():
    trace = run(tiny_model(), [list(range(3, 10))]).trace
    with pytest.raises(ValueError, match="held_blocks_by_length: request_id 'nope'"):
        held_blocks_by_length(trace, "nope")


def test_moves_per_step_adds_up_to_the_block_managers_counts_and_the_pools_bytes():
    """Three 12-token documents cycled twice through a device pool that holds about one of them."""
    docs = [[3 + 10 * d + i for i in range(12)] for d in range(3)]
    prompts = [docs[d] + [50 + k] for k, d in enumerate([0, 1, 2, 0, 1, 2])]
    eng = run(tiny_model(), prompts, max_tokens=3, num_blocks=6, enable_prefix_caching=True, kv_offload_blocks=32)
    rows = moves_per_step(eng.trace)
    bm, block = eng.block_manager, eng.kv_pool.block_nbytes
    assert bm.num_reloaded > 0
    assert sum(r["offload"] for r in rows) == bm.num_offloaded
    assert sum(r["reload"] for r in rows) == bm.num_reloaded
    for r in rows:
        assert r["offload_bytes"] == r["offload"] * block and r["reload_bytes"] == r["reload"] * block
        assert r["bytes"] == (r["offload"] + r["reload"]) * block
    assert moves_per_step(run(tiny_model(), prompts, max_tokens=3, num_blocks=6).trace) == []  # no host tier


def test_recompute_cost_counts_kv_bytes_by_the_formula_and_the_ratio_doubles_with_a_half_size_kv():
    cfg = ModelConfig(**CFG)
    fp32 = recompute_cost(cfg, BS, 64, 4, 4)
    assert fp32.kv_bytes == 2 * 2 * 2 * 8 * BS * 4  # K and V x layers x Hkv x D x tokens x bytes
    assert fp32.flops > 2 * cfg.matmul_params() * BS  # the matmuls, plus attention on top
    half = recompute_cost(cfg, BS, 64, 2, 4)
    assert half.flops == fp32.flops and half.flops_per_kv_byte == pytest.approx(2 * fp32.flops_per_kv_byte)
    assert recompute_cost(cfg, BS, 128, 4, 4).flops > fp32.flops  # deeper blocks attend to more
    with pytest.raises(ValueError, match="recompute_cost: context_tokens = 2"):
        recompute_cost(cfg, BS, 2, 4, 4)


def _line(fig, gid):
    return next(line for ax in fig.axes for line in ax.lines if line.get_gid() == gid)


def test_the_blocks_held_figure_draws_each_run_and_the_window_bound():
    series = {"no window": [(8, 2), (30, 8), (12, 3)], "W = 10": [(8, 2), (12, 3), (30, 3)]}
    fig = render_blocks_held(series, BS, window=WINDOW)
    assert list(_line(fig, "held:no window").get_xdata()) == [8, 12, 30]  # sorted by length
    assert list(_line(fig, "held:W = 10").get_ydata()) == [2, 3, 3]
    assert list(_line(fig, "bound").get_ydata()) == [4, 4]  # ceil(10 / 4) + 1
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[:2] == ["no window", "W = 10"] and "ceil(W / BS) + 1 = 4" in legend[2]
    with pytest.raises(ValueError, match="render_blocks_held: series"):
        render_blocks_held({"empty": []}, BS)


def test_the_ttft_figure_draws_milliseconds_and_stacks_reload_on_offload():
    ttft = {"device only": [0.2, 0.1], "device + host": [0.2, 0.02]}
    moves = [{"step": 3, "offload_bytes": 2 * MIB, "reload_bytes": 0}, {"step": 5, "offload_bytes": MIB,
                                                                         "reload_bytes": 3 * MIB}]
    fig = render_offload_ttft(ttft, moves, documents=[0, 1], threads=1)
    assert list(_line(fig, "ttft:device + host").get_ydata()) == pytest.approx([200.0, 20.0])
    bars = {kind: [p for p in fig.axes[1].patches if p.get_gid() == kind] for kind in ("offload", "reload")}
    assert [p.get_height() for p in bars["offload"]] == [2.0, 1.0]
    assert [p.get_height() for p in bars["reload"]] == [0.0, 3.0] and [p.get_y() for p in bars["reload"]] == [2.0, 1.0]
    assert mcolors.to_hex(bars["offload"][0].get_facecolor()) != mcolors.to_hex(bars["reload"][0].get_facecolor())
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["d0", "d1"]
    empty = render_offload_ttft(ttft, [])
    assert "no block moved" in [t.get_text() for t in empty.axes[1].texts]
    with pytest.raises(ValueError, match="different request counts"):
        render_offload_ttft({"a": [0.1], "b": [0.1, 0.2]}, [])
    with pytest.raises(ValueError, match="documents has 1 entries for 2 requests"):
        render_offload_ttft(ttft, [], documents=[0])


def test_the_break_even_figure_puts_each_model_on_its_ratio_line_and_labels_nominal_machines():
    models = {"small": 5_000.0, "big": 100_000.0}
    machines = [{"name": "cpu", "flops_per_s": 5e10, "link_bytes_per_s": 5e9},
                {"name": "gpu", "flops_per_s": 1e15, "link_bytes_per_s": 6.4e10, "nominal": True}]
    fig = render_break_even(models, machines)
    line = _line(fig, "model:big")
    for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True):
        assert y * TFLOP == pytest.approx(100_000.0 * x * GB)  # compute = ratio x bandwidth
    gpu = _line(fig, "machine:gpu")
    assert (gpu.get_xdata()[0], gpu.get_ydata()[0]) == pytest.approx((64.0, 1000.0))
    assert mcolors.to_hex(gpu.get_markerfacecolor()) == "#ffffff"  # hollow: a spec-sheet number
    assert mcolors.to_hex(_line(fig, "machine:cpu").get_markerfacecolor()) == "#000000"
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "gpu\n(nominal)" in texts and "cpu\n(measured)" in texts
    slow = render_break_even(models, [{"name": "old", "flops_per_s": 1e6, "link_bytes_per_s": 1e5}])
    assert slow.axes[0].get_xlim()[0] < 1e-4 and slow.axes[0].get_ylim()[0] < 1e-6  # the axes widen to hold it
    with pytest.raises(ValueError, match="render_break_even: machines entry"):
        render_break_even(models, [{"name": "x"}])

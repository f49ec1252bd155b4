"""Chapter 02: FLOPs and bytes of a forward, and the roofline that says which one limits it.

Expected numbers are worked out by hand in the comments, never copied from the code's output.
"""

import pytest

from engine.companions.memory import kv_cache_bytes
from engine.companions.roofline import (
    ForwardCost,
    MachineRoofline,
    attainable_flops,
    calibrate,
    classify,
    decode_roofline_tokens_per_s,
    forward_cost,
    last_level_cache_bytes,
    predicted_time,
    ridge_point,
)
from engine.config import MODEL_PRESETS, ModelConfig

# A made-up accelerator with H100-like spec numbers: 1e15 FLOP/s, 4e12 B/s -> ridge at 250 FLOP/B.
SYNTHETIC = MachineRoofline(peak_flops=1e15, bandwidth_bytes_per_s=4e12, dtype="fp16",
                            description="synthetic")
LLAMA3 = MODEL_PRESETS["Llama-3-8B"]
FP16 = 2

# layers 2, hidden 8, 4 heads, 2 KV heads, head dim 2, intermediate 16, vocab 10, tied.
TINY = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=2, max_position_embeddings=64, tie_word_embeddings=True)


def test_forward_cost_of_a_tiny_model_by_hand():
    # Matmul params per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 + MLP 3*8*16 = 576; 2 layers + LM head 80
    # = 1232. Batch 3 x 4 new tokens = 12 tokens -> 2 * 1232 * 12 = 29568 FLOPs.
    # Attention: 4 * L 2 * H 4 * D 2 * new 4 * context 6 * batch 3 = 4608 FLOPs.
    cost = forward_cost(TINY, batch=3, new_tokens=4, context_tokens=6, weight_dtype_bytes=2, kv_dtype_bytes=2)
    assert cost.matmul_flops == 29568
    assert cost.attention_flops == 4608
    assert cost.flops == 29568 + 4608
    # Params: embedding 80 (tied, so read in full as the LM head) + attention 2*192 + MLP 2*384
    # + norms 2*2*8 + 8 = 1272 -> 2544 bytes in fp16.
    assert cost.weight_bytes == 2544
    # KV: 2 * L 2 * B 3 * T 6 * Hkv 2 * D 2 * 2 B = 576 read; T 4 -> 384 written.
    assert (cost.kv_read_bytes, cost.kv_write_bytes) == (576, 384)
    # Activations per token per layer: 16 + 16 + 8 + 48 = 88 elements; logits 10 per token.
    # Written and read once: 2 * (2 layers * 88 * 12 + 10 * 12) elements * 2 B = 8928 B.
    assert cost.activation_bytes == 8928
    assert cost.total_bytes == 2544 + 576 + 384 + 8928
    assert cost.intensity == pytest.approx(34176 / 12432)


def test_decode_reads_the_context_kv_and_writes_one_token_per_sequence():
    cost = forward_cost(LLAMA3, batch=4, new_tokens=1, context_tokens=1000, weight_dtype_bytes=FP16,
                        kv_dtype_bytes=FP16)
    assert cost.kv_read_bytes == kv_cache_bytes(32, 4, 1000, 8, 128, 2) == 4 * 1000 * 131072
    assert cost.kv_write_bytes == 4 * 131072


def test_an_untied_embedding_table_is_not_streamed_each_forward():
    # Llama-3-8B: 8_030_261_248 params minus the 128256 * 4096 = 525_336_576 embedding table.
    cost = forward_cost(LLAMA3, 1, 1, 1, FP16, FP16)
    assert cost.weight_bytes == 2 * (8_030_261_248 - 525_336_576)


def test_batch_one_fp16_decode_does_about_one_flop_per_byte():
    # About 2 FLOPs per weight and 2 bytes per weight: intensity near 1, far below any GPU's ridge.
    cost = forward_cost(LLAMA3, 1, 1, 1024, FP16, FP16)
    assert 0.5 < cost.intensity < 1.5
    assert classify(cost, SYNTHETIC) == "bandwidth-bound"


def test_decode_intensity_grows_with_batch():
    intensities = [forward_cost(LLAMA3, b, 1, 1024, FP16, FP16).intensity for b in (1, 2, 4, 8, 16, 32, 64)]
    assert intensities == sorted(intensities) and len(set(intensities)) == len(intensities)
    assert intensities[-1] > 20 * intensities[0]


def test_prefill_is_far_more_intense_than_decode_and_compute_bound():
    prefill = forward_cost(LLAMA3, 1, 2048, 2048, FP16, FP16)
    decode = forward_cost(LLAMA3, 1, 1, 2048, FP16, FP16)
    assert prefill.intensity > 100 * decode.intensity
    assert prefill.intensity > ridge_point(SYNTHETIC)
    assert classify(prefill, SYNTHETIC) == "compute-bound"
    assert classify(decode, SYNTHETIC) == "bandwidth-bound"


def test_a_sliding_window_caps_the_attended_context():
    mistral = MODEL_PRESETS["Mistral-7B-v0.1"]
    long = forward_cost(mistral, 1, 1, 32768, FP16, FP16)
    at_window = forward_cost(mistral, 1, 1, 4096, FP16, FP16)
    assert long.kv_read_bytes == at_window.kv_read_bytes == 4096 * 131072
    assert long.attention_flops == at_window.attention_flops


@pytest.mark.parametrize("kwargs,field", [
    (dict(batch=0, new_tokens=1, context_tokens=1), "batch"),
    (dict(batch=1, new_tokens=0, context_tokens=1), "new_tokens"),
    (dict(batch=1, new_tokens=1, context_tokens=2.5), "context_tokens"),
    (dict(batch=1, new_tokens=5, context_tokens=4), "context_tokens"),
])
def test_forward_cost_rejects_bad_counts_and_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        forward_cost(TINY, weight_dtype_bytes=2, kv_dtype_bytes=2, **kwargs)


def test_forward_cost_rejects_an_unknown_element_size():
    with pytest.raises(ValueError, match="one of"):
        forward_cost(TINY, 1, 1, 1, weight_dtype_bytes=3, kv_dtype_bytes=2)


def test_ridge_and_attainable_flops_follow_the_two_roofs():
    assert ridge_point(SYNTHETIC) == 250
    assert attainable_flops(SYNTHETIC, 1) == 4e12  # on the slope: bandwidth * intensity
    assert attainable_flops(SYNTHETIC, 100) == 4e14
    assert attainable_flops(SYNTHETIC, 250) == 1e15  # at the ridge both roofs agree
    assert attainable_flops(SYNTHETIC, 10_000) == 1e15  # flat roof: peak


def _cost(flops, total_bytes):
    return ForwardCost(flops, total_bytes, 0, 0, 0, total_bytes, flops / total_bytes)


def test_predicted_time_is_the_slower_of_compute_and_memory():
    # 1e12 FLOPs at 1e15 FLOP/s = 1 ms; 1e9 B at 4e12 B/s = 0.25 ms -> compute wins, 1 ms.
    assert predicted_time(_cost(1e12, 1e9), SYNTHETIC) == pytest.approx(1e-3)
    assert classify(_cost(1e12, 1e9), SYNTHETIC) == "compute-bound"
    # 1e10 FLOPs = 10 us; 1.6e10 B at 4e12 B/s = 4 ms -> memory wins, 4 ms.
    assert predicted_time(_cost(1e10, 1.6e10), SYNTHETIC) == pytest.approx(4e-3)
    assert classify(_cost(1e10, 1.6e10), SYNTHETIC) == "bandwidth-bound"


def test_decode_upper_bound_is_bandwidth_over_bytes_per_token():
    # Weights streamed: 2 * (8_030_261_248 - 525_336_576) = 15_009_849_344 B, plus one token of KV
    # (131072 B): 4e12 / 15_009_980_416 = about 266.5 tokens/s at most, at batch 1.
    tokens_per_s = decode_roofline_tokens_per_s(LLAMA3, SYNTHETIC, FP16)
    assert tokens_per_s == pytest.approx(4e12 / 15_009_980_416)
    # A long context adds its KV to every step's reads: 8192 tokens * 131072 B = 1 GiB more.
    long = decode_roofline_tokens_per_s(LLAMA3, SYNTHETIC, FP16, context_tokens=8192)
    assert long == pytest.approx(4e12 / (15_009_849_344 + 8192 * 131072))


def test_halving_the_weight_bytes_nearly_doubles_the_decode_bound():
    fp16 = decode_roofline_tokens_per_s(LLAMA3, SYNTHETIC, 2)
    int8 = decode_roofline_tokens_per_s(LLAMA3, SYNTHETIC, 1)
    assert int8 == pytest.approx(2 * fp16, rel=1e-4)


def test_fast_calibration_still_copies_past_the_last_level_cache(monkeypatch):
    # A copy that fits in L3 measures the cache, not DRAM, and moves the ridge: FAST may shorten the
    # time, never the buffer below twice the cache.
    monkeypatch.setenv("SERVELAB_FAST", "1")
    copied_mib = int(calibrate().description.split("copy ")[1].split(" MiB")[0])
    assert copied_mib * 2**20 >= 2 * last_level_cache_bytes()


@pytest.mark.parametrize("text, expected", [("32768K\n", 32 * 2**20), ("480M", 480 * 2**20), ("1G", 2**30),
                                            ("4096", 4096), ("", 32 * 2**20), ("big", 32 * 2**20)])
def test_the_last_level_cache_is_read_from_sysfs_with_its_unit(tmp_path, text, expected):
    size = tmp_path / "size"
    size.write_text(text)
    assert last_level_cache_bytes(str(size)) == expected
    assert last_level_cache_bytes(str(tmp_path / "missing")) == 32 * 2**20


def test_a_cpu_with_a_large_cache_gets_a_copy_twice_its_size(monkeypatch):
    """A server's 480 MiB L3 (seen from a VM): the 128 MiB FAST copy would measure the cache."""
    import engine.companions.roofline as roofline

    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: 480 * 2**20)
    assert roofline.calibration_copy_bytes(fast=True) == roofline.calibration_copy_bytes(fast=False) == 960 * 2**20
    assert roofline.calibration_copy_bytes(fast=True, device="cuda") == 128 * 2**20  # a GPU: not the CPU's L3
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: 8 * 2**20)
    assert roofline.calibration_copy_bytes(fast=True) == 128 * 2**20
    assert roofline.calibration_copy_bytes(fast=False) == 256 * 2**20


def test_calibrate_returns_positive_numbers_under_fast_mode(monkeypatch):
    monkeypatch.setenv("SERVELAB_FAST", "1")
    machine = calibrate()
    assert machine.peak_flops > 0 and machine.bandwidth_bytes_per_s > 0
    assert machine.dtype == "fp32"
    assert "achieved" in machine.description
    assert ridge_point(machine) > 0

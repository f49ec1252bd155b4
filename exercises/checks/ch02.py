"""Checks for chapter 02: the FLOPs and bytes of a decode step, arithmetic intensity,
the roofline verdict.

Each `check_<claim>(mod)` runs against the student's `exercises/ch02_prefill_decode.py` or the
reference in `exercises/solutions/`. The functions are compared with
`engine.companions.roofline.forward_cost` on several published shapes, and with numbers worked out
by hand in the comments.
"""

from __future__ import annotations

import math

from engine.companions.roofline import MachineRoofline, forward_cost
from engine.companions.roofline import classify as engine_classify
from engine.config import MODEL_PRESETS, ModelConfig

# (batch, context tokens) of the decode steps we compare; contexts stay under Mistral's 4096 window,
# beyond which the engine (rightly) stops counting older tokens.
DECODE_STEPS = [(1, 1), (1, 1024), (8, 512), (32, 4096)]
# (weight bytes, KV bytes): fp16 everywhere, int8 weights with an fp16 cache, int4 weights with an
# int8 cache, fp32 everywhere.
DTYPES = [(2, 2), (1, 2), (0.5, 1), (4, 4)]
REL_TOL = 1e-12  # the answers are exact integers or a single division; allow only float rounding

# Spec-sheet numbers:
# A100 SXM 80 GB, dense bf16 312 TFLOP/s and 2.039 TB/s (ridge about 153 FLOP/B);
# H100 SXM, dense bf16 989 TFLOP/s and 3.35 TB/s (ridge about 295 FLOP/B).
A100 = MachineRoofline(312e12, 2.039e12, "bf16", "A100 SXM 80GB, spec sheet")
H100 = MachineRoofline(989e12, 3.35e12, "bf16", "H100 SXM, spec sheet")
LLAMA2 = MODEL_PRESETS["Llama-2-7B"]


def _params_read(shape: ModelConfig) -> int:
    """Parameters streamed each step: all but an untied embedding table (a lookup, not a matmul)."""
    return shape.num_params() - (0 if shape.tie_word_embeddings
                                 else shape.vocab_size * shape.hidden_size)


def _flops(mod, shape: ModelConfig, batch: int, context: int):
    return mod.decode_step_flops(shape.matmul_params(), shape.num_hidden_layers,
                                 shape.num_attention_heads, shape.head_dim, batch, context)


def _bytes(mod, shape: ModelConfig, batch: int, context: int, weight_b: float, kv_b: float):
    return mod.decode_step_bytes(_params_read(shape), shape.num_hidden_layers,
                                 shape.num_key_value_heads, shape.head_dim, batch, context,
                                 weight_b, kv_b)


def _assert_close(got, want, call: str) -> None:
    assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=REL_TOL), (
        f"{call} gave {got!r}, expected {want!r}")


# ---- FLOPs ---------------------------------------------------------------------------------------


def check_decode_step_flops_of_llama2_7b_by_hand(mod) -> None:
    # matmul params: per layer q, k, v, o 4 * 4096 * 4096 = 67,108,864
    # (no GQA: k and v are full size) + MLP 3 * 4096 * 11008 = 135,266,304 -> 202,375,168;
    # * 32 layers = 6,476,005,376; + LM head 4096 * 32000 = 131,072,000 -> 6,607,077,376.
    # Matmuls: 2 * that = 13,214,154,752 FLOPs.
    # Attention at T = 1024: 4 * 32 layers * 32 heads * 128 dims * 1024 tokens = 536,870,912.
    got = mod.decode_step_flops(6_607_077_376, 32, 32, 128, 1, 1024)
    _assert_close(got, 13_214_154_752 + 536_870_912,
                  "decode_step_flops(Llama-2-7B, batch=1, context=1024)")


def check_decode_step_flops_match_the_engine(mod) -> None:
    for name, shape in MODEL_PRESETS.items():
        for batch, context in DECODE_STEPS:
            want = forward_cost(shape, batch, 1, context, 2, 2).flops
            _assert_close(_flops(mod, shape, batch, context), want,
                          f"decode_step_flops({name}, batch={batch}, context={context})")


# ---- bytes ---------------------------------------------------------------------------------------


def check_decode_step_bytes_of_llama2_7b_by_hand(mod) -> None:
    # Params read: 6,738,415,616 in all, minus the 32000 * 4096 = 131,072,000 embedding table (a
    # lookup) = 6,607,343,616; in fp16 13,214,687,232 bytes.
    # KV per token: 2 * 32 layers * 32 KV heads * 128 dims * 2 bytes = 524,288 (half a MiB).
    # Read 1024 tokens: 536,870,912; write 1 token: 524,288.
    got = mod.decode_step_bytes(6_607_343_616, 32, 32, 128, 1, 1024, 2, 2)
    _assert_close(got, 13_214_687_232 + 536_870_912 + 524_288,
                  "decode_step_bytes(Llama-2-7B, batch=1, context=1024, fp16)")


def check_decode_step_bytes_read_the_weights_once_per_batch(mod) -> None:
    # Batch 8: the weights are read once, the KV (read 1024 tokens + write 1) once per sequence:
    # 13,214,687,232 + 8 * 524,288 * 1025 = 13,214,687,232 + 4,299,161,600 = 17,513,848,832.
    got = mod.decode_step_bytes(6_607_343_616, 32, 32, 128, 8, 1024, 2, 2)
    _assert_close(got, 17_513_848_832, "decode_step_bytes(Llama-2-7B, batch=8, context=1024, fp16) "
                  "(the weights are shared by the batch, the KV cache is not)")


def check_decode_step_bytes_match_the_engine(mod) -> None:
    for name, shape in MODEL_PRESETS.items():
        for batch, context in DECODE_STEPS:
            for weight_b, kv_b in DTYPES:
                cost = forward_cost(shape, batch, 1, context, weight_b, kv_b)
                want = cost.weight_bytes + cost.kv_read_bytes + cost.kv_write_bytes
                _assert_close(_bytes(mod, shape, batch, context, weight_b, kv_b), want,
                              f"decode_step_bytes({name}, batch={batch}, context={context}, "
                              f"weight_bytes={weight_b}, kv_bytes={kv_b})")


# ---- intensity and the verdict -------------------------------------------------------------------


def check_arithmetic_intensity_is_flops_per_byte(mod) -> None:
    _assert_close(mod.arithmetic_intensity(10, 4), 2.5, "arithmetic_intensity(10, 4)")
    cost = forward_cost(MODEL_PRESETS["Llama-3-8B"], 4, 16, 64, 2, 2)
    _assert_close(mod.arithmetic_intensity(cost.flops, cost.total_bytes), cost.intensity,
                  "arithmetic_intensity(flops, bytes) of a Llama-3-8B forward")


def check_decode_of_llama2_7b_at_batch_1_does_about_one_flop_per_byte(mod) -> None:
    # 13,751,025,664 FLOPs / 13,752,082,432 bytes = 0.99992...: in fp16 each 2-byte weight serves
    # exactly one multiply-add (2 FLOPs) per token, so batch-1 decode sits at about 1 FLOP per byte.
    flops, moved = _flops(mod, LLAMA2, 1, 1024), _bytes(mod, LLAMA2, 1, 1024, 2, 2)
    _assert_close(mod.arithmetic_intensity(flops, moved), 13_751_025_664 / 13_752_082_432,
                  "arithmetic_intensity of a Llama-2-7B decode step (batch 1, context 1024, fp16)")


def check_classify_puts_the_ridge_point_on_the_compute_side(mod) -> None:
    # peak 1000 FLOP/s, bandwidth 10 B/s: the ridge sits at 100 FLOP per byte.
    cases = [(100.0, "compute-bound"), (99.9, "bandwidth-bound"), (1e4, "compute-bound"),
             (0.5, "bandwidth-bound")]
    for intensity, want in cases:
        got = mod.classify(intensity, 1000.0, 10.0)
        assert got == want, (
            f"classify({intensity}, peak 1000, bandwidth 10) gave {got!r}, "
            f"expected {want!r} (the ridge point is 1000 / 10 = 100 FLOP per byte)")


def check_classify_matches_the_engine_on_prefill_and_decode(mod) -> None:
    # Llama-3-8B in fp16: decode at batch 1 is about 1 FLOP/B (left of both ridges); a 2048-token
    # prefill reuses every weight for 2048 tokens, about a thousand FLOP/B (right of both).
    shape = MODEL_PRESETS["Llama-3-8B"]
    for roofline in (A100, H100):
        for what, cost in (("decode, batch 1", forward_cost(shape, 1, 1, 2048, 2, 2)),
                           ("prefill of 2048 tokens", forward_cost(shape, 1, 2048, 2048, 2, 2))):
            got = mod.classify(cost.intensity, roofline.peak_flops, roofline.bandwidth_bytes_per_s)
            want = engine_classify(cost, roofline)
            assert got == want, (
                f"classify(Llama-3-8B {what} on {roofline.description}) gave {got!r}, "
                f"expected {want!r}")
    decode = forward_cost(shape, 1, 1, 2048, 2, 2).intensity
    assert mod.classify(decode, H100.peak_flops, H100.bandwidth_bytes_per_s) == "bandwidth-bound"

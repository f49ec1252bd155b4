"""Issue 13: KV int8 in the paged pools. Values int8, one fp32 scale per token and KV head; attention reads
them in the torch reference and dequantizes in registers in the Triton kernel.

Oracles: the float reference on the dequantized cache (for the kernels: same numbers up to fp32 rounding),
the quantization error bound (|x - q * scale| <= scale / 2), and a naive no-cache loop whose attention sees
K/V through the same quantize-dequantize (for the engine: greedy tokens equal, token for token).
"""

import pytest
import torch

from engine.companions.memory import kv_block_bytes
from engine.companions.naive import generate_naive
from engine.config import CacheConfig
from engine.llm_engine import LLMEngine, engine_config
from engine.model import NoCacheAttention
from engine.sampling import SamplingParams
from engine_fixtures import random_model
from kernels.paged_attention import paged_decode_attention, write_kv
from kernels.paged_attention.reference import (
    INT8_MAX,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    quantize_kv_int8,
)
from test_paged_attention import DEVICE, make_paged_cache


def test_quantize_kv_int8_error_is_at_most_half_a_step_per_value():
    x = torch.randn(50, 3, 16) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of very different sizes
    x[7, 1, 4] = 0.0
    x[9] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_kv_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3) and q.abs().max() <= INT8_MAX
    err = (x - q.float() * scale[..., None]).abs()
    assert (err <= scale[..., None] / 2 + 1e-12).all()
    assert torch.equal(q[9], torch.zeros_like(q[9]))
    assert (q.abs().amax(dim=-1)[x.abs().amax(dim=-1) > 0] == INT8_MAX).all()  # each row uses the full range


def int8_cache(seq_lens, block_size, **shape):
    """The float cache of make_paged_cache, written again into int8 pools through write_kv."""
    inputs, ks, vs = make_paged_cache(seq_lens, block_size, **shape)
    k_pool = torch.zeros(inputs["k_pool"].shape, dtype=torch.int8)
    v_pool = torch.zeros_like(k_pool)
    scales = (torch.zeros(k_pool.shape[:3]), torch.zeros(k_pool.shape[:3]))
    for b, n in enumerate(seq_lens):
        table = inputs["block_tables"][b]
        slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(n)])
        write_kv(ks[b], vs[b], k_pool, v_pool, slots, scales=scales)
    return dict(inputs, k_pool=k_pool, v_pool=v_pool), scales, ks, vs


def dequantized(int8_inputs, scales):
    """The same cache, dequantized into fp32 pools: what the float reference should see."""
    k = int8_inputs["k_pool"].float() * scales[0][..., None]
    v = int8_inputs["v_pool"].float() * scales[1][..., None]
    return dict(int8_inputs, k_pool=k, v_pool=v)


@pytest.mark.parametrize("window", [None, 5])
def test_int8_decode_equals_the_float_reference_on_the_dequantized_cache(window):
    inputs, scales, _, _ = int8_cache([1, 4, 9, 14], 4, num_heads=4, num_kv_heads=2, head_dim=16)
    out = paged_decode_attention_ref(**inputs, sliding_window=window, scales=scales)
    expected = paged_decode_attention_ref(**dequantized(inputs, scales), sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_int8_decode_stays_close_to_the_unquantized_cache():
    inputs, scales, _, _ = int8_cache([9, 14], 4, num_heads=4, num_kv_heads=2, head_dim=16)
    floats, _, _ = make_paged_cache([9, 14], 4, num_heads=4, num_kv_heads=2, head_dim=16)
    out = paged_decode_attention_ref(**inputs, scales=scales)
    exact = paged_decode_attention_ref(**floats)
    err = (out - exact).abs().max()
    assert 0 < err < 0.05  # not bit-exact (it is quantized), but within a few int8 steps of unit-scale values


def test_int8_prefill_equals_the_float_reference_on_the_dequantized_cache():
    inputs, scales, _, _ = int8_cache([13], 4, num_heads=4, num_kv_heads=2, head_dim=8)
    q = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(3))
    args = (inputs["block_tables"][0], torch.arange(8, 13), inputs["scale"])
    out = paged_prefill_attention_ref(q, inputs["k_pool"], inputs["v_pool"], *args, scales=scales)
    deq = dequantized(inputs, scales)
    torch.testing.assert_close(out, paged_prefill_attention_ref(q, deq["k_pool"], deq["v_pool"], *args),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton runs compiled (tested below)")
@pytest.mark.parametrize("window", [None, 6])
def test_triton_int8_decode_matches_the_reference(window):
    inputs, scales, _, _ = int8_cache([1, 5, 9, 14], 4, num_heads=4, num_kv_heads=2, head_dim=8)
    torch.testing.assert_close(paged_decode_attention(**inputs, backend="triton", sliding_window=window,
                                                      scales=scales),
                               paged_decode_attention_ref(**inputs, sliding_window=window, scales=scales),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_int8_decode_on_gpu_matches_the_reference():
    inputs, scales, _, _ = int8_cache([1, 17, 40, 64], 16, num_heads=8, num_kv_heads=2, head_dim=64)
    to = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in inputs.items()}
    scales = tuple(s.to(DEVICE) for s in scales)
    torch.testing.assert_close(paged_decode_attention(**to, backend="triton", scales=scales),
                               paged_decode_attention_ref(**to, scales=scales), atol=1e-5, rtol=1e-5)


def test_int8_pools_without_scales_and_float_pools_with_scales_are_clear_errors():
    inputs, scales, _, _ = int8_cache([5], 4, num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="scales: int8 pools need scales"):
        paged_decode_attention_ref(**inputs)
    floats, _, _ = make_paged_cache([5], 4, num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="scales"):
        paged_decode_attention_ref(**floats, scales=scales)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp8")


# ---- the engine ---------------------------------------------------------------------------------------


class FakeQuantAttention(NoCacheAttention):
    """No-cache attention whose K and V pass through the int8 quantize-dequantize first: the oracle."""

    def forward(self, layer, q, k, v, meta=None):
        B, T, Hkv, D = k.shape
        k, v = (self._roundtrip(x.reshape(B * T, Hkv, D)).reshape(B, T, Hkv, D).to(x.dtype) for x in (k, v))
        return super().forward(layer, q, k, v, meta)

    @staticmethod
    def _roundtrip(x):
        q, scale = quantize_kv_int8(x)
        return q.float() * scale[..., None]


def greedy_with_fake_quant_kv(model, prompt, max_tokens):
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids]), backend=FakeQuantAttention(model.config.sliding_window),
                       last_only=True)  # [1, V]
        ids.append(int(logits[0].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("options", [dict(), dict(num_blocks=12, preemption_mode="swap"),
                                     dict(enable_prefix_caching=True, kv_offload_blocks=8, num_blocks=12),
                                     dict(sliding_window=6)], ids=["plain", "swap", "offload", "window"])
@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_engine_with_int8_kv_equals_the_fake_quant_oracle_token_for_token(options, speed):
    model = random_model(seed=2)
    prompts = [list(range(2, 2 + n)) for n in (5, 17, 30)] + [list(range(2, 2 + 17)) + [9, 9]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = LLMEngine(model, None, engine_config("random", speed=speed, block_size=4,
                                                  **{"num_blocks": 64, **options}, kv_cache_dtype="int8"))
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    window = options.get("sliding_window")
    model.config.sliding_window = window
    try:
        expected = [greedy_with_fake_quant_kv(model, p, 10) for p in prompts]
    finally:
        model.config.sliding_window = None
    assert [engine.get_request(i).output_token_ids for i in ids] == expected
    assert engine.block_manager.usage().used_blocks == 0


def test_int8_kv_takes_about_a_quarter_of_fp32s_bytes_and_the_formula_counts_its_scales():
    model = random_model()
    fp32 = LLMEngine(model, None, engine_config("random", block_size=4, num_blocks=10))
    int8 = LLMEngine(model, None, engine_config("random", block_size=4, num_blocks=10, kv_cache_dtype="int8"))
    D = model.config.head_dim  # 16: int8 takes D + 4 bytes per token and head, fp32 4 D
    assert int8.kv_pool.nbytes * 4 * D == fp32.kv_pool.nbytes * (D + 4)
    assert int8.kv_pool.nbytes == 10 * kv_block_bytes(model.config, 4, torch.int8)
    # the same byte budget holds (4 D) / (D + 4) times more int8 blocks
    budget = fp32.kv_pool.nbytes
    more = LLMEngine(model, None, engine_config("random", block_size=4, kv_cache_memory_bytes=budget,
                                                kv_cache_dtype="int8"))
    assert more.kv_pool.num_blocks == budget // kv_block_bytes(model.config, 4, torch.int8) == 32


def test_the_fake_quant_oracle_is_not_the_float_model():
    """Guard: on this model int8 KV changes some greedy token somewhere, so the oracle above is needed."""
    model = random_model(seed=2)
    changed = 0
    for n in range(3, 60, 4):
        prompt = list(range(2, 2 + n))
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        changed += greedy_with_fake_quant_kv(model, prompt, 10) != generate_naive(model, None, prompt, params).token_ids
    assert changed > 0

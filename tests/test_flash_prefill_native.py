"""The C flash-prefill kernel (kernels/flash_prefill/cpu_native.c): causal attention of whole prompts on the CPU,
many prompts in one call. Oracle: the naive [H, T, T] attention (kernels/flash_prefill/reference.py), per prompt,
on the same inputs; the engine's greedy outputs with it equal the reference backend's (test_paged_attention_native)."""

import pytest
import torch

from engine.llm_engine import LLMEngine
from kernels.flash_prefill import cpu_native, flash_prefill_attention, resolve_backend
from kernels.flash_prefill.cpu_native import flash_prefill_native, why_library_cannot_load
from kernels.flash_prefill.reference import causal_attention_naive
from test_flash_prefill import assert_close

pytestmark = pytest.mark.skipif(why_library_cannot_load() is not None,
                                reason=f"the C kernel cannot be built here: {why_library_cannot_load()}")


def fused_qkv(num_tokens, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """q, k, v as column slices of one [N, (H + 2 Hkv) * D] tensor, as the fused QKV projection leaves them."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("length", [1, 7, 16, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_prompt_equals_the_naive_attention(length, heads, kv_heads, dtype, threads):
    """Lengths around the query tile (16) and the key tile (32): tails, exact tiles, a diagonal tile in the middle;
    MHA, SmolLM2's groups of 3, groups of 4, MQA."""
    q, k, v = fused_qkv(length, heads, kv_heads, 64, dtype)
    assert_close(flash_prefill_native(q, k, v, 0.125), causal_attention_naive(q, k, v, 0.125), dtype, "native")


@pytest.mark.parametrize("head_dim", [8, 80, 128, 256])
def test_head_sizes_with_and_without_the_register_blocks(head_dim):
    """64 and 128 take the unrolled blocks, 80 and 256 the run-time sizes, 8 the plain loops (not a whole vector)."""
    q, k, v = fused_qkv(70, 6, 2, head_dim, seed=1)
    scale = head_dim ** -0.5
    assert_close(flash_prefill_native(q, k, v, scale), causal_attention_naive(q, k, v, scale), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_prompts_in_one_call_each_see_only_themselves(dtype, threads):
    """Prompts side by side with rows between them (a step's decode rows): each prompt attends to its own tokens
    from position 0, the rows between are not written, and nothing leaks across (NaN rows between would show)."""
    q, k, v = fused_qkv(200, 9, 3, 64, dtype, seed=2)
    for t in (q, k, v):
        t[40] = float("nan")  # a row that belongs to no prompt
    prompts = [(0, 40), (41, 42), (42, 150), (160, 200)]
    out = torch.full_like(q, 7.0)
    cpu_native.flash_prefill_planned(q, k, v, 0.125, torch.tensor(prompts), out)
    for lo, hi in prompts:
        assert_close(out[lo:hi], causal_attention_naive(q[lo:hi], k[lo:hi], v[lo:hi], 0.125), dtype, f"{lo}:{hi}")
    assert (out[40] == 7.0).all() and (out[150:160] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sharp_score_and_a_large_range_come_out_right(dtype):
    """A score far above the rest (a one-hot softmax, the online max moving from tile to tile) and huge scores
    (exp clamped, never inf): the same as the oracle."""
    q, k, v = fused_qkv(90, 4, 2, 64, dtype, seed=3)
    k[70] = q[89, 0] * 30  # query 89's head 0 meets one key of enormous score, in a late tile
    q[:, 1] *= 40  # head 1: scores in the thousands
    assert_close(flash_prefill_native(q, k, v, 0.125), causal_attention_naive(q, k, v, 0.125), dtype, "sharp")


def test_the_other_builds_equal_the_naive_attention_too(other_build):
    other_build(cpu_native)
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim, heads, kv_heads in ((64, 9, 3), (128, 8, 2), (12, 4, 4)):
            q, k, v = fused_qkv(75, heads, kv_heads, head_dim, dtype, seed=4)
            scale = head_dim ** -0.5
            assert_close(flash_prefill_native(q, k, v, scale), causal_attention_naive(q, k, v, scale), dtype,
                         other_build.name)


def test_the_dispatcher_runs_it_and_falls_back_where_it_cannot():
    q, k, v = fused_qkv(20, 4, 2, 16)
    assert resolve_backend("native", torch.device("cpu")) == "native"
    assert_close(flash_prefill_attention(q, k, v, 0.25, backend="native"), causal_attention_naive(q, k, v, 0.25),
                 torch.float32)
    with pytest.warns(RuntimeWarning, match="reads fp32 and bf16"):
        out = flash_prefill_attention(q.half(), k.half(), v.half(), 0.25, backend="native")
    assert_close(out, causal_attention_naive(q.half(), k.half(), v.half(), 0.25), torch.float16)


@pytest.mark.parametrize("prompts,match", [
    ([(0, 10), (5, 20)], "in order, apart"),
    ([(0, 0)], "at least one row"),
    ([(0, 21)], "inside 0 .. 20"),
    ([(3, 2)], "in order"),
    ([], "at least one"),
])
def test_bad_prompt_ranges_are_refused(prompts, match):
    q, k, v = fused_qkv(20, 4, 2, 16)
    with pytest.raises(ValueError, match=f"prompts: .*{match}"):
        flash_prefill_native(q, k, v, 0.25, prompts)


def test_bad_tensors_are_refused():
    q, k, v = fused_qkv(20, 4, 2, 16)
    with pytest.raises(ValueError, match="q: .*fp32 and bf16"):
        flash_prefill_native(q.half(), k.half(), v.half(), 0.25)
    with pytest.raises(ValueError, match="q: each row's heads must lie side by side"):
        flash_prefill_native(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, 0.25)
    with pytest.raises(ValueError, match="scale"):
        flash_prefill_native(q, k, v, -1.0)


def test_the_engine_sends_a_steps_whole_prompts_in_one_call(monkeypatch):
    """Native backend, several prompts admitted together: one C call per layer takes all of them (counted), and the
    outputs equal the reference backend's."""
    import engine.fast.attention as runner
    from engine_fixtures import mixed_workload, random_model, run_engine

    calls = []
    real = runner.flash_prefill_planned
    monkeypatch.setattr(runner, "flash_prefill_planned",
                        lambda q, k, v, scale, bounds, out: (calls.append(bounds.shape[0]), real(q, k, v, scale,
                                                                                                 bounds, out)))
    model = random_model(seed=5)
    workload = mixed_workload(6, seed=5)
    engine, fast = run_engine(model, workload, attention_backend="native", block_size=4, num_blocks=96)
    assert isinstance(engine, LLMEngine) and calls and max(calls) > 1  # a step's several prompts, one call
    _, ref = run_engine(model, workload, attention_backend="torch", block_size=4, num_blocks=96)
    assert fast == ref


def test_long_bf16_prompts_go_to_torchs_kernel_where_the_cpu_has_bf16_instructions(monkeypatch):
    """C_PREFILL_BF16_MAX_TOKENS: with bf16 hardware, a bf16 prompt that long is torch's flash kernel's (AMX);
    shorter ones, and every prompt without bf16 hardware, are the C kernel's."""
    import engine.fast.attention as attention_module
    from engine.fast import probes
    from engine.runner import AttentionMetadata, PrefillChunk
    from kernels.paged_attention.sdpa import PrefillPlan

    longest = probes.C_PREFILL_BF16_MAX_TOKENS
    rows = [PrefillChunk(0, 10, None, None), PrefillChunk(10, 10 + longest, None, None)]
    meta = AttentionMetadata(None, None, None, None, prefills=rows)
    plans = [PrefillPlan(None, 0, None, None)] * 2
    q = torch.empty(10 + longest, 9, 64, dtype=torch.bfloat16)
    attention = object.__new__(attention_module.PlannedAttention)
    attention.backend, attention.c_prefill_tokens = "native", None  # None: probes.py's rule
    for hardware, expected in ((True, [0]), (False, [0, 1])):
        monkeypatch.setattr(probes, "bf16_instructions", lambda h=hardware: h)
        assert attention._c_prefill_chunks(meta, plans, q, torch.bfloat16, None) == expected
    assert attention._c_prefill_chunks(meta, plans, q.float(), torch.float32, None) == [0, 1]
    assert attention._c_prefill_chunks(meta, plans, q, torch.float32, None) == []  # pools of another dtype
    attention.c_prefill_tokens = 9  # a measured limit (engine/fast/tuning.py) replaces the rule
    assert attention._c_prefill_chunks(meta, plans, q.float(), torch.float32, None) == []
    attention.c_prefill_tokens = 10
    assert attention._c_prefill_chunks(meta, plans, q.float(), torch.float32, None) == [0]
    attention.backend = "sdpa"
    assert attention._c_prefill_chunks(meta, plans, q, torch.bfloat16, None) == []

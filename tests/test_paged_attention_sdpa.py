"""The "sdpa" backend (kernels/paged_attention/sdpa.py): the whole batch in one gather and one fused
attention. Oracle: the reference, on the same NaN-poisoned caches (a read of an unowned slot is NaN),
with windows, GQA, int8 pools, ragged lengths; and the engine's greedy outputs equal the naive loop."""

import pytest
import torch

from engine_fixtures import mixed_workload, naive_outputs, random_model, run_engine
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from kernels.paged_attention.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from kernels.paged_attention.sdpa import plan_prefill, prefill_planned
from test_kv_int8 import int8_cache
from test_paged_attention import GQA, assert_close, make_paged_cache
from test_sliding_window import windowed_cache


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("window", [None, 1, 5, 100])
def test_sdpa_decode_equals_the_reference(num_heads, num_kv_heads, window):
    lengths = [1, 4, 9, 14, 3]
    inputs, _, _ = windowed_cache(lengths, 4, window or 10**6, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=8)
    assert_close(paged_decode_attention(**inputs, backend="sdpa", sliding_window=window),
                 paged_decode_attention_ref(**inputs, sliding_window=window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_decode_keeps_the_storage_dtype(dtype):
    inputs, _, _ = make_paged_cache([3, 17, 8], 8, 4, 2, 16, dtype=dtype)
    out = paged_decode_attention(**inputs, backend="sdpa")
    assert out.dtype == dtype
    assert_close(out, paged_decode_attention_ref(**inputs))


def test_sdpa_decode_reads_int8_pools():
    inputs, scales, _, _ = int8_cache([1, 5, 9, 14], 4, num_heads=4, num_kv_heads=2, head_dim=8)
    torch.testing.assert_close(paged_decode_attention(**inputs, backend="sdpa", scales=scales),
                               paged_decode_attention_ref(**inputs, scales=scales), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start,end", [(0, 13), (8, 13), (12, 13), (3, 9)])
@pytest.mark.parametrize("window", [None, 2, 6])
def test_sdpa_prefill_equals_the_reference(start, end, window):
    inputs, _, _ = make_paged_cache([13], 4, num_heads=4, num_kv_heads=2, head_dim=8)
    q = torch.randn(end - start, 4, 8, generator=torch.Generator().manual_seed(2))
    args = (q, inputs["k_pool"], inputs["v_pool"], inputs["block_tables"][0], torch.arange(start, end),
            inputs["scale"])
    assert_close(paged_prefill_attention(*args, backend="sdpa", sliding_window=window),
                 paged_prefill_attention_ref(*args, sliding_window=window))


def test_sdpa_checks_its_inputs_like_the_reference():
    inputs, _, _ = make_paged_cache([5, 9], 4, 4, 2, 8)
    inputs["block_tables"][1, 0] = 99
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 99 is outside"):
        paged_decode_attention(**inputs, backend="sdpa")


@pytest.mark.parametrize("options", [dict(), dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
                                     dict(num_blocks=24, preemption_mode="swap"), dict(sliding_window=7),
                                     dict(kv_cache_dtype="int8")],
                         ids=["plain", "chunked", "swap", "window", "int8"])
def test_engine_with_sdpa_equals_the_engine_with_the_reference(options):
    model = random_model(seed=4)
    workload = mixed_workload(12, seed=4)
    base = dict(block_size=4, num_blocks=96, **{k: v for k, v in options.items() if k != "num_blocks"})
    if "num_blocks" in options:
        base["num_blocks"] = options["num_blocks"]
    _, fast = run_engine(model, workload, attention_backend="sdpa", **base)
    _, ref = run_engine(model, workload, attention_backend="torch", **base)
    assert fast == ref
    if not options:
        assert list(fast.values()) == naive_outputs(model, workload)


def test_sdpa_prefill_takes_the_causal_shortcut_only_for_positions_in_order():
    """A whole prompt in order runs SDPA's is_causal path; the same positions shuffled must still be masked
    per query (query i at position p sees keys <= p), exactly as the reference does."""
    inputs, _, _ = make_paged_cache([13], 4, num_heads=4, num_kv_heads=2, head_dim=8)
    q = torch.randn(13, 4, 8, generator=torch.Generator().manual_seed(3))
    shuffled = torch.randperm(13, generator=torch.Generator().manual_seed(4))
    for positions in (torch.arange(13), shuffled):
        args = (q, inputs["k_pool"], inputs["v_pool"], inputs["block_tables"][0], positions, inputs["scale"])
        assert_close(paged_prefill_attention(*args, backend="sdpa"), paged_prefill_attention_ref(*args))


def test_a_whole_prompt_reads_its_fresh_keys_and_only_a_whole_prompt_does():
    """prefill_planned(fresh=(k, v)): a whole prompt in order attends to the chunk's own k and v, the values the
    pools hold (so the answer is the gather's); a chunk after cached positions must ignore them and gather."""
    inputs, ks, vs = make_paged_cache([13], 4, num_heads=4, num_kv_heads=2, head_dim=8)
    pools, table, scale = (inputs["k_pool"], inputs["v_pool"]), inputs["block_tables"][0], inputs["scale"]
    q = torch.randn(13, 4, 8, generator=torch.Generator().manual_seed(3))
    plan = plan_prefill(q, *pools, table, torch.arange(13), scale)
    want = paged_prefill_attention_ref(q, *pools, table, torch.arange(13), scale)
    assert_close(prefill_planned(q, *pools, plan, scale, fresh=(ks[0], vs[0])), want)
    nan_pools = (torch.full_like(pools[0], float("nan")), torch.full_like(pools[1], float("nan")))
    assert_close(prefill_planned(q, *nan_pools, plan, scale, fresh=(ks[0], vs[0])), want)  # no gather at all
    wrong = (torch.zeros_like(ks[0]), torch.zeros_like(vs[0]))  # if a later chunk used them, it would show
    tail = plan_prefill(q[8:], *pools, table, torch.arange(8, 13), scale)
    assert_close(prefill_planned(q[8:], *pools, tail, scale, fresh=(wrong[0][8:], wrong[1][8:])), want[8:])


def test_one_decode_plan_serves_every_layer():
    """The plan depends only on the tables and lengths: built once, it gives each layer's pools the reference's
    answer (the engine builds it at layer 0 and reuses it in all L layers)."""
    from kernels.paged_attention.sdpa import decode_planned, plan_decode

    inputs, _, _ = make_paged_cache([3, 17, 8, 1], 4, 4, 2, 8)
    plan = plan_decode(inputs["block_tables"], inputs["seq_lens"], 4, inputs["k_pool"].shape[0])
    g = torch.Generator().manual_seed(5)
    for layer in range(3):  # layer 0 reads the cache as built; layers 1, 2 other pools under the same tables
        if layer:
            inputs = {**inputs, "q": torch.randn(inputs["q"].shape, generator=g),
                      "k_pool": torch.randn(inputs["k_pool"].shape, generator=g),
                      "v_pool": torch.randn(inputs["v_pool"].shape, generator=g)}
        got = decode_planned(inputs["q"], inputs["k_pool"], inputs["v_pool"], plan, inputs["scale"])
        assert_close(got, paged_decode_attention_ref(**inputs))


def test_a_decode_plan_checks_the_tables_once():
    from kernels.paged_attention.sdpa import plan_decode

    inputs, _, _ = make_paged_cache([5, 9], 4, 4, 2, 8)
    inputs["block_tables"][0, 1] = -3
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = -3 is outside"):
        plan_decode(inputs["block_tables"], inputs["seq_lens"], 4, inputs["k_pool"].shape[0])


def test_planned_write_equals_the_reference_write():
    from kernels.paged_attention.reference import write_kv_ref
    from kernels.paged_attention.sdpa import check_slots, write_kv_planned

    g = torch.Generator().manual_seed(7)
    pools = [torch.randn(6, 4, 2, 8, generator=g) for _ in range(2)]
    ref = [p.clone() for p in pools]
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([0, 7, 23, 4, 12])
    check_slots(slots, *pools)
    write_kv_planned(k, v, *pools, slots)
    write_kv_ref(k, v, *ref, slots)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 24 is outside 0..23"):
        check_slots(torch.tensor([0, 24]), *pools)


def test_the_engine_plans_attention_once_per_step_not_per_layer(monkeypatch):
    import engine.fast.attention as runner

    calls = []
    real = runner.plan_decode
    monkeypatch.setattr(runner, "plan_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = random_model(seed=8)  # 2 layers
    workload = mixed_workload(4, seed=8)
    engine, outputs = run_engine(model, workload, attention_backend="sdpa")
    decode_steps = sum(1 for r in engine.trace.steps if any(s.phase == "decode" for s in r.scheduled))
    assert len(calls) == decode_steps > 0
    assert list(outputs.values()) == naive_outputs(model, workload)

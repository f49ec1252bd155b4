"""Issue 18: the paged engine runs sliding-window models (Mistral) and frees the blocks outside the window.

Oracles: dense attention over the last W keys (for the kernels, on caches whose out-of-window blocks are
poisoned with NaN and whose table entries are NULL_BLOCK), and the naive no-cache loop with the same window
mask (for the engine, under every policy, preemption mode, chunked prefill and prefix caching).
"""

import math
import tempfile
from pathlib import Path

import pytest
import torch

from engine import LLM, load_model
from engine.companions.naive import generate_naive
from engine.kv.block_manager import BlockManager
from engine.llm_engine import LLMEngine, engine_config
from engine.model import causal_mask
from engine.sampling import SamplingParams
from engine_fixtures import random_model
from hf_oracle import save_tiny_hf_model
from kernels.paged_attention import NULL_BLOCK, paged_decode_attention
from kernels.paged_attention.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from test_paged_attention import DEVICE, assert_close, dense_attention, make_paged_cache

# ---- kernels: only the last W positions are read ---------------------------------------------------


def windowed_cache(seq_lens, block_size, window, **shape):
    """A paged cache whose blocks wholly before each sequence's window are NaN and NULL in its table."""
    inputs, ks, vs = make_paged_cache(seq_lens, block_size, **shape)
    for b, n in enumerate(seq_lens):
        for j in range(max(0, n - window) // block_size):  # blocks before the first visible position
            block = int(inputs["block_tables"][b, j])
            inputs["k_pool"][block] = float("nan")
            inputs["v_pool"][block] = float("nan")
            inputs["block_tables"][b, j] = NULL_BLOCK
    return inputs, ks, vs


def windowed_dense(q, k, v, scale, window):
    """The last query of a sequence against its last `window` keys, by dense attention."""
    return dense_attention(q, k[-window:], v[-window:], scale)


@pytest.mark.parametrize("window", [1, 3, 4, 9, 100])
@pytest.mark.parametrize("block_size", [1, 4])
def test_reference_decode_with_a_window_reads_only_the_last_w_positions(window, block_size):
    lengths = [1, 5, 9, 14]
    inputs, ks, vs = windowed_cache(lengths, block_size, window, num_heads=4, num_kv_heads=2, head_dim=8)
    out = paged_decode_attention_ref(**inputs, sliding_window=window)
    for b in range(len(lengths)):
        assert_close(out[b], windowed_dense(inputs["q"][b:b + 1], ks[b], vs[b], inputs["scale"], window)[0])


def test_a_window_changes_the_result_once_the_sequence_is_longer_than_it():
    inputs, _, _ = make_paged_cache([14], 4, num_heads=4, num_kv_heads=2, head_dim=8)
    full = paged_decode_attention_ref(**inputs)
    assert torch.equal(paged_decode_attention_ref(**inputs, sliding_window=14), full)
    assert not torch.allclose(paged_decode_attention_ref(**inputs, sliding_window=5), full)


@pytest.mark.parametrize("start,end", [(0, 13), (6, 13), (12, 13), (3, 9)])
@pytest.mark.parametrize("window", [2, 5, 8])
def test_reference_prefill_with_a_window_equals_the_models_window_mask(start, end, window):
    length, block_size = 13, 4
    inputs, ks, vs = make_paged_cache([length], block_size, num_heads=4, num_kv_heads=2, head_dim=8)
    first_block = max(0, start + 1 - window) // block_size  # blocks before it: not read by any query
    table = inputs["block_tables"][0].clone()
    for j in range(first_block):
        inputs["k_pool"][int(table[j])] = float("nan")
        table[j] = NULL_BLOCK
    q_all = torch.randn(length, 4, 8, generator=torch.Generator().manual_seed(1))
    mask = causal_mask(length, length, window, "cpu")  # [T, T], the mask the model itself uses
    group = 2
    k = ks[0].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = vs[0].repeat_interleave(group, dim=1).transpose(0, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1), k, v, attn_mask=mask, scale=inputs["scale"]).transpose(0, 1)[start:end]
    out = paged_prefill_attention_ref(q_all[start:end], inputs["k_pool"], inputs["v_pool"], table,
                                      torch.arange(start, end), inputs["scale"], sliding_window=window)
    assert_close(out, expected)


def test_a_null_entry_inside_the_window_is_a_clear_error():
    inputs, _, _ = make_paged_cache([9], 4, num_heads=2, num_kv_heads=1, head_dim=8)
    inputs["block_tables"][0, 1] = NULL_BLOCK  # positions 4..7, inside a window of 6 (3..8)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = -1 is outside"):
        paged_decode_attention_ref(**inputs, sliding_window=6)


@pytest.mark.parametrize("window", [0, -2, 2.5, True])
def test_a_bad_window_names_the_field(window):
    inputs, _, _ = make_paged_cache([3], 4, num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention_ref(**inputs, sliding_window=window)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton runs compiled (tested below)")
@pytest.mark.parametrize("window", [1, 6, 100])
def test_triton_decode_with_a_window_matches_the_reference(window):
    inputs, _, _ = windowed_cache([1, 5, 9, 14], 4, window, num_heads=4, num_kv_heads=2, head_dim=8)
    assert_close(paged_decode_attention(**inputs, backend="triton", sliding_window=window),
                 paged_decode_attention_ref(**inputs, sliding_window=window))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("window", [1, 6, 37])
def test_gpu_decode_with_a_window_matches_the_reference(backend, window):
    inputs, _, _ = windowed_cache([1, 17, 40, 64], 16, window, num_heads=8, num_kv_heads=2, head_dim=64,
                                  device=DEVICE)
    assert_close(paged_decode_attention(**inputs, backend=backend, sliding_window=window),
                 paged_decode_attention_ref(**inputs, sliding_window=window))


# ---- the block manager frees what no query can read again -------------------------------------------


def test_free_out_of_window_frees_exactly_the_blocks_before_the_next_querys_window():
    bm = BlockManager(num_blocks=12, block_size=4, sliding_window=6)
    bm.allocate(0, 14)  # blocks for positions 0..13
    table = bm.block_table(0)
    # the next query is at 14 and reads 9..14: blocks 0 (0..3) and 1 (4..7) are dead, block 2 (8..11) is not
    freed = bm.free_out_of_window(0, next_query_position=14)
    assert freed == table[:2]
    assert bm.block_table(0) == [NULL_BLOCK, NULL_BLOCK, *table[2:]]
    assert bm.num_held_blocks(0) == 2 and bm.allocator.num_free == 10
    assert bm.free_out_of_window(0, 14) == []  # nothing twice
    assert bm.free_out_of_window(0, 17) == [table[2]]  # 17 reads 12..17
    with pytest.raises(ValueError, match="fell out of the sliding window"):
        bm.slot_mapping(0, [3])
    bm.free(0)
    assert bm.allocator.num_free == 12


def test_without_a_window_nothing_is_freed():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, 30)
    assert bm.free_out_of_window(0, 30) == [] and bm.num_held_blocks(0) == 8


def test_swap_fork_and_usage_keep_the_freed_entries_in_place():
    bm = BlockManager(num_blocks=10, block_size=4, num_swap_blocks=10, sliding_window=5)
    bm.allocate(0, 15)
    bm.free_out_of_window(0, 15)  # reads 11..15: blocks 0, 1 dead (0..7); block 2 (8..11) still needed
    assert bm.block_table(0)[:2] == [NULL_BLOCK, NULL_BLOCK]
    bm.fork(0, 1)
    assert bm.usage().used_blocks == 2 and bm.usage().used_slots == 7  # shared blocks counted once
    pairs = bm.swap_out(1)
    assert len(pairs) == 2 and bm.swap_table(1)[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert bm.usage().used_blocks == 2  # sequence 0 still holds them
    assert bm.can_swap_in(1, 1)
    back = bm.swap_in(1)
    assert len(back) == 2 and bm.block_table(1)[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert bm.num_held_blocks(1) == 2
    bm.free(0)
    bm.free(1)
    assert bm.allocator.num_free == 10 and bm.swap_allocator.num_free == 10


# ---- the engine: outputs equal the naive loop with the same window; blocks are freed -------------------


@pytest.fixture(scope="module")
def mistral():
    """A transformers-made Mistral checkpoint (sliding_window = 8), loaded by our loader."""
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_hf_model("mistral", Path(folder))
        with pytest.warns(UserWarning, match="no tokenizer.json"):  # token ids only
            model, _ = load_model(folder)
    assert model.config.sliding_window == 8
    return model


def prompts_longer_than_the_window(vocab, lengths=(5, 13, 30, 41), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=20)


def test_a_mistral_checkpoint_runs_in_llm_generate_equal_to_the_naive_loop(mistral):
    prompts = prompts_longer_than_the_window(mistral.config.vocab_size)
    llm = LLM(mistral, None, block_size=4, num_blocks=64)
    outs = llm.generate(prompts, GREEDY)
    expected = [generate_naive(mistral, None, p, GREEDY).token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    freed = [e for r in llm.engine.trace for e in r.events if e["type"] == "window_freed"]
    assert freed and llm.engine.block_manager.usage().used_blocks == 0


def test_the_window_matters_for_these_prompts(mistral):
    """Guard for the test above: without the window the same model gives other tokens, so the equality
    there checks the window and not merely attention."""
    prompts = prompts_longer_than_the_window(mistral.config.vocab_size)
    windowed = [generate_naive(mistral, None, p, GREEDY).token_ids for p in prompts]
    mistral.config.sliding_window = None
    try:
        full = [generate_naive(mistral, None, p, GREEDY).token_ids for p in prompts]
    finally:
        mistral.config.sliding_window = 8
    assert windowed != full


POLICIES = [dict(), dict(policy="static"), dict(num_blocks=16), dict(num_blocks=16, preemption_mode="swap"),
            dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_prefill_chunk_tokens=4),
            dict(enable_prefix_caching=True),
            dict(enable_prefix_caching=True, num_blocks=16, preemption_mode="swap", enable_chunked_prefill=True,
                 max_num_batched_tokens=8)]


@pytest.mark.parametrize("options", POLICIES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_window_outputs_equal_the_naive_loop_under_every_policy(mistral, options, speed):
    prompts = prompts_longer_than_the_window(mistral.config.vocab_size)
    prompts += prompts[2:]  # repeats: prefix hits, and enough load to preempt in a 16-block pool
    engine = LLMEngine(mistral, None, engine_config("mistral", speed=speed,
                                                    **{"block_size": 4, "num_blocks": 64, **options}))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    expected = [generate_naive(mistral, None, p, GREEDY).token_ids for p in prompts]
    assert [engine.get_request(i).output_token_ids for i in ids] == expected
    assert engine.block_manager.usage().used_blocks == 0


def test_a_long_sequence_holds_about_window_over_block_size_plus_one_blocks():
    window, block_size = 12, 4
    model = random_model(seed=3, context=200)
    engine = LLMEngine(model, None, engine_config("random", block_size=block_size, num_blocks=64,
                                                  sliding_window=window))
    rid = engine.add_request(list(range(2, 30)), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    seq = engine.get_request(rid).seq_id
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        if seq in engine.block_manager:
            held.append(engine.block_manager.num_held_blocks(seq))
    assert held[0] == math.ceil(28 / block_size)  # the whole prompt right after its prefill
    assert max(held[20:]) <= math.ceil(window / block_size) + 1  # then a constant few blocks
    unwindowed = LLMEngine(model, None, engine_config("random", block_size=block_size, num_blocks=64))
    unwindowed.add_request(list(range(2, 30)), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    peak = 0
    while unwindowed.has_unfinished_requests():
        unwindowed.step()
        peak = max(peak, unwindowed.block_manager.usage().used_blocks)
    # all of them without the window (seen after each step: the last step frees them as the request finishes)
    assert peak == math.ceil((28 + 148) / block_size)


def test_the_window_option_on_a_model_without_one_equals_the_naive_loop_with_that_window():
    model = random_model(seed=5)
    prompts = [list(range(2, 2 + n)) for n in (9, 25, 40)]
    params = SamplingParams(temperature=0, max_tokens=16)
    engine = LLMEngine(model, None, engine_config("random", block_size=4, num_blocks=64, sliding_window=7))
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    model.config.sliding_window = 7  # the oracle: the no-cache loop with the same mask
    try:
        expected = [generate_naive(model, None, p, params).token_ids for p in prompts]
    finally:
        model.config.sliding_window = None
    assert [engine.get_request(i).output_token_ids for i in ids] == expected

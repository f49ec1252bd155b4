"""Chapter 04: paged attention. Every backend against the PyTorch reference, and the reference
against dense attention computed on contiguous K/V (an oracle that knows nothing of blocks).

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1), so the shapes here are small. Every pool slot that no sequence owns is
NaN: a kernel that reads past a sequence's length, or follows a padding entry, returns NaN.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import NULL_BLOCK, paged_decode_attention, resolve_backend, split_k, write_kv
from kernels.paged_attention import triton as triton_backend
from kernels.paged_attention.cuda import (
    nvcc_resource_report,
    paged_decode_attention_cuda,
    registers_per_kernel,
)
from kernels.paged_attention.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    quantize_kv_int8,
    write_kv_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs compiled on a GPU, interpreted on CPU
TOLERANCE = {  # accumulation is fp32 everywhere; the storage type sets the error
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_close(actual, expected):
    assert not actual.isnan().any(), "NaN in the output: a poisoned (unowned) slot was read"
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])


def make_paged_cache(seq_lens, block_size, num_heads, num_kv_heads, head_dim,
                     dtype=torch.float32, device="cpu", seed=0):
    """Random K/V per sequence, written token by token into shuffled physical blocks.

    Returns the decode inputs plus the contiguous K/V lists [L, Hkv, D] the dense oracle uses.
    One spare block stays NaN, and every table pads its unused columns with it.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    physical = torch.randperm(num_blocks, generator=g).tolist()
    spare = physical.pop()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool, v_pool = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), spare, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(seq_lens):
        mine, physical = physical[: blocks_per_seq[b]], physical[blocks_per_seq[b]:]
        tables[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g)
        for pos in range(n):
            k_pool[mine[pos // block_size], pos % block_size] = k[pos]
            v_pool[mine[pos // block_size], pos % block_size] = v[pos]
        ks.append(k.to(dtype))
        vs.append(v.to(dtype))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    to = dict(dtype=dtype, device=device)
    inputs = dict(q=q.to(**to), k_pool=k_pool.to(**to), v_pool=v_pool.to(**to),
                  block_tables=tables.to(device),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                  scale=1.0 / math.sqrt(head_dim))
    return inputs, ks, vs


def dense_attention(q, k, v, scale, causal=False):
    """q [Tq, H, D], k/v [L, Hkv, D] contiguous -> [Tq, H, D], by torch's SDPA in fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [H, L, D]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, scale=scale, is_causal=causal)
    return out.transpose(0, 1)  # [Tq, H, D]


GQA = [(4, 4), (4, 2), (8, 2), (4, 1)]  # (H, Hkv): multi-head, groups of 2 and 4, multi-query


def lengths_for(block_size):
    """Ragged: a single token, exactly one and two full blocks, and a partial last block."""
    return [1, block_size, 2 * block_size, 2 * block_size + 3]


# ---- the reference against an oracle that knows nothing of blocks -----------------------------


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_reference_decode_equals_dense_attention_on_contiguous_kv(block_size, num_heads, num_kv_heads):
    inputs, ks, vs = make_paged_cache(lengths_for(block_size), block_size, num_heads, num_kv_heads, 16)
    out = paged_decode_attention_ref(**inputs)
    for b in range(out.shape[0]):
        expected = dense_attention(inputs["q"][b : b + 1], ks[b], vs[b], inputs["scale"])[0]
        assert_close(out[b], expected)


@pytest.mark.parametrize("start,end", [(0, 13), (8, 13), (12, 13), (3, 9)])
def test_reference_prefill_equals_dense_causal_attention(start, end):
    length, block_size = 13, 4
    inputs, ks, vs = make_paged_cache([length], block_size, num_heads=4, num_kv_heads=2, head_dim=16)
    q_all = torch.randn(length, 4, 16, generator=torch.Generator().manual_seed(1))
    expected = dense_attention(q_all, ks[0], vs[0], inputs["scale"], causal=True)[start:end]
    out = paged_prefill_attention_ref(q_all[start:end], inputs["k_pool"], inputs["v_pool"],
                                      inputs["block_tables"][0], torch.arange(start, end), inputs["scale"])
    assert_close(out, expected)


def test_prefill_of_the_last_token_equals_decode():
    inputs, _, _ = make_paged_cache([11], 4, num_heads=4, num_kv_heads=1, head_dim=8)
    decode = paged_decode_attention_ref(**inputs)
    prefill = paged_prefill_attention_ref(inputs["q"], inputs["k_pool"], inputs["v_pool"],
                                          inputs["block_tables"][0], torch.tensor([10]), inputs["scale"])
    assert_close(prefill, decode)


def test_write_kv_ref_puts_each_token_in_its_slot_and_nothing_else():
    k_pool, v_pool = torch.zeros(3, 4, 2, 5), torch.zeros(3, 4, 2, 5)
    k, v = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    write_kv_ref(k, v, k_pool, v_pool, torch.tensor([9, 0, 6]))  # (block 2, slot 1), (0, 0), (1, 2)
    for pool, new in ((k_pool, k), (v_pool, v)):
        assert torch.equal(pool[2, 1], new[0]) and torch.equal(pool[0, 0], new[1])
        assert torch.equal(pool[1, 2], new[2])
    assert int((k_pool != 0).any(dim=(2, 3)).sum()) == 3


# ---- Triton against the reference -------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_triton_decode_matches_reference_across_block_sizes(block_size):
    inputs, _, _ = make_paged_cache(lengths_for(block_size), block_size, 4, 2, 16, device=DEVICE)
    assert_close(triton_backend.paged_decode_attention_triton(**inputs), paged_decode_attention_ref(**inputs))


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_triton_decode_matches_reference_across_gqa_ratios(num_heads, num_kv_heads):
    inputs, _, _ = make_paged_cache([1, 8, 13], 8, num_heads, num_kv_heads, 16, device=DEVICE, seed=2)
    assert_close(triton_backend.paged_decode_attention_triton(**inputs), paged_decode_attention_ref(**inputs))


def test_triton_decode_handles_shapes_that_are_not_powers_of_two():
    inputs, _, _ = make_paged_cache([1, 3, 7], 3, num_heads=6, num_kv_heads=2, head_dim=24, device=DEVICE)
    assert_close(triton_backend.paged_decode_attention_triton(**inputs), paged_decode_attention_ref(**inputs))


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(1, 1, 8), (8, 3, 12)])
def test_triton_write_kv_matches_reference(block_size, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(3)
    num_blocks, num_tokens = 6, 5
    pools = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE)
    k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    expected_k, expected_v = pools[0].clone(), pools[1].clone()
    write_kv_ref(k, v, expected_k, expected_v, slots)
    got_k, got_v = pools[0].clone(), pools[1].clone()
    triton_backend.write_kv_triton(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


@pytest.mark.parametrize("num_partitions", [1, 2, 3])  # 3: one block each, two past sequence 1's end
def test_padding_entries_past_the_last_block_are_never_read(num_partitions):
    inputs, _, _ = make_paged_cache([5, 2], 4, 4, 2, 8, device=DEVICE)
    inputs["block_tables"][1, 1:] = -1  # sequence 1 needs one block; the rest is padding
    expected = paged_decode_attention_ref(**inputs)
    assert_close(triton_backend.paged_decode_attention_triton(**inputs, num_partitions=num_partitions),
                 expected)


# ---- split-K (flash-decoding): partitions, then the combine, against the reference -------------

SPLIT_LENGTHS = [1, 4, 5, 14]  # BS = 4: one token, exactly a block, one past a block, 3.5 blocks


def triton_split(inputs, num_partitions, **kwargs):
    return triton_backend.paged_decode_attention_triton(**inputs, num_partitions=num_partitions, **kwargs)


def poison_before_window(inputs, window):
    """NaN in every block wholly before a sequence's window, and NULL_BLOCK in its table entry: a
    kernel that reads one returns NaN (or fails the bounds check)."""
    block_size = inputs["k_pool"].shape[1]
    for b, n in enumerate(inputs["seq_lens"].tolist()):
        for j in range(max(0, n - window) // block_size):
            block = int(inputs["block_tables"][b, j])
            inputs["k_pool"][block] = float("nan")
            inputs["v_pool"][block] = float("nan")
            inputs["block_tables"][b, j] = NULL_BLOCK
    return inputs


def int8_pools(inputs):
    """The cache quantized per token and head (reference.quantize_kv_int8); slots no sequence owns
    get a NaN scale, so reading one still poisons the output."""
    num_blocks, block_size, num_kv_heads, head_dim = inputs["k_pool"].shape
    pools, scales = {}, []
    for name in ("k_pool", "v_pool"):
        pool = inputs[name]
        values, scale = quantize_kv_int8(pool.nan_to_num(0.0).reshape(-1, num_kv_heads, head_dim))
        scale = scale.reshape(num_blocks, block_size, num_kv_heads)
        scale[pool.isnan().any(dim=-1)] = float("nan")
        pools[name] = values.reshape(pool.shape)
        scales.append(scale)
    return dict(inputs, **pools), tuple(scales)


@pytest.mark.parametrize("num_partitions", [1, 2, 3, 7])
def test_split_k_triton_decode_matches_reference_for_any_partition_count(num_partitions):
    inputs, _, _ = make_paged_cache(SPLIT_LENGTHS, 4, 8, 2, 16, device=DEVICE)
    if num_partitions == 7:  # more partitions than the table has blocks: some read nothing at all
        assert inputs["block_tables"].shape[1] < num_partitions
    assert_close(triton_split(inputs, num_partitions), paged_decode_attention_ref(**inputs))


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_split_k_triton_decode_matches_reference_across_gqa_ratios(num_heads, num_kv_heads):
    inputs, _, _ = make_paged_cache(SPLIT_LENGTHS, 4, num_heads, num_kv_heads, 16, device=DEVICE, seed=4)
    assert_close(triton_split(inputs, 3), paged_decode_attention_ref(**inputs))


def test_split_k_triton_decode_handles_shapes_that_are_not_powers_of_two():
    inputs, _, _ = make_paged_cache([1, 3, 4, 10], 3, num_heads=6, num_kv_heads=2, head_dim=24,
                                    device=DEVICE)
    assert_close(triton_split(inputs, 3), paged_decode_attention_ref(**inputs))


@pytest.mark.parametrize("window,num_partitions", [(1, 2), (6, 2), (6, 5), (100, 3)])
def test_split_k_triton_with_a_window_reads_only_the_window_and_empty_partitions_add_nothing(
        window, num_partitions):
    inputs, _, _ = make_paged_cache(SPLIT_LENGTHS, 4, 4, 2, 8, device=DEVICE, seed=5)
    poison_before_window(inputs, window)
    # in every case some partition of the longest sequence starts past its last block
    span = split_k.blocks_read(inputs["block_tables"].shape[1], 4, window)
    per_partition = math.ceil(span / num_partitions)
    first_block = max(0, SPLIT_LENGTHS[-1] - window) // 4
    assert first_block + (num_partitions - 1) * per_partition >= math.ceil(SPLIT_LENGTHS[-1] / 4)
    assert_close(triton_split(inputs, num_partitions, sliding_window=window),
                 paged_decode_attention_ref(**inputs, sliding_window=window))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_partitions", [2, 3])
def test_split_k_triton_int8_decode_matches_reference(num_partitions, window):
    floats, _, _ = make_paged_cache(SPLIT_LENGTHS, 4, 4, 2, 16, device=DEVICE, seed=6)
    inputs, scales = int8_pools(floats)
    assert_close(triton_split(inputs, num_partitions, sliding_window=window, scales=scales),
                 paged_decode_attention_ref(**inputs, sliding_window=window, scales=scales))


def test_triton_decode_chooses_split_k_for_a_long_context_and_still_matches_the_reference():
    inputs, _, _ = make_paged_cache([600, 17], 16, num_heads=2, num_kv_heads=1, head_dim=8, device=DEVICE)
    max_blocks = inputs["block_tables"].shape[1]  # 38 blocks of 16 + the spare column
    assert split_k.choose_num_partitions(2, 1, max_blocks, 16) == 2
    assert_close(triton_backend.paged_decode_attention_triton(**inputs), paged_decode_attention_ref(**inputs))


# ---- how many partitions: the chooser's claims ------------------------------------------------


def test_chooser_splits_a_long_context_at_a_small_batch():
    # B = 4 sequences of 8192 tokens, Hkv = 8: 32 programs for 132 SMs without splitting
    parts = split_k.choose_num_partitions(4, 8, 8192 // 16, 16)
    assert parts == 32  # 1024 programs; 32 partitions of 16 blocks = 256 tokens, the shortest allowed
    assert 8192 // parts == split_k.MIN_PARTITION_TOKENS


def test_chooser_keeps_one_pass_for_big_batches_and_for_short_contexts():
    assert split_k.choose_num_partitions(256, 8, 512 // 16, 16) == 1  # 2048 programs already
    assert split_k.choose_num_partitions(2, 8, 256 // 16, 16) == 1  # one partition's worth of tokens
    assert split_k.choose_num_partitions(1, 1, 1, 1) == 1


def test_chooser_splits_the_docstring_example_into_five():
    # B = 32, context 2048, Hkv = 8 (triton.py's docstring): 256 programs -> 1280 with P = 5
    assert split_k.choose_num_partitions(32, 8, 2048 // 16, 16) == 5
    assert split_k.partition_plan(None, 32, 8, 2048 // 16, 16, None, torch.device("cpu")) == (5, 26)


@pytest.mark.parametrize("batch,heads", [(1, 1), (3, 8), (32, 32), (200, 8)])
@pytest.mark.parametrize("max_blocks,block_size", [(1, 16), (31, 16), (77, 16), (300, 4), (4096, 1)])
def test_chooser_partitions_hold_whole_blocks_and_none_is_empty(batch, heads, max_blocks, block_size):
    parts = split_k.choose_num_partitions(batch, heads, max_blocks, block_size)
    per_partition = math.ceil(max_blocks / parts)
    assert (parts - 1) * per_partition < max_blocks  # the last partition has a block to read
    if parts > 1:
        assert per_partition * block_size >= split_k.MIN_PARTITION_TOKENS
        # only as far as needed: one partition fewer would not fill the GPU yet
        assert (parts - 1) * batch * heads < split_k.DEFAULT_NUM_SMS * split_k.PROGRAMS_PER_SM


def test_a_sliding_window_splits_only_the_blocks_it_reads():
    cpu = torch.device("cpu")
    assert split_k.partition_plan(None, 1, 8, 128, 16, None, cpu) == (8, 16)  # 2048 tokens
    assert split_k.partition_plan(None, 1, 8, 128, 16, 512, cpu) == (2, 17)  # 512 tokens: 33 blocks


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("window", [1, 2, 5, 16, 17, 40])
def test_blocks_read_is_the_most_blocks_a_window_can_touch(window, block_size):
    touched = [(start + window - 1) // block_size - start // block_size + 1 for start in range(64)]
    assert split_k.blocks_read(1000, block_size, window) == max(touched)
    assert split_k.blocks_read(2, block_size, window) == min(2, max(touched))  # never past the table


@pytest.mark.parametrize("launcher", [triton_backend.paged_decode_attention_triton,
                                      paged_decode_attention_cuda], ids=["triton", "cuda"])
@pytest.mark.parametrize("bad", [0, -2, 2.5, True, split_k.MAX_PARTITIONS + 1])
def test_bad_num_partitions_is_a_value_error_naming_the_field(launcher, bad):
    inputs, _, _ = make_paged_cache([5], 4, 4, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"num_partitions: must be an integer in 1\.\.65535.*got "
                                         + re.escape(repr(bad))):
        launcher(**inputs, num_partitions=bad)


def test_split_k_scratch_traffic_matches_the_worked_example_in_the_docstring():
    mib = 2**20
    fused = triton_backend.decode_traffic_bytes(32, 2048, 32, 8, 128, elem_bytes=2)["fused"]
    scratch = split_k.scratch_traffic_bytes(32, 32, 128, num_partitions=5)
    # By hand: 32 sequences x 32 heads x 5 partitions x (128 + 2) fp32 values, written and read back
    assert scratch == 2 * 32 * 32 * 5 * 130 * 4
    assert round(scratch / mib, 1) == 5.1 and round(100 * scratch / fused) == 2
    assert split_k.scratch_traffic_bytes(32, 32, 128, num_partitions=1) == 0


# ---- bad input is a ValueError naming the field, before any kernel runs -----------------------

DECODERS = {"torch": paged_decode_attention_ref, "triton": triton_backend.paged_decode_attention_triton}


def _break(inputs, how):
    nb = inputs["k_pool"].shape[0]
    if how == "entry >= NB":
        inputs["block_tables"][0, 0] = nb
    elif how == "negative entry":
        inputs["block_tables"][1, 1] = -3
    elif how == "seq_len > capacity":
        inputs["seq_lens"][0] = inputs["block_tables"].shape[1] * inputs["k_pool"].shape[1] + 1
    elif how == "seq_len 0":
        inputs["seq_lens"][1] = 0
    elif how == "int64 table":
        inputs["block_tables"] = inputs["block_tables"].long()
    elif how == "float64 q":
        inputs["q"] = inputs["q"].double()
    elif how == "v_pool dtype":
        inputs["v_pool"] = inputs["v_pool"].half()
    elif how == "H not a multiple of Hkv":
        inputs["q"] = inputs["q"][:, :3]


BAD_INPUTS = {  # what we break -> the field the message must name
    "entry >= NB": r"block_tables\[0, 0\] = 8 is outside 0\.\.7",
    "negative entry": r"block_tables\[1, 1\] = -3",
    "seq_len > capacity": r"seq_lens\[0\] = 13 is outside 1\.\.12",
    "seq_len 0": r"seq_lens\[1\] = 0",
    "int64 table": r"block_tables: dtype torch.int64",
    "float64 q": r"q: torch.float64",
    "v_pool dtype": r"v_pool: torch.float16",
    "H not a multiple of Hkv": r"q: H = 3 query heads must be a multiple of Hkv = 2",
}


@pytest.mark.parametrize("backend", sorted(DECODERS))
@pytest.mark.parametrize("how", sorted(BAD_INPUTS))
def test_bad_decode_input_raises_value_error_naming_the_field(backend, how):
    pool = torch.zeros(8, 4, 2, 8, device=DEVICE)  # NB = 8 blocks of BS = 4, Hkv = 2, D = 8
    inputs = dict(q=torch.zeros(2, 4, 8, device=DEVICE), k_pool=pool, v_pool=pool.clone(),
                  block_tables=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=DEVICE),  # capacity 12
                  seq_lens=torch.tensor([4, 7], dtype=torch.int32, device=DEVICE), scale=0.5)
    DECODERS[backend](**inputs)  # the clean version runs
    _break(inputs, how)
    with pytest.raises(ValueError, match=BAD_INPUTS[how]):
        DECODERS[backend](**inputs)


@pytest.mark.parametrize("writer", [write_kv_ref, triton_backend.write_kv_triton])
def test_bad_slot_mapping_raises_value_error(writer):
    k_pool, v_pool = torch.zeros(2, 4, 1, 8, device=DEVICE), torch.zeros(2, 4, 1, 8, device=DEVICE)
    k = v = torch.ones(2, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 8 is outside 0\.\.7"):
        writer(k, v, k_pool, v_pool, torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping: dtype torch.int32"):
        writer(k, v, k_pool, v_pool, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    assert not k_pool.any() and not v_pool.any()  # nothing written


def test_prefill_position_past_the_table_raises_value_error():
    inputs, _, _ = make_paged_cache([5], 4, 4, 2, 8)  # table of 3 columns: capacity 12
    with pytest.raises(ValueError, match=r"q_positions: max position 12 is outside 0\.\.11"):
        paged_prefill_attention_ref(inputs["q"], inputs["k_pool"], inputs["v_pool"],
                                    inputs["block_tables"][0], torch.tensor([12]), inputs["scale"])


# ---- choosing a backend -----------------------------------------------------------------------


def test_cuda_backend_on_cpu_tensors_falls_back_to_torch_with_a_warning():
    inputs, _, _ = make_paged_cache([3, 5], 4, 4, 2, 8)
    with pytest.warns(RuntimeWarning, match="backend 'cuda' cannot run here"):
        out = paged_decode_attention(**inputs, backend="cuda")
    assert torch.equal(out, paged_decode_attention_ref(**inputs))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton runs compiled, not interpreted")
def test_triton_backend_runs_on_cpu_under_the_interpreter():
    inputs, _, _ = make_paged_cache([3, 5], 4, 4, 2, 8)
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    assert_close(paged_decode_attention(**inputs, backend="triton"), paged_decode_attention_ref(**inputs))
    k_pool, v_pool = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k_pool, v_pool, torch.tensor([5]), backend="triton")
    assert k_pool[1, 1].eq(1).all() and k_pool.sum() == 8


def test_unknown_backend_is_a_value_error():
    inputs, _, _ = make_paged_cache([3], 4, 4, 2, 8)
    with pytest.raises(ValueError, match="backend: 'flash' is not one of"):
        paged_decode_attention(**inputs, backend="flash")


def test_decode_traffic_matches_the_worked_example_in_the_docstring():
    mib = 2**20
    traffic = triton_backend.decode_traffic_bytes(32, 2048, 32, 8, 128, elem_bytes=2)
    # By hand: cached K+V = 2 * 8 heads * (32 * 2048 * 128 * 2 B = 16 MiB) = 256 MiB;
    # naive = 3 * 256 + 2 * 1024 (expanded to 32 heads) + 4 * 8 (fp32 scores) = 2848 MiB;
    # q and out: 2 * 32 * 32 * 128 * 2 B = 0.5 MiB on both sides.
    assert traffic == {"naive": 2848.5 * mib, "fused": 256.5 * mib}


# ---- CUDA: compiled wherever nvcc exists, run wherever a GPU exists ---------------------------


@pytest.mark.nvcc
def test_cuda_kernel_compiles_without_spills_and_reports_registers():
    report = nvcc_resource_report(arch="sm_90")
    counts = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert len(counts) == 9, report  # one-pass, partition and reduce kernels x float, half, bfloat16
    assert all(1 <= n <= 255 for n in counts), report  # 255: the most a thread can address
    assert "0 bytes spill stores" in report and not re.search(r"[1-9]\d* bytes spill", report), report
    kernels = registers_per_kernel(report)
    assert sorted(kernels.values()) == sorted(counts)
    for kernel in ("paged_decode_kernel<", "paged_decode_partition_kernel<", "paged_decode_reduce_kernel<"):
        names = [name for name in kernels if kernel in name]
        assert len(names) == 3 and any("__half" in n for n in names) and any("bfloat16" in n for n in names), \
            report


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim",
                         [(16, 8, 2, 128), (1, 4, 4, 64), (32, 4, 1, 96)])
def test_cuda_decode_matches_reference_on_gpu(dtype, block_size, num_heads, num_kv_heads, head_dim):
    from kernels.paged_attention.cuda import paged_decode_attention_cuda

    lengths = [1, block_size, 2 * block_size + 3, 300]
    inputs, _, _ = make_paged_cache(lengths, block_size, num_heads, num_kv_heads, head_dim,
                                    dtype=dtype, device="cuda")
    assert_close(paged_decode_attention_cuda(**inputs), paged_decode_attention_ref(**inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_partitions", [1, 2, 3, 8, 100, None])  # 100: more than the 64 blocks
@pytest.mark.parametrize("window", [None, 40])
def test_cuda_split_k_decode_matches_reference_on_gpu(dtype, num_partitions, window):
    lengths = [1, 16, 17, 300, 1000]
    inputs, _, _ = make_paged_cache(lengths, 16, 8, 2, 128, dtype=dtype, device="cuda")
    if window is not None:
        poison_before_window(inputs, window)
    expected = paged_decode_attention_ref(**inputs, sliding_window=window)
    assert_close(paged_decode_attention_cuda(**inputs, sliding_window=window, num_partitions=num_partitions),
                 expected)

"""Paged decode attention and the KV write, in Triton.

What: during decode every running sequence brings ONE new query token per layer, and it must
attend to all of its cached keys and values. With a paged cache (vLLM's PagedAttention, Kwon et
al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023) those K/V rows are scattered over physical blocks; the sequence's block table says
where. The kernel follows the table itself, so the cache never has to be contiguous.

Why a kernel: decode attention does almost no arithmetic per byte (one multiply-add per K or V
element per query head), so its speed is the number of bytes moved. Let us count them for the
naive way, the one ``reference.py`` spells out:

    1. gather:  read the sequence's K and V blocks from the pool, write a contiguous copy
    2. GQA:     ``repeat_interleave`` K and V from Hkv to H heads (read, write H/Hkv times more)
    3. QK^T:    read the expanded K, write the scores [B, H, L] in fp32
    4. softmax: read and write the scores
    5. PV:      read the probabilities and the expanded V

With B = 32 sequences of L = 2048 tokens, H = 32, Hkv = 8, D = 128 in fp16 (a Llama-3-8B
layer), one unit U = B * L * D * 2 bytes = 16 MiB and the cached K+V is 2 * Hkv * U = 256 MiB:

    gather 256 + 256, expand 256 + 1024, QK^T 512 + 8, softmax 8 + 8, PV 8 + 512  = 2848 MiB

The fused kernel reads each cached K and V element exactly once (256 MiB, plus 0.5 MiB of q and
output): about 11x fewer bytes, hence about 11x faster on a bandwidth-bound GPU.
``decode_traffic_bytes`` below does this arithmetic for any shape.

The kernel: one program per (sequence, KV head). It loads the GROUP = H / Hkv query heads
that share this KV head (so each K/V block is read once for all of them: the point of GQA),
then walks the block table one block at a time with the online softmax (Milakov & Gimelshein
2018, as in FlashAttention): a running max m, a running sum l and an fp32 accumulator, rescaled
by exp(m_old - m_new) whenever a block raises the max. Scores never touch memory.

    for each block j of this sequence:            m, l, acc start at -inf, 0, 0
        phys  = block_table[seq, j]
        K, V  = k_pool[phys, :, kv_head, :], ...  [BS, D] each, masked past seq_len
        s     = q @ K^T * scale                   [GROUP, BS]
        m_new = max(m, rowmax(s));  p = exp(s - m_new);  a = exp(m - m_new)
        l     = l * a + rowsum(p);  acc = acc * a + p @ V;  m = m_new
    out = acc / l

Split-K, for long contexts at small batches ("flash-decoding": Dao, Haziza, Massa and Sizov,
"Flash-Decoding for long-context inference", 2023; vLLM's paged_attention_v2). One program per
(sequence, KV head) makes B * Hkv programs: 256 in the example above, 32 for 4 sequences of 8192
tokens, on a GPU of 132 SMs that needs several programs on each to keep enough loads in flight,
while every program walks its blocks one after another. So we cut the blocks each sequence reads
into P partitions of whole blocks (``split_k.py`` draws which) and give each partition its own
program, grid (B, Hkv, P). A partition runs the same online softmax and stops before dividing:
it writes its state m_p [G], l_p [G] and the unnormalized acc_p [G, D] to fp32 scratch. A
second, small kernel combines them for each (sequence, query head):

    M   = max_p m_p
    out = sum_p exp(m_p - M) * acc_p  /  sum_p exp(m_p - M) * l_p

the very rescaling the online softmax does between blocks, done once between partitions. A
partition with nothing to read (past seq_len, or more partitions than blocks) reports m_p = -inf,
l_p = 0 and gets weight 0 (we never compute exp(-inf - -inf)).

Bytes: K and V are still read exactly once, split or not. What split-K adds is the scratch: each
partition writes D + 2 fp32 values per query head and the combine reads them back,
2 * B * H * P * (D + 2) * 4 bytes; for the example above with P = 5 (the chooser's pick there)
that is 5.1 MiB on top of 256.5 MiB (2 %). ``split_k.scratch_traffic_bytes`` counts it,
``split_k.choose_num_partitions`` picks P, and P = 1 is the one-pass kernel, still the choice
for big batches of short contexts.

The launchers check inputs with ``check_paged_inputs`` (shapes, dtypes, devices, table entries
inside the pool), so a bad table is a ValueError, never an out-of-bounds read.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before Triton is imported and these
kernels run, slowly, in Triton's NumPy interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_paged_inputs, check_write_inputs
from .split_k import partition_plan

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = exp2(x * LOG2E), and exp2 is the cheap instruction
SCORE_BYTES = 4  # the naive path keeps scores and probabilities in fp32
# the combine reads the partition states this many at a time: [16, D] fp32 tiles (8 KiB at
# D = 128) stay in registers, and any P works, in ceil(P / 16) steps
MAX_PART_TILE = 16


def decode_traffic_bytes(batch, context_len, num_heads, num_kv_heads, head_dim, elem_bytes):
    """Bytes moved by one decode attention call: the naive 5-pass way vs the fused kernel."""
    unit = batch * context_len * head_dim * elem_bytes  # one head's K (or V) for the whole batch
    kv = 2 * num_kv_heads * unit  # cached K + V as stored
    kv_expanded = 2 * num_heads * unit  # after repeat_interleave to H heads
    scores = batch * num_heads * context_len * SCORE_BYTES
    naive = (
        2 * kv  # gather: read the pool, write a contiguous copy
        + kv + kv_expanded  # GQA expansion: read the copy, write H heads
        + kv_expanded // 2 + scores  # QK^T: read expanded K, write scores
        + 2 * scores  # softmax: read, write
        + scores + kv_expanded // 2  # PV: read probabilities and expanded V
    )
    q_and_out = 2 * batch * num_heads * head_dim * elem_bytes
    return {"naive": naive + q_and_out, "fused": kv + q_and_out}


# ---- the kernels ------------------------------------------------------------------------------


@triton.jit
def _first_visible(seq_len, window):
    """The first position the query reads: seq_len - W under a sliding window (window = 0: none)."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _attend_blocks(
    q, k_pool_ptr, v_pool_ptr, table_ptr, k_scale_ptr, v_scale_ptr, stride_sn, stride_ss,
    kv_head, seq_len, first, j_begin, j_end, scale_log2e,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D_PAD: tl.constexpr, BS_PAD: tl.constexpr, INT8_KV: tl.constexpr,
):
    """The online softmax of q [G, D] over blocks j_begin .. j_end - 1 of one sequence (its table
    row at ``table_ptr``): returns m [G] (log2 units), l [G] and the unnormalized acc [G, D]; with
    no block to read, the empty state -inf, 0, 0."""
    offs_d = tl.arange(0, D_PAD)
    offs_s = tl.arange(0, BS_PAD)  # slots inside one block
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max, in log2 units
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)  # running sum of p * V
    for j in range(j_begin, j_end):
        phys = tl.load(table_ptr + j).to(tl.int64)
        pos = j * BLOCK_SIZE + offs_s
        s_mask = (offs_s < BLOCK_SIZE) & (pos < seq_len) & (pos >= first)  # [BS]
        kv_mask = s_mask[:, None] & d_mask[None, :]
        k_rows = k_pool_ptr + phys * stride_kn + offs_s[:, None] * stride_ks + kv_head * stride_kh
        k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [BS, D]
        if INT8_KV:  # dequantize in registers: one scale per token (and this KV head)
            scale_rows = phys * stride_sn + offs_s * stride_ss + kv_head  # [BS]
            k = k * tl.load(k_scale_ptr + scale_rows, mask=s_mask, other=0.0)[:, None]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2e  # [G, BS]
        s = tl.where(s_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [G]; finite: every block has >= 1 token
        alpha = tl.exp2(m_i - m_new)  # rescales what we summed so far (0 on the first block)
        p = tl.exp2(s - m_new[:, None])  # [G, BS]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_pool_ptr + phys * stride_vn + offs_s[:, None] * stride_vs + kv_head * stride_vh
        v = tl.load(v_rows + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [BS, D]
        if INT8_KV:
            v = v * tl.load(v_scale_ptr + scale_rows, mask=s_mask, other=0.0)[:, None]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, stride_sn, stride_ss,  # int8 pools: fp32 scales [NB, BS, Hkv]
    scale_log2e, window,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr, BS_PAD: tl.constexpr, INT8_KV: tl.constexpr,
):
    """One pass: one program per (sequence, KV head) walks all the blocks it reads."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)  # query heads kv_head * GROUP + g share this KV head
    offs_d = tl.arange(0, D_PAD)
    gd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + offs_g

    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=gd_mask, other=0.0).to(tl.float32)  # [G, D]
    seq_len = tl.load(seq_lens_ptr + seq)
    first = _first_visible(seq_len, window)
    # blocks before the window: skipped
    m_i, l_i, acc = _attend_blocks(
        q, k_pool_ptr, v_pool_ptr, block_tables_ptr + seq * stride_bt, k_scale_ptr, v_scale_ptr,
        stride_sn, stride_ss, kv_head, seq_len, first, first // BLOCK_SIZE,
        tl.cdiv(seq_len, BLOCK_SIZE), scale_log2e,
        stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
        GROUP_PAD, HEAD_DIM, BLOCK_SIZE, D_PAD, BS_PAD, INT8_KV)

    out = acc / l_i[:, None]
    out_rows = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _paged_decode_partition_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, seq_lens_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr,  # fp32 scratch: [B, H, P], [B, H, P], [B, H, P, D]
    k_scale_ptr, v_scale_ptr, stride_sn, stride_ss,
    scale_log2e, window, blocks_per_partition,
    stride_qb, stride_qh, stride_mb, stride_mh, stride_ab, stride_ah, stride_ap,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr, BS_PAD: tl.constexpr, INT8_KV: tl.constexpr,
):
    """Split-K, step 1: program (sequence, KV head, partition) attends to its partition's blocks
    and writes the state m, l, acc for the combine (no division: other partitions are missing)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    gd_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + offs_g

    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=gd_mask, other=0.0).to(tl.float32)  # [G, D]
    seq_len = tl.load(seq_lens_ptr + seq)
    first = _first_visible(seq_len, window)
    # partitions count from the first block read; one past the last block reads nothing
    j_begin = first // BLOCK_SIZE + part * blocks_per_partition
    j_end = tl.minimum(j_begin + blocks_per_partition, tl.cdiv(seq_len, BLOCK_SIZE))
    m_i, l_i, acc = _attend_blocks(
        q, k_pool_ptr, v_pool_ptr, block_tables_ptr + seq * stride_bt, k_scale_ptr, v_scale_ptr,
        stride_sn, stride_ss, kv_head, seq_len, first, j_begin, j_end, scale_log2e,
        stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
        GROUP_PAD, HEAD_DIM, BLOCK_SIZE, D_PAD, BS_PAD, INT8_KV)

    state = seq * stride_mb + heads * stride_mh + part  # [G] slots of m and l
    tl.store(part_max_ptr + state, m_i, mask=g_mask)
    tl.store(part_sum_ptr + state, l_i, mask=g_mask)
    acc_rows = part_acc_ptr + seq * stride_ab + heads[:, None] * stride_ah + part * stride_ap
    tl.store(acc_rows + offs_d[None, :], acc, mask=gd_mask)


@triton.jit
def _combine_partitions_kernel(
    part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, num_partitions,
    stride_mb, stride_mh, stride_ab, stride_ah, stride_ap, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PART_TILE: tl.constexpr,
):
    """Split-K, step 2: program (sequence, query head) combines the P partition states,
    PART_TILE at a time: out = sum_p w_p acc_p / sum_p w_p l_p with w_p = exp2(m_p - max m)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.arange(0, PART_TILE)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    state = seq * stride_mb + head * stride_mh  # partition 0's m and l
    acc_row = part_acc_ptr + seq * stride_ab + head * stride_ah

    m_tile = tl.full([PART_TILE], float("-inf"), tl.float32)  # 1. M = the largest m_p
    for p0 in range(0, num_partitions, PART_TILE):
        parts = p0 + offs_p
        m_p = tl.load(part_max_ptr + state + parts, mask=parts < num_partitions,
                      other=float("-inf"))
        m_tile = tl.maximum(m_tile, m_p)
    m_all = tl.max(m_tile, axis=0)

    l_tile = tl.zeros([PART_TILE], tl.float32)  # 2. rescale every partition to M and add
    acc = tl.zeros([D_PAD], tl.float32)
    for p0 in range(0, num_partitions, PART_TILE):
        parts = p0 + offs_p
        p_mask = parts < num_partitions
        m_p = tl.load(part_max_ptr + state + parts, mask=p_mask, other=float("-inf"))
        # an empty partition (m_p = -inf) weighs 0; never exp2(-inf - -inf) = NaN
        w = tl.where(m_p > float("-inf"), tl.exp2(m_p - m_all), 0.0)  # [PART_TILE]
        l_tile += w * tl.load(part_sum_ptr + state + parts, mask=p_mask, other=0.0)
        a_rows = acc_row + parts[:, None] * stride_ap + offs_d[None, :]
        a = tl.load(a_rows, mask=p_mask[:, None] & d_mask[None, :], other=0.0)  # [PART_TILE, D]
        acc += tl.sum(w[:, None] * a, axis=0)

    out = acc / tl.sum(l_tile, axis=0)
    out_row = out_ptr + seq * stride_ob + head * stride_oh + offs_d
    tl.store(out_row, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_pkn, stride_pks, stride_pkh, stride_pvn, stride_pvs, stride_pvh,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    i = tl.program_id(0)  # one program per new token
    slot = tl.load(slot_ptr + i)  # int64
    phys, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    hd_k = offs_h[:, None] * stride_kh + offs_d[None, :]
    hd_v = offs_h[:, None] * stride_vh + offs_d[None, :]
    k = tl.load(k_ptr + i * stride_kn + hd_k, mask=mask)  # [Hkv, D]
    v = tl.load(v_ptr + i * stride_vn + hd_v, mask=mask)
    k_dst = k_pool_ptr + phys * stride_pkn + offset * stride_pks + offs_h[:, None] * stride_pkh
    v_dst = v_pool_ptr + phys * stride_pvn + offset * stride_pvs + offs_h[:, None] * stride_pvh
    tl.store(k_dst + offs_d[None, :], k, mask=mask)
    tl.store(v_dst + offs_d[None, :], v, mask=mask)


# ---- the launchers ----------------------------------------------------------------------------


def _require_unit_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the head dim D must be contiguous (stride 1), "
                         f"got strides {t.stride()}")


def paged_decode_attention_triton(q, k_pool, v_pool, block_tables, seq_lens, scale: float,
                                  sliding_window: int | None = None, scales=None,
                                  num_partitions: int | None = None):
    """Same contract as ``paged_decode_attention_ref``: q [B, H, D] -> out [B, H, D]; int8 pools are
    dequantized in registers, block by block (the pool is read as int8: a quarter of fp32's
    bytes).

    ``num_partitions``: 1 runs the one-pass kernel, P > 1 split-K with P partitions of the blocks
    each sequence reads, None lets ``split_k.choose_num_partitions`` pick."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens, scale, sliding_window, scales)
    _require_unit_stride("k_pool", k_pool)
    _require_unit_stride("v_pool", v_pool)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pool.shape
    num_partitions, per_partition = partition_plan(
        num_partitions, batch, num_kv_heads, block_tables.shape[1], block_size, sliding_window,
        q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    k_scale, v_scale = ((t.contiguous() for t in scales) if scales is not None
                        else (seq_lens, seq_lens))  # unused
    group = num_heads // num_kv_heads
    common = dict(
        k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, seq_lens=seq_lens,
        int8=(k_scale, v_scale, k_scale.stride(0) if scales is not None else 0,
              k_scale.stride(1) if scales is not None else 0),
        scale=(scale * LOG2E, sliding_window or 0),
        strides=(k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                 v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0)),
        shapes=dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                    GROUP_PAD=triton.next_power_of_2(group),
                    D_PAD=triton.next_power_of_2(head_dim),
                    BS_PAD=triton.next_power_of_2(block_size), INT8_KV=scales is not None))
    if num_partitions == 1:
        _paged_decode_kernel[(batch, num_kv_heads)](
            q, k_pool, v_pool, block_tables, seq_lens, out, *common["int8"], *common["scale"],
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *common["strides"],
            **common["shapes"])
    else:
        _launch_split_k(q, out, num_partitions, per_partition, **common)
    return out


def _launch_split_k(q, out, num_partitions, per_partition, k_pool, v_pool, block_tables,
                    seq_lens, int8, scale, strides, shapes) -> None:
    """Split-K: the partitions write fp32 states [B, H, P] (m, l) and [B, H, P, D] (acc), then
    the combine turns them into ``out``."""
    batch, num_heads, head_dim = q.shape
    part_max = torch.empty(batch, num_heads, num_partitions, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(batch, num_heads, num_partitions, head_dim, dtype=torch.float32,
                           device=q.device)
    scratch = (part_max.stride(0), part_max.stride(1),
               part_acc.stride(0), part_acc.stride(1), part_acc.stride(2))
    _paged_decode_partition_kernel[(batch, k_pool.shape[2], num_partitions)](
        q, k_pool, v_pool, block_tables, seq_lens, part_max, part_sum, part_acc, *int8, *scale,
        per_partition, q.stride(0), q.stride(1), *scratch, *strides, **shapes)
    _combine_partitions_kernel[(batch, num_heads)](
        part_max, part_sum, part_acc, out, num_partitions, *scratch, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=shapes["D_PAD"],
        PART_TILE=min(MAX_PART_TILE, triton.next_power_of_2(num_partitions)))


def write_kv_triton(k, v, k_pool, v_pool, slot_mapping) -> None:
    """Same contract as ``write_kv_ref``: token i's K/V rows go to slot slot_mapping[i], in
    place."""
    check_write_inputs(k, v, k_pool, v_pool, slot_mapping)
    _require_unit_stride("k_pool", k_pool)
    _require_unit_stride("v_pool", v_pool)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    num_tokens = k.shape[0]
    _, block_size, num_kv_heads, head_dim = k_pool.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_pool, v_pool, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
    )


def runs_on_cpu() -> bool:
    """True when Triton was imported in interpreter mode, so CPU tensors can be launched on."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_paged_decode_kernel, InterpretedFunction)

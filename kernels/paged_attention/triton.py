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

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = exp2(x * LOG2E), and exp2 is the cheap instruction
SCORE_BYTES = 4  # the naive path keeps scores and probabilities in fp32


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
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)  # query heads kv_head * GROUP + g share this KV head
    offs_d = tl.arange(0, D_PAD)
    offs_s = tl.arange(0, BS_PAD)  # slots inside one block
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [G, D]
    seq_len = tl.load(seq_lens_ptr + seq)
    # sliding window: the first position we read (window = 0: none)
    first = tl.maximum(seq_len - window, 0)
    first = tl.where(window > 0, first, 0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max, in log2 units
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)  # running sum of p * V
    # blocks before the window: skipped
    for j in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        phys = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
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

    out = acc / l_i[:, None]
    out_rows = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


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
                                  sliding_window: int | None = None, scales=None):
    """Same contract as ``paged_decode_attention_ref``: q [B, H, D] -> out [B, H, D]; int8 pools are
    dequantized in registers, block by block (the pool is read as int8: a quarter of fp32's
    bytes)."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens, scale, sliding_window, scales)
    _require_unit_stride("k_pool", k_pool)
    _require_unit_stride("v_pool", v_pool)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    batch, num_heads, head_dim = q.shape
    k_scale, v_scale = ((t.contiguous() for t in scales) if scales is not None
                        else (seq_lens, seq_lens))  # unused
    _, block_size, num_kv_heads, _ = k_pool.shape
    group = num_heads // num_kv_heads
    if batch == 0:
        return out
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_pool, v_pool, block_tables, seq_lens, out,
        k_scale, v_scale, k_scale.stride(0) if scales is not None else 0,
        k_scale.stride(1) if scales is not None else 0,
        scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        GROUP_PAD=triton.next_power_of_2(group), D_PAD=triton.next_power_of_2(head_dim),
        BS_PAD=triton.next_power_of_2(block_size), INT8_KV=scales is not None,
    )
    return out


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

"""Causal prefill attention in Triton: FlashAttention's tiled online softmax.

What: a prompt of T tokens attends to itself, causally (query i sees keys 0..i), for every one
of H query heads; K/V have Hkv <= H heads (GQA). Same contract as ``reference.py``.

Why a kernel: the naive way (``causal_attention_naive``) materializes the [H, T, T] score matrix
in fp32 and passes over it four times (write scores, softmax reads and writes, PV reads). Let
us count the bytes for a Llama-3-8B layer prefilling T = 4096 tokens: H = 32, Hkv = 8, D = 128,
fp16. One unit U = T * D * 2 bytes = 1 MiB (one head's q, k, v or out):

    naive:  q, k, v, out per head      4 * H * U          =  128 MiB
            scores [H, T, T] fp32      4 passes * 2 GiB    = 8192 MiB        total 8320 MiB
    fused:  q read, out written        2 * H * U           =   64 MiB
            K and V, re-read by each query tile up to the diagonal:
            H * 2 * sum_i (64 * i keys * D * 2 B), i = 1..64 = 2080 MiB      total 2144 MiB

about 3.9x fewer bytes, and no 2 GiB buffer to allocate (32 GiB at T = 16k: the naive way does
not even fit). Better still, one head's K and V are only 1 MiB each, so the re-reads mostly hit
L2 and DRAM sees little more than the 80 MiB of q, k, v and out. ``prefill_traffic_bytes``
below does this arithmetic for any shape.

The kernel: one program per (query tile, query head). It keeps its BLOCK_Q x D query tile in
registers and walks the key tiles from 0 to the diagonal with the online softmax (running max
m, running sum l, fp32 accumulator rescaled by exp(m_old - m_new)), as ``flash_attention_ref``
spells out in PyTorch. Scores exist only as one BLOCK_Q x BLOCK_K tile at a time::

    pid (i, h):  Q = q[i*BQ : (i+1)*BQ, h]                     [BQ, D]
                 kv = h // (H / Hkv)                            GQA: a group shares a KV head
    for j in 0 .. the key tile holding query (i+1)*BQ - 1:      tiles above the diagonal: skipped
        K, V  = k[j*BK : (j+1)*BK, kv], v[...]                  [BK, D]
        s     = Q @ K^T * scale, -inf where key > query         [BQ, BK]
        m_new = max(m, rowmax(s));  p = exp(s - m_new);  alpha = exp(m - m_new)
        l     = l * alpha + rowsum(p);  acc = acc * alpha + p @ V;  m = m_new
    out[i*BQ : (i+1)*BQ, h] = acc / l

Both products are ``tl.dot``, so on a GPU they run on tensor cores (fp32 inputs: full IEEE
precision, no TF32, so the fp32 results match the reference tightly). On a machine without a
GPU, set ``TRITON_INTERPRET=1`` before Triton is imported and the kernel runs, slowly, in
Triton's NumPy interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_flash_inputs

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = exp2(x * LOG2E), and exp2 is the cheap instruction
SCORE_BYTES = 4  # the naive path keeps scores and probabilities in fp32
MIN_DOT_SIZE = 16  # tl.dot needs every tile dimension >= 16 (tensor-core fragment size)
DEFAULT_BLOCK = 64  # queries (keys) per tile; 64 x 128 fp16 tiles fit comfortably in registers


def prefill_traffic_bytes(num_tokens, num_heads, num_kv_heads, head_dim, elem_bytes,
                          block_q=DEFAULT_BLOCK, block_k=DEFAULT_BLOCK):
    """Bytes moved by one causal prefill attention call: the naive 4-pass way vs the tiled kernel.

    The naive count reads K and V once per query head (the GQA-expanded copies); the fused count
    reads them once per (query tile, query head), up to the diagonal, whatever L2 saves."""
    unit = num_tokens * head_dim * elem_bytes  # one head's q, k, v or out
    scores = num_heads * num_tokens * num_tokens * SCORE_BYTES
    naive = 4 * num_heads * unit + 4 * scores  # QK^T writes, softmax reads + writes, PV reads
    kv_rows_read = 0
    for q_start in range(0, num_tokens, block_q):
        q_end = min(q_start + block_q, num_tokens)
        kv_rows_read += min(num_tokens, triton.cdiv(q_end, block_k) * block_k)  # whole key tiles
    fused = 2 * num_heads * unit + num_heads * 2 * kv_rows_read * head_dim * elem_bytes
    return {"naive": naive, "fused": fused}


# ---- the kernel -------------------------------------------------------------------------------


@triton.jit
def _flash_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, scale_log2e, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    q_tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP  # GQA: query heads kv_head * GROUP .. + GROUP - 1 share this KV head
    offs_q = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query positions of this tile
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    q_mask = (offs_q < num_tokens)[:, None] & d_mask[None, :]
    q_rows = q_ptr + offs_q[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [BQ, D], the storage dtype on a GPU

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max, in log2 units
    l_i = tl.zeros([BLOCK_Q], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_Q, D_PAD], tl.float32)  # running sum of p * V
    # keys past this tile's last query: never needed
    hi = tl.minimum((q_tile + 1) * BLOCK_Q, num_tokens)
    for k_start in range(0, hi, BLOCK_K):
        pos_k = k_start + offs_k  # [BK]
        kv_mask = (pos_k < num_tokens)[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + pos_k[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [BK, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [BQ, BK] fp32
        visible = (pos_k[None, :] <= offs_q[:, None]) & (pos_k < num_tokens)[None, :]  # causal
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is visible to every row
        alpha = tl.exp2(m_i - m_new)  # rescales what we summed so far (0 on the first tile)
        p = tl.exp2(s - m_new[:, None])  # [BQ, BK]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + pos_k[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [BK, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v,
                                            input_precision=PRECISION)  # [BQ, D]
        m_i = m_new

    out = acc / l_i[:, None]
    out_rows = out_ptr + offs_q[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# ---- the launcher -----------------------------------------------------------------------------


def _check_tile(name: str, block) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < MIN_DOT_SIZE \
            or block & (block - 1):
        raise ValueError(f"{name}: must be a power of two >= {MIN_DOT_SIZE} (tl.dot tiles), "
                         f"got {block!r}")


def _dot_dtype(dtype: torch.dtype):
    """The type tl.dot multiplies in: the storage type (tensor cores take fp16/bf16 as they are),
    except bfloat16 under the CPU interpreter, whose tl.dot misreads bf16 bits (Triton 3.9): fp32
    there."""
    if dtype == torch.bfloat16:
        return tl.float32 if runs_on_cpu() else tl.bfloat16
    return {torch.float32: tl.float32, torch.float16: tl.float16}[dtype]


def flash_attention_triton(q, k, v, scale: float, block_q: int = DEFAULT_BLOCK,
                           block_k: int = DEFAULT_BLOCK):
    """Same contract as ``causal_attention_naive``: q [T, H, D], k/v [T, Hkv, D] -> out
    [T, H, D]."""
    check_flash_inputs(q, k, v, scale)
    _check_tile("block_q", block_q)
    _check_tile("block_k", block_k)
    # D must be unit-stride
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    dot_dtype = _dot_dtype(q.dtype)
    grid = (triton.cdiv(num_tokens, block_q), num_heads)
    _flash_prefill_kernel[grid](
        q, k, v, out, float(scale) * LOG2E, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim,
        D_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q, BLOCK_K=block_k, DOT_DTYPE=dot_dtype,
        # 16-bit inputs: exact products anyway
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )
    return out


def runs_on_cpu() -> bool:
    """True when Triton was imported in interpreter mode, so CPU tensors can be launched on."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_flash_prefill_kernel, InterpretedFunction)

"""Causal prefill attention in plain PyTorch: the naive oracle and the same result tile by tile.

During prefill a prompt of T tokens attends to itself, causally: query i sees keys 0..i. The
inputs are contiguous (no paged cache here; the prompt's K/V were just computed)::

    q    [T, H, D]       H query heads
    k, v [T, Hkv, D]     Hkv KV heads, H % Hkv == 0; query head h reads KV head h // (H // Hkv)
    out  [T, H, D]       in q's dtype; softmax and sums in fp32 whatever the storage type

Two functions compute the same numbers:
- ``causal_attention_naive``: the textbook formula, with the whole [H, T, T] score matrix;
- ``flash_attention_ref``: FlashAttention's schedule (Dao et al., "FlashAttention: Fast and
  Memory-Efficient Exact Attention with IO-Awareness", NeurIPS 2022) written in PyTorch, so the
  Triton and CUDA kernels have a readable twin to be compared with, loop for loop.
``check_flash_inputs`` is the input contract every backend enforces first.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_BLOCK = 64  # queries (or keys) per tile: FlashAttention's usual size for D = 64..128


def _fail(field: str, message: str):
    raise ValueError(f"{field}: {message}")


def check_flash_inputs(q, k, v, scale: float) -> None:
    """q [T, H, D], k and v [T, Hkv, D] with T >= 1 and H % Hkv == 0, one float dtype and device,
    scale > 0. Raises ValueError naming the field, the value and what is allowed."""
    if q.dim() != 3 or q.shape[0] < 1:
        _fail("q", f"expected [T, H, D] with T >= 1 tokens, got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        _fail("q", f"dtype {q.dtype} is not one of {FLOAT_DTYPES}")
    num_tokens, num_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        _fail("k", f"expected [T, Hkv, D] = [{num_tokens}, Hkv, {head_dim}] (T and D from q), "
                   f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        _fail("v", f"shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if num_heads % k.shape[1] != 0:
        _fail("k", f"Hkv = {k.shape[1]} KV heads must divide H = {num_heads} query heads")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            _fail(name, f"{t.dtype} on {t.device} must match q's {q.dtype} on {q.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not 0 < scale < float("inf"):
        _fail("scale", f"must be a finite float > 0 (usually 1/sqrt(D) = {head_dim ** -0.5:.4g}), "
                       f"got {scale!r}")


def _check_block(name: str, block) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        _fail(name, f"must be an integer >= 1 (tokens per tile), got {block!r}")


def _expand_kv(x, num_heads: int):
    """[T, Hkv, D] -> [T, H, D] in fp32: each KV head repeated for its group of H / Hkv query
    heads."""
    return x.float().repeat_interleave(num_heads // x.shape[1], dim=1)


def causal_attention_naive(q, k, v, scale: float):
    """softmax(q k^T * scale + causal mask) v, with the whole score matrix: the oracle.

    Memory traffic, per head (B_el bytes per stored element, fp32 scores):

        QK^T     read q and k (2 * T * D * B_el), write the scores    T * T * 4
        softmax  read the scores, write the probabilities             2 * T * T * 4
        PV       read the probabilities and v, write out              T * T * 4 + 2 * T * D * B_el

    The T x T matrix is written twice and read twice: at T = 4096 with H = 32
    heads it is 2 GiB per layer in fp32, 8 GiB of traffic, while q, k, v and out together are
    80 MiB (fp16, D = 128, Hkv = 8: a Llama-3-8B layer).
    Half of it (above the diagonal) is masked to -inf and contributes nothing.
    """
    check_flash_inputs(q, k, v, scale)
    num_tokens, num_heads, _ = q.shape
    k, v = _expand_kv(k, num_heads), _expand_kv(v, num_heads)  # [T, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, T, T]
    future = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).triu(diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))  # key j > query i: not seen yet
    probs = scores.softmax(dim=-1)  # [H, T, T]
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # [T, H, D]


def flash_attention_ref(q, k, v, scale: float, block_q: int = DEFAULT_BLOCK,
                        block_k: int = DEFAULT_BLOCK):
    """The same result, one (query tile, key tile) at a time, with the online softmax.

    We cut the T x T score matrix into tiles of block_q queries x block_k keys. Causality means
    query tile i needs only the key tiles up to the diagonal; tiles wholly above it are never
    touched (T = 10, block_q = block_k = 4)::

                   keys 0-3  4-7  8-9
        queries 0-3  [ d ]   .    .        d: diagonal tile, masked inside (key > query: -inf)
        queries 4-7  [ F ] [ d ]  .        F: full tile, no mask needed
        queries 8-9  [ F ] [ F ] [ d ]     .: above the diagonal, skipped entirely

    For each query tile we keep, per row, a running max m, a running sum l = sum exp(s - m) and an
    fp32 accumulator acc = sum exp(s - m) * v. A new key tile with scores s does::

        m_new = max(m, rowmax(s))
        p     = exp(s - m_new)                 # this tile's probabilities, not yet normalized
        alpha = exp(m - m_new)                 # rescales everything summed under the old max
        l     = l * alpha + rowsum(p)
        acc   = acc * alpha + p @ v_tile
    and at the end out = acc / l. This is exactly softmax(s) @ v: every term was multiplied by
    exp(-m_final) in the end, whatever max it was first summed under.

    Traffic: no T x T matrix ever exists; only a block_q x block_k tile of scores, which in the
    kernels lives in registers or shared memory. q and out are read and written once; K and V
    are read once per query tile (up to the diagonal). See ``triton.prefill_traffic_bytes``.
    """
    check_flash_inputs(q, k, v, scale)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    num_tokens, num_heads, head_dim = q.shape
    k, v = _expand_kv(k, num_heads), _expand_kv(v, num_heads)  # [T, H, D]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for q_start in range(0, num_tokens, block_q):
        q_end = min(q_start + block_q, num_tokens)
        out[q_start:q_end] = _one_query_tile(q[q_start:q_end].float(), k[:q_end], v[:q_end],
                                             q_start, scale, block_k).to(q.dtype)
    return out


def _one_query_tile(q_tile, k, v, q_start: int, scale: float, block_k: int):
    """q_tile [Tq, H, D] fp32 at positions q_start.. ; k, v [L, H, D] fp32, L = the last
    query + 1."""
    tile_len, num_heads, head_dim = q_tile.shape
    q_pos = torch.arange(q_start, q_start + tile_len, device=q_tile.device)  # [Tq]
    m = torch.full((num_heads, tile_len), float("-inf"), device=q_tile.device)  # running max
    l = torch.zeros(num_heads, tile_len, device=q_tile.device)  # running sum of exp(s - m)
    acc = torch.zeros(num_heads, tile_len, head_dim, device=q_tile.device)  # running sum of p * v
    for k_start in range(0, k.shape[0], block_k):  # k holds keys up to the diagonal only
        k_end = min(k_start + block_k, k.shape[0])
        s = torch.einsum("qhd,khd->hqk", q_tile, k[k_start:k_end]) * scale  # [H, Tq, Tk]
        k_pos = torch.arange(k_start, k_end, device=q_tile.device)
        # only bites on the diagonal
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))  # finite: key 0 (in the first tile) is seen by all
        p = torch.exp(s - m_new[..., None])  # [H, Tq, Tk]
        alpha = torch.exp(m - m_new)  # [H, Tq]; 0 on the first tile (m = -inf)
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("hqk,khd->hqd", p, v[k_start:k_end])
        m = m_new
    return (acc / l[..., None]).transpose(0, 1)  # [Tq, H, D]

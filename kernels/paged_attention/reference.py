"""Paged attention in plain PyTorch: the oracle every other backend is tested against.

The KV cache of one layer is two pools of physical blocks (see ``engine/kv/block_manager.py``)::

    k_pool, v_pool: [NB, BS, Hkv, D]     NB blocks, BS token slots per block,
                                         Hkv KV heads, D head dim; contiguous in D

    slot s  =  block * BS + offset   ->   k_pool[s // BS, s % BS]   (a [Hkv, D] row)

We put the block index first so that one block of one sequence is a single contiguous chunk
(BS * Hkv * D values) and ``k_pool.view(NB * BS, Hkv, D)[slot]`` is a token's row.

A sequence reaches its tokens through its block table: token position p lives in physical
block ``block_table[p // BS]`` at offset ``p % BS``. Entries past a sequence's last block are
never read, so a batch's tables can be padded with anything (we pad with 0).

Sliding window (Mistral): with ``sliding_window = W`` a query at position p sees only keys at
positions p - W + 1 .. p. Blocks that lie wholly before the window are never read, so the block
manager may give them back to the pool and leave a placeholder (``NULL_BLOCK`` = -1) in the table::

    W = 6, BS = 4, seq_len = 14 (query at position 13 sees positions 8..13)
    block table   [ -1,  -1,  5,  9 ]        blocks 0 and 1 (positions 0..7) were freed
    read          .....  .....  8..11 12..13

Three functions, all written for reading, not speed:
- ``write_kv_ref``: put new tokens' K and V into their slots;
- ``paged_decode_attention_ref``: one new query per sequence against its whole cached past;
- ``paged_prefill_attention_ref``: a chunk of queries of one sequence, causally.
The ``check_*`` functions define the input contract that every backend enforces first.

KV int8 (chapter 07, ``kv_cache_dtype="int8"``): the pools hold int8 values and every token's K (and
V) row of every KV head has its own fp32 scale, ``scales = (k_scale, v_scale)``, each
[NB, BS, Hkv]::

    write:  scale = max|x| / 127 over the D values of one token and head;  q = round(x / scale)
    read:   x ~ q * scale            (error <= scale / 2 per value; a row's outlier only hurts
                                      its own row)

So a token costs D + 4 bytes per head instead of 2D (bf16) or 4D (fp32).
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT8_MAX = 127  # symmetric int8: values -127..127 (we never use -128, so the range is symmetric)
INDEX_DTYPE = torch.int32  # block tables and lengths: 2^31 blocks is far beyond any pool
# a table entry whose block was freed (it fell out of the sliding window); never read
NULL_BLOCK = -1


def first_visible_position(seq_len, sliding_window: int | None):
    """The first key position the LAST query of a sequence of ``seq_len`` tokens can see (an int or
    an int tensor): 0 without a window, else max(0, seq_len - W)."""
    if sliding_window is None:
        return seq_len * 0
    return ((seq_len - sliding_window).clamp(min=0) if torch.is_tensor(seq_len)
            else max(0, seq_len - sliding_window))


def check_sliding_window(sliding_window) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        _fail("sliding_window", "must be an integer >= 1 or None (no window), "
                                f"got {sliding_window!r}")


# ---- the input contract ------------------------------------------------------------------------


def _fail(field: str, message: str):
    raise ValueError(f"{field}: {message}")


def check_kv_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, scales=None) -> None:
    """Both pools are [NB, BS, Hkv, D], same shape, dtype and device: floating point, or int8 with
    ``scales = (k_scale, v_scale)``, each fp32 [NB, BS, Hkv] on the same device."""
    if k_pool.dim() != 4:
        _fail("k_pool", f"expected 4 dims [NB, BS, Hkv, D], got shape {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        _fail("v_pool", f"shape {tuple(v_pool.shape)} must equal k_pool's {tuple(k_pool.shape)}")
    if k_pool.dtype not in (*FLOAT_DTYPES, torch.int8):
        _fail("k_pool", f"dtype {k_pool.dtype} is not one of {(*FLOAT_DTYPES, torch.int8)}")
    if v_pool.dtype != k_pool.dtype or v_pool.device != k_pool.device:
        _fail("v_pool", f"{v_pool.dtype} on {v_pool.device} must match "
                        f"k_pool's {k_pool.dtype} on {k_pool.device}")
    if (k_pool.dtype == torch.int8) != (scales is not None):
        _fail("scales", "int8 pools need scales = (k_scale, v_scale) and float pools take none; "
                        f"got {'none' if scales is None else 'scales'} for {k_pool.dtype} pools")
    for name, scale in (zip(("k_scale", "v_scale"), scales, strict=True) if scales is not None
                        else ()):
        if scale.shape != k_pool.shape[:3] or scale.dtype != torch.float32 \
                or scale.device != k_pool.device:
            _fail(name, f"expected fp32 [NB, BS, Hkv] = {list(k_pool.shape[:3])} "
                        f"on {k_pool.device}, got {scale.dtype} {list(scale.shape)} "
                        f"on {scale.device}")


def _check_index_tensor(name, t, dims, device, dtypes=(INDEX_DTYPE,)):
    if t.dtype not in dtypes:
        _fail(name, f"dtype {t.dtype} is not allowed, use one of {dtypes}")
    if t.dim() != dims:
        _fail(name, f"expected {dims} dim(s), got shape {tuple(t.shape)}")
    if t.device != device:
        _fail(name, f"is on {t.device} but the KV pools are on {device}")


def check_block_tables(block_tables, seq_lens, num_blocks: int, block_size: int,
                       names=("block_tables", "seq_lens"), first_positions=None) -> None:
    """Lengths in 1..capacity; every entry a sequence will read points inside the pool.

    ``names`` are the fields as the caller knows them, for the error message. ``first_positions``
    [B] (sliding window): the first position each sequence reads; blocks before it are not read, so
    they may hold ``NULL_BLOCK``."""
    tables_name, lens_name = names
    batch, max_blocks = block_tables.shape
    if seq_lens.shape != (batch,):
        _fail(lens_name, f"shape {tuple(seq_lens.shape)} must be [B] = [{batch}] "
                         f"(rows of {tables_name})")
    capacity = max_blocks * block_size
    bad_len = (seq_lens < 1) | (seq_lens > capacity)
    if bad_len.any():
        b = int(bad_len.nonzero()[0, 0])
        _fail(lens_name, f"{lens_name}[{b}] = {int(seq_lens[b])} is outside 1..{capacity} "
                         f"(block table capacity: {max_blocks} blocks x BS {block_size})")
    blocks_used = (seq_lens.to(torch.int64) + block_size - 1) // block_size  # [B]
    block_ids = torch.arange(max_blocks, device=block_tables.device)[None, :]  # [1, max_blocks]
    read = block_ids < blocks_used[:, None]
    if first_positions is not None:
        read &= block_ids >= (first_positions.to(torch.int64) // block_size)[:, None]
    bad = read & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        b, j = (int(i) for i in bad.nonzero()[0])
        _fail(tables_name, f"{tables_name}[{b}, {j}] = {int(block_tables[b, j])} is outside "
                           f"0..{num_blocks - 1} (the pool has NB = {num_blocks} blocks)")


def _check_query(q, k_pool, scale: float) -> None:
    """q is [T, H, D] with the pools' D, dtype and device, and H a multiple of Hkv."""
    num_kv_heads, head_dim = k_pool.shape[2:]
    if q.dim() != 3 or q.shape[2] != head_dim:
        _fail("q", f"expected [B or T, H, D] with D = {head_dim} (the pools' head dim), "
                   f"got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads != 0:
        _fail("q", f"H = {q.shape[1]} query heads must be a multiple of Hkv = {num_kv_heads}")
    # int8 pools: any float query
    wanted = FLOAT_DTYPES if k_pool.dtype == torch.int8 else (k_pool.dtype,)
    if q.dtype not in wanted or q.device != k_pool.device:
        _fail("q", f"{q.dtype} on {q.device} must match the pools' {k_pool.dtype} "
                   f"on {k_pool.device}")
    if not scale > 0:
        _fail("scale", f"must be > 0 (usually 1/sqrt(D)), got {scale}")


def check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens, scale: float,
                       sliding_window: int | None = None, scales=None) -> None:
    """The decode contract: q [B, H, D], pools [NB, BS, Hkv, D], tables [B, max_blocks] int32,
    seq_lens [B] int32, sliding_window None or >= 1. Raises ValueError naming the field; reads
    nothing out of bounds."""
    check_kv_pools(k_pool, v_pool, scales)
    _check_query(q, k_pool, scale)
    check_sliding_window(sliding_window)
    _check_index_tensor("block_tables", block_tables, 2, q.device)
    _check_index_tensor("seq_lens", seq_lens, 1, q.device)
    if block_tables.shape[0] != q.shape[0]:
        _fail("block_tables", f"has {block_tables.shape[0]} rows, q has B = {q.shape[0]}")
    first = first_visible_position(seq_lens, sliding_window) if sliding_window is not None else None
    check_block_tables(block_tables, seq_lens, *k_pool.shape[:2], first_positions=first)


def check_write_inputs(k, v, k_pool, v_pool, slot_mapping, scales=None) -> None:
    """k, v [N, Hkv, D] matching the pools (any float type for int8 pools); slot_mapping [N] int64
    inside 0..NB*BS-1."""
    check_kv_pools(k_pool, v_pool, scales)
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape != (k.shape[0], num_kv_heads, head_dim):
            _fail(name, f"expected [N, Hkv, D] = [N, {num_kv_heads}, {head_dim}], "
                        f"got {tuple(t.shape)}")
        wanted = FLOAT_DTYPES if k_pool.dtype == torch.int8 else (k_pool.dtype,)
        if t.dtype not in wanted or t.device != k_pool.device:
            _fail(name, f"{t.dtype} on {t.device} must match the pools' {k_pool.dtype} "
                        f"on {k_pool.device}")
    _check_index_tensor("slot_mapping", slot_mapping, 1, k.device, dtypes=(torch.int64,))
    if slot_mapping.shape[0] != k.shape[0]:
        _fail("slot_mapping", f"has {slot_mapping.shape[0]} entries for N = {k.shape[0]} tokens")
    num_slots = num_blocks * block_size
    bad = (slot_mapping < 0) | (slot_mapping >= num_slots)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        _fail("slot_mapping", f"slot_mapping[{i}] = {int(slot_mapping[i])} is outside "
                              f"0..{num_slots - 1}")


def check_prefill_inputs(q, k_pool, v_pool, block_table, q_positions, scale: float,
                         sliding_window: int | None = None, scales=None) -> tuple[int, int]:
    """The chunked-prefill contract (every prefill backend enforces it first): q [Tq, H, D], one
    position per query, all inside the table, every table entry the queries read inside the pool.
    Returns (context_len, first): the keys the chunk reads are positions
    first .. context_len - 1."""
    check_kv_pools(k_pool, v_pool, scales)
    _check_query(q, k_pool, scale)
    check_sliding_window(sliding_window)
    _check_index_tensor("block_table", block_table, 1, q.device)
    _check_index_tensor("q_positions", q_positions, 1, q.device,
                        dtypes=(torch.int32, torch.int64))
    if q_positions.shape[0] != q.shape[0] or q.shape[0] == 0:
        _fail("q_positions", f"needs one position per query: {q_positions.shape[0]} "
                             f"for Tq = {q.shape[0]}")
    if int(q_positions.min()) < 0:
        _fail("q_positions", f"positions must be >= 0, got {int(q_positions.min())}")
    context_len = int(q_positions.max()) + 1
    capacity = block_table.shape[0] * k_pool.shape[1]
    if context_len > capacity:
        _fail("q_positions", f"max position {context_len - 1} is outside 0..{capacity - 1} "
                             f"(block_table holds {block_table.shape[0]} blocks "
                             f"x BS {k_pool.shape[1]})")
    # The earliest query sees furthest back: from min(q) - W + 1.
    first = first_visible_position(int(q_positions.min()) + 1, sliding_window)
    seq_lens = torch.tensor([context_len], dtype=INDEX_DTYPE, device=q.device)
    check_block_tables(block_table[None], seq_lens, *k_pool.shape[:2],
                       names=("block_table", "q_positions"), first_positions=seq_lens * 0 + first)
    return context_len, first


# ---- the operations ---------------------------------------------------------------------------


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, Hkv, D] float -> (int8 [N, Hkv, D], fp32 scales [N, Hkv]): one scale per token and
    head."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # [N, Hkv]
    q = (x / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv_ref(k, v, k_pool, v_pool, slot_mapping, scales=None) -> None:
    """Write token i's K/V rows into slot ``slot_mapping[i]`` of the pools, in place (quantized to
    int8, with their scales, when the pools are int8)."""
    check_write_inputs(k, v, k_pool, v_pool, slot_mapping, scales)
    block_size = k_pool.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [N], [N]
    if scales is None:
        k_pool[blocks, offsets] = k  # [N, Hkv, D] into N rows of the pool
        v_pool[blocks, offsets] = v
        return
    for x, pool, scale in ((k, k_pool, scales[0]), (v, v_pool, scales[1])):
        pool[blocks, offsets], scale[blocks, offsets] = quantize_kv_int8(x)


def gather_kv(k_pool, v_pool, block_table, num_tokens: int, first_block: int = 0, scales=None):
    """Follow one block table: the K and V of positions first_block * BS .. num_tokens - 1,
    contiguous [L, Hkv, D] (blocks before ``first_block`` are skipped: a sliding window freed them).
    int8 pools come back dequantized to fp32."""
    _, block_size, num_kv_heads, head_dim = k_pool.shape
    blocks = block_table[first_block: (num_tokens + block_size - 1) // block_size].long()  # [n]
    L = num_tokens - first_block * block_size
    k = k_pool[blocks].reshape(-1, num_kv_heads, head_dim)[:L]  # [n, BS, Hkv, D] -> [L, Hkv, D]
    v = v_pool[blocks].reshape(-1, num_kv_heads, head_dim)[:L]
    if scales is not None:  # dequantize: x = q * scale, one scale per token and head
        k = k.float() * scales[0][blocks].reshape(-1, num_kv_heads)[:L, :, None]
        v = v.float() * scales[1][blocks].reshape(-1, num_kv_heads)[:L, :, None]
    return k, v


def _attend(q, k, v, scale, mask=None):
    """Dense attention in fp32 with GQA. q [Tq, H, D], k/v [L, Hkv, D], mask [Tq, L] bool."""
    group = q.shape[1] // k.shape[1]  # query heads per KV head: head h reads KV head h // group
    k = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.float(), k) * scale  # [H, Tq, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hql,lhd->qhd", probs, v).to(q.dtype)  # [Tq, H, D]


def paged_decode_attention_ref(q, k_pool, v_pool, block_tables, seq_lens, scale: float,
                               sliding_window: int | None = None, scales=None):
    """One query per sequence: q [B, H, D] attends to the first seq_lens[b] cached tokens (only
    the last ``sliding_window`` of them when given)."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens, scale, sliding_window, scales)
    block_size = k_pool.shape[1]
    out = torch.empty_like(q)  # [B, H, D]
    for b in range(q.shape[0]):
        seq_len = int(seq_lens[b])
        first = first_visible_position(seq_len, sliding_window)
        # [L, Hkv, D]
        k, v = gather_kv(k_pool, v_pool, block_tables[b], seq_len, first // block_size, scales)
        # drop the block's slots before the window
        k, v = k[first % block_size:], v[first % block_size:]
        out[b] = _attend(q[b : b + 1], k, v, scale)[0]
    return out


def paged_prefill_attention_ref(q, k_pool, v_pool, block_table, q_positions, scale: float,
                                sliding_window: int | None = None, scales=None):
    """Queries of ONE sequence, q [Tq, H, D] at absolute positions q_positions [Tq], attend to
    every cached position <= their own (causal), and > their own - ``sliding_window`` when given.
    Their own K/V must already be in the pool.

    This is chunked prefill over a paged cache: chunk 2 of a prompt sees chunk 1 through the
    block table, and itself causally.
    """
    context_len, first = check_prefill_inputs(q, k_pool, v_pool, block_table, q_positions, scale,
                                              sliding_window, scales)
    first_block = first // k_pool.shape[1]
    k, v = gather_kv(k_pool, v_pool, block_table, context_len, first_block, scales)  # [L, Hkv, D]
    key_positions = torch.arange(first_block * k_pool.shape[1], context_len, device=q.device)  # [L]
    mask = key_positions[None, :] <= q_positions[:, None]  # [Tq, L]
    if sliding_window is not None:
        mask &= q_positions[:, None] - key_positions[None, :] < sliding_window
    return _attend(q, k, v, scale, mask)

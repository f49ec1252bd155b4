"""Paged attention through PyTorch's fused ``scaled_dot_product_attention``: the fast path on a CPU.

The reference (``reference.py``) is written to be read: for every sequence it follows the block
table, copies that sequence's K/V out of the pool, repeats the KV heads for GQA and does the softmax
in fp32, one sequence at a time, in Python. In a decode step of 16 sequences and 30 layers that is
480 small gathers and 480 small attentions, and on a CPU it was about half of the step's time
(kernels/README.md, "Measured", has the numbers and the machine).

Here the whole batch goes at once:

    1. one gather: every sequence's table columns that anyone reads
           k_pool[tables] -> [B, L, Hkv, D]
       (padded to the longest sequence; NULL_BLOCK entries of a sliding window point at block 0)
    2. one mask: key position p of sequence b is visible iff  first_b <= p < seq_len_b
    3. one fused attention: F.scaled_dot_product_attention with that mask, the query heads that
       share a KV head folded into the query axis (no repeat_interleave of K/V: see `_attend`)

Same contract and the same checks as the reference (``check_paged_inputs``); int8 pools are
dequantized during the gather. The results equal the reference up to float rounding
(tests/test_paged_attention_sdpa.py).

Steps 1's index and 2's mask depend only on the block tables and lengths, which are the same in all
L layers of a step. So the work is cut in two: ``plan_decode`` / ``plan_prefill`` check the tables
and build the gather index and the mask ONCE per step (a ``DecodePlan`` / ``PrefillPlan``), and
``decode_planned`` / ``prefill_planned`` run each layer with nothing left to check or build: a
gather, a fused attention. The engine (engine/fast/attention.py) plans at its first layer; the
public functions below do both halves at once. Checking and planning in every layer had cost more
than the attention itself (kernels/README.md, "Measured").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import (
    check_block_tables,
    check_kv_pools,
    check_paged_inputs,
    check_prefill_inputs,
    check_write_inputs,
    first_visible_position,
)


def _gather_index(tables, first_col: int, last_col: int):
    """The pool blocks of table columns [first_col, last_col) of every row, flat [B * C] int64."""
    # NULL_BLOCK (-1) -> 0: masked out below
    cols = tables[:, first_col:last_col].long().clamp(min=0)
    return cols.reshape(-1)


def _gather(pool, scale, blocks, batch: int):
    """K (or V) of the pool blocks ``blocks`` [B * C], as [B, L, Hkv, D] with L = C * BS,
    dequantized to fp32 when ``scale`` (int8) is given."""
    _, BS, Hkv, D = pool.shape
    # index_select on dim 0 copies whole blocks: faster than pool[cols] on a CPU (kernels/README.md)
    # a fresh copy: ours to change in place
    x = pool.index_select(0, blocks).reshape(batch, -1, Hkv, D)
    if scale is not None:
        x = x.float() * scale.index_select(0, blocks).reshape(batch, -1, Hkv)[..., None]
    return x


def _hidden_keys(mask):
    """(rows, cols) of the keys no query of a row may read, from mask [B, Tq, L]: `_attend` zeroes
    them."""
    return (~mask.any(dim=1)).nonzero(as_tuple=True)


def _attend(q, k, v, mask, scale, hidden=None):
    """q [B, Tq, H, D], k/v [B, L, Hkv, D], mask [B, Tq, L] bool -> [B, Tq, H, D] in q's dtype.
    ``hidden``: `_hidden_keys(mask)` when the caller has it already.

    GQA without copying K/V: the g = H / Hkv query heads that share a KV head are folded into the
    query axis, so SDPA sees Hkv heads of g * Tq queries each (a decode step's single query becomes
    g queries):

        q [B, Tq, H, D] -> [B, Tq, Hkv, g, D] -> [B, Hkv, g * Tq, D]
        k, v: [B, Hkv, L, D] as they are

    Slots no query may see (padding, past a sequence's end, before its window) hold whatever the
    pool held: stale values, or anything. A masked score is -inf and its weight 0, but 0 * NaN is
    NaN, so we zero those K/V rows first: what a sequence does not own can never leak into its
    output."""
    B, Tq, H, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    # keys no query of the row may read
    rows, cols = _hidden_keys(mask) if hidden is None else hidden
    if rows.numel():
        k[rows, cols] = 0  # in place: k and v are _gather's own copies, never the pool
        v[rows, cols] = 0
    qg = q.reshape(B, Tq, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * Tq, D)
    if Tq == 1:
        # decode: one mask row per sequence, the same for its g folded heads (broadcast, no copy)
        m = mask[:, None]  # [B, 1, 1, L]
    else:
        # each query's mask, once per folded head
        m = mask[:, None].expand(B, g, Tq, L).reshape(B, 1, g * Tq, L)
    out = F.scaled_dot_product_attention(qg, k.to(q.dtype).transpose(1, 2),
                                         v.to(q.dtype).transpose(1, 2),
                                         attn_mask=m, scale=scale)  # [B, Hkv, g * Tq, D]
    return out.reshape(B, Hkv, g, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, H, D)


def _attend_causal(q, k, v, scale):
    """q [B, T, H, D], k/v [B, T, Hkv, D], query i sees keys 0..i: SDPA's is_causal needs no mask at
    all, so torch runs its flash kernel (tiles with an online softmax, never the [T, T] score
    matrix). Its inputs are made contiguous in [B, heads, T, D] first: on strided views the kernel
    lost more time than the copy costs (kernels/README.md, "Measured")."""
    # [B, H or Hkv, T, D]
    heads_first = [t.to(q.dtype).transpose(1, 2).contiguous() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*heads_first, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@dataclass
class DecodePlan:
    """What all L layers' decode attention of one step share, built once by `plan_decode`."""

    blocks: torch.Tensor  # [B * C] int64: pool blocks to gather, sequence after sequence
    batch: int  # B
    mask: torch.Tensor  # [B, 1, L] bool: key j is visible to sequence b (L = C * BS)
    hidden: tuple  # (rows, cols): keys no sequence may read (zeroed after each gather)


def plan_decode(block_tables, seq_lens, block_size: int, num_blocks: int,
                sliding_window: int | None = None) -> DecodePlan:
    """Check the tables once and build the gather index and the mask (module docstring,
    steps 1-2)."""
    first = first_visible_position(seq_lens, sliding_window) if sliding_window is not None else None
    check_block_tables(block_tables, seq_lens, num_blocks, block_size, first_positions=first)
    lens = seq_lens.long()
    first = torch.zeros_like(lens) if first is None else first.long()
    first_col, last_col = int(first.min()) // block_size, -(-int(lens.max()) // block_size)
    blocks = _gather_index(block_tables, first_col, last_col)  # [B * C]
    pos = first_col * block_size + torch.arange((last_col - first_col) * block_size,
                                                device=lens.device)  # [L]
    mask = ((pos[None, :] < lens[:, None]) & (pos[None, :] >= first[:, None]))[:, None]  # [B, 1, L]
    return DecodePlan(blocks, lens.shape[0], mask, _hidden_keys(mask))


def decode_planned(q, k_pool, v_pool, plan: DecodePlan, scale: float, scales=None):
    """One layer's decode attention, q [B, H, D] -> [B, H, D], with the step's `plan` (nothing is
    re-checked)."""
    k = _gather(k_pool, scales[0] if scales else None, plan.blocks, plan.batch)  # [B, L, Hkv, D]
    v = _gather(v_pool, scales[1] if scales else None, plan.blocks, plan.batch)
    return _attend(q[:, None], k, v, plan.mask, scale, plan.hidden)[:, 0]


def paged_decode_attention_sdpa(q, k_pool, v_pool, block_tables, seq_lens, scale: float,
                                sliding_window: int | None = None, scales=None):
    """Same contract as ``paged_decode_attention_ref``: q [B, H, D] -> out [B, H, D]."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens, scale, sliding_window, scales)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    plan = plan_decode(block_tables, seq_lens, k_pool.shape[1], k_pool.shape[0], sliding_window)
    return decode_planned(q, k_pool, v_pool, plan, scale, scales)


@dataclass
class PrefillPlan:
    """What all L layers' attention of one prefill chunk share, built once by `plan_prefill`."""

    blocks: torch.Tensor  # [C] int64: the pool blocks the chunk reads
    context_len: int  # keys are positions first .. context_len - 1
    # [1, Tq, L] bool, or None: a whole prompt in order (SDPA's is_causal)
    mask: torch.Tensor | None
    hidden: tuple | None  # (rows, cols) of keys no query reads, or None with mask None


def plan_prefill(q, k_pool, v_pool, block_table, q_positions, scale: float,
                 sliding_window: int | None = None, scales=None) -> PrefillPlan:
    """Check the chunk once (`check_prefill_inputs`) and build its gather index and mask."""
    context_len, first = check_prefill_inputs(q, k_pool, v_pool, block_table, q_positions, scale,
                                              sliding_window, scales)
    BS = k_pool.shape[1]
    first_col, last_col = first // BS, -(-context_len // BS)
    blocks = _gather_index(block_table[None], first_col, last_col)  # [C]
    whole_prompt = q.shape[0] == context_len and bool((q_positions == torch.arange(
        context_len, device=q.device)).all())  # query i at position i, for every i
    if sliding_window is None and whole_prompt:  # plain causal attention
        return PrefillPlan(blocks, context_len, None, None)
    key_pos = first_col * BS + torch.arange((last_col - first_col) * BS, device=q.device)  # [L]
    qp = q_positions.long()[:, None]
    mask = (key_pos[None, :] <= qp) & (key_pos[None, :] < context_len)  # [Tq, L]
    if sliding_window is not None:
        mask &= qp - key_pos[None, :] < sliding_window
    return PrefillPlan(blocks, context_len, mask[None], _hidden_keys(mask[None]))


def prefill_planned(q, k_pool, v_pool, plan: PrefillPlan, scale: float, scales=None, fresh=None):
    """One layer's attention of one prefill chunk, q [Tq, H, D] -> [Tq, H, D], with the chunk's
    `plan`.

    fresh: the chunk's own (k, v) [Tq, Hkv, D], just written into float pools of their dtype. A
    whole prompt (plan.mask None) reads no other keys, so these ARE its keys, the very values the
    pools hold: no gather needed."""
    if fresh is not None and plan.mask is None and scales is None \
            and fresh[0].dtype == k_pool.dtype:
        return _attend_causal(q[None], fresh[0][None], fresh[1][None], scale)[0]
    k = _gather(k_pool, scales[0] if scales else None, plan.blocks, 1)  # [1, L, Hkv, D]
    v = _gather(v_pool, scales[1] if scales else None, plan.blocks, 1)
    if plan.mask is None:
        return _attend_causal(q[None], k[:, :plan.context_len], v[:, :plan.context_len], scale)[0]
    return _attend(q[None], k, v, plan.mask, scale, plan.hidden)[0]


def paged_prefill_attention_sdpa(q, k_pool, v_pool, block_table, q_positions, scale: float,
                                 sliding_window: int | None = None, scales=None):
    """Same contract as ``paged_prefill_attention_ref``: queries of ONE sequence, q [Tq, H, D] at
    positions q_positions [Tq], causally over the cache (and within the window) -> [Tq, H, D]."""
    plan = plan_prefill(q, k_pool, v_pool, block_table, q_positions, scale, sliding_window, scales)
    return prefill_planned(q, k_pool, v_pool, plan, scale, scales)


def check_slots(slot_mapping, k_pool, v_pool, scales=None) -> None:
    """`check_write_inputs` for the slots alone (once per step): every slot inside the pool."""
    Hkv, D = k_pool.shape[2:]
    probe = k_pool.new_empty((slot_mapping.shape[0], Hkv, D),
                             dtype=torch.float32 if scales else k_pool.dtype)
    check_write_inputs(probe, probe, k_pool, v_pool, slot_mapping, scales)


def write_kv_planned(k, v, k_pool, v_pool, slot_mapping) -> None:
    """Write K/V [N, Hkv, D] into checked slots of float pools: one `index_copy_` into each pool
    seen as [NB * BS, Hkv, D] rows (slot s is row s), instead of computing (block, offset) pairs
    every layer."""
    check_kv_pools(k_pool, v_pool)
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("k_pool, v_pool: write_kv_planned needs contiguous pools (use write_kv)")
    NB, BS, Hkv, D = k_pool.shape
    k_pool.view(NB * BS, Hkv, D).index_copy_(0, slot_mapping, k)
    v_pool.view(NB * BS, Hkv, D).index_copy_(0, slot_mapping, v)

"""The fast wing's attention backends: the reference's arithmetic, planned once per step and run
in fewer calls.

engine/runner.py's `PagedAttention` is the readable backend: per layer, it writes K/V, then runs the
reference decode attention over every decode row and the reference prefill attention per chunk. The
backends here compute the same numbers (up to float rounding) and differ in how:

    "sdpa"    torch's fused attention; the decode rows' gather index and masks are built ONCE per
              step (`plan`, at layer 0) instead of once per layer (kernels/paged_attention/sdpa.py)
    "native"  decode in C straight from the pools (kernels/paged_attention/cpu_native.c), a step's
              whole prompts in ONE call of the C flash-prefill kernel
              (kernels/flash_prefill/cpu_native.c), other prefill chunks as sdpa
    "triton", "cuda", "torch"   the teaching kernels of kernels/paged_attention/, chosen by name

Which one runs is engine/fast/probes.py's decision (`attention_backend="auto"`), or the expert
override's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.fast.probes import c_prefill_max_tokens
from engine.runner import AttentionMetadata, PagedAttention
from kernels.flash_prefill.cpu_native import flash_prefill_planned
from kernels.paged_attention import (
    paged_decode_attention,
    paged_prefill_attention,
    resolve_backend,
    write_kv,
)
from kernels.paged_attention.cpu_native import (
    NativeDecodePlan,
    decode_native_planned,
    plan_decode_native,
)
from kernels.paged_attention.reference import check_block_tables, first_visible_position
from kernels.paged_attention.sdpa import (
    DecodePlan,
    PrefillPlan,
    check_slots,
    decode_planned,
    plan_decode,
    plan_prefill,
    prefill_planned,
    write_kv_planned,
)


def heads_side_by_side(t: Tensor) -> bool:
    """[N, heads, D] rows whose heads lie next to each other (any row stride): what the C
    flash-prefill kernel reads."""
    return t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


@dataclass
class StepPlans:
    """What the sdpa and native backends compute once per step instead of once per layer: the
    decode rows' gather index and mask (sdpa) or their tables made ready for C (native), one plan
    per prefill chunk; the slots and tables have been checked."""

    decode: DecodePlan | NativeDecodePlan | None
    prefills: list[PrefillPlan]
    c_prefill: Tensor | None = None  # [B, 2] int64 (lo, hi): the whole prompts the C kernel takes
    c_chunks: frozenset = frozenset()  # their indices in meta.prefills


class KernelAttention(PagedAttention):
    """A named kernel of kernels/paged_attention ("torch", "triton", "cuda"), called layer by layer.

    A backend that cannot run here falls back to "torch" with one warning, at build time."""

    def __init__(self, kv_pool, backend: str, sliding_window: int | None = None):
        super().__init__(kv_pool, sliding_window)
        # warns once, not per layer
        self.backend = resolve_backend(backend, kv_pool.device, kv_pool.dtype)
        if self.backend == "cuda" and kv_pool.dtype == torch.int8:
            warnings.warn("the CUDA paged-attention kernel has no int8 variant: "
                          "int8 KV runs on 'torch'", RuntimeWarning, stacklevel=2)
            self.backend = "torch"

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                meta: AttentionMetadata) -> Tensor:
        q, k, v = q[0], k[0], v[0]  # [N, H, D], [N, Hkv, D]: the packed batch is one row
        k_pool, v_pool = self.kv_pool.k[layer], self.kv_pool.v[layer]  # [NB, BS, Hkv, D]
        scales = self.kv_pool.scales(layer)
        write_kv(k, v, k_pool, v_pool, meta.slot_mapping, backend=self.backend, scales=scales)
        out = torch.empty_like(q)  # [N, H, D]
        if meta.decode_rows.numel():
            rows = meta.decode_rows
            out[rows] = paged_decode_attention(q[rows], k_pool, v_pool, meta.decode_block_tables,
                                               meta.decode_seq_lens, self.scale,
                                               backend=self.backend,
                                               sliding_window=self.sliding_window, scales=scales)
        for chunk in meta.prefills:
            out[chunk.lo:chunk.hi] = paged_prefill_attention(
                q[chunk.lo:chunk.hi], k_pool, v_pool, chunk.block_table, chunk.positions,
                self.scale, backend=self.backend, sliding_window=self.sliding_window,
                scales=scales)
        return out[None]  # [1, N, H, D]


class PlannedAttention(PagedAttention):
    """The "sdpa" and "native" backends: the step's checks and indices done once, at layer 0
    (`plan`)."""

    def __init__(self, kv_pool, backend: str, sliding_window: int | None = None,
                 c_prefill_tokens: int | None = None):
        if backend not in ("sdpa", "native"):
            raise ValueError(f"PlannedAttention runs 'sdpa' or 'native', not {backend!r}")
        super().__init__(kv_pool, sliding_window)
        self.backend = backend
        # the longest whole prompt the C flash-prefill kernel takes (measured on this machine:
        # engine/fast/tuning.py); None: probes.py's rule, asked once per step
        self.c_prefill_tokens = c_prefill_tokens
        # the decode kernel, picked once: C straight from the pools, or torch's fused attention
        self.decode = decode_native_planned if backend == "native" else decode_planned

    def plan(self, meta: AttentionMetadata, q: Tensor | None) -> StepPlans:
        """Check the step's slots and tables and build the gathers and masks: once per step, not
        per layer."""
        k_pool, v_pool, scales = self.kv_pool.k[0], self.kv_pool.v[0], self.kv_pool.scales(0)
        check_slots(meta.slot_mapping, k_pool, v_pool, scales)
        decode = None
        if meta.decode_rows.numel() and self.backend == "native":
            decode = plan_decode_native(meta.decode_block_tables, meta.decode_seq_lens,
                                        self.sliding_window)
            first = (None if self.sliding_window is None else
                     first_visible_position(decode.seq_lens, self.sliding_window))
            check_block_tables(decode.block_tables, decode.seq_lens, k_pool.shape[0],
                               k_pool.shape[1], first_positions=first)
        elif meta.decode_rows.numel():
            decode = plan_decode(meta.decode_block_tables, meta.decode_seq_lens, k_pool.shape[1],
                                 k_pool.shape[0], self.sliding_window)
        prefills = [plan_prefill(q[c.lo:c.hi], k_pool, v_pool, c.block_table, c.positions,
                                 self.scale, self.sliding_window, scales) for c in meta.prefills]
        picked = self._c_prefill_chunks(meta, prefills, q, k_pool.dtype, scales)
        if not picked:
            return StepPlans(decode, prefills)
        bounds = torch.tensor([(meta.prefills[i].lo, meta.prefills[i].hi) for i in picked],
                              dtype=torch.int64)
        return StepPlans(decode, prefills, bounds, frozenset(picked))

    def _c_prefill_chunks(self, meta: AttentionMetadata, prefills: list[PrefillPlan], q: Tensor,
                          pool_dtype: torch.dtype, scales) -> list[int]:
        """The prefill chunks the C flash-prefill kernel takes: whole prompts (no mask: query i at
        position i, no window) whose fresh K/V are what the pools hold (float pools of the model's
        dtype)."""
        if (self.backend != "native" or not meta.prefills or scales is not None
                or q.dtype != pool_dtype):
            return []
        if not heads_side_by_side(q):
            return []
        longest = (c_prefill_max_tokens(q) if self.c_prefill_tokens is None
                   else self.c_prefill_tokens)  # once per step
        return [i for i, (c, plan) in enumerate(zip(meta.prefills, prefills, strict=True))
                if plan.mask is None and c.hi - c.lo <= longest]

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                meta: AttentionMetadata) -> Tensor:
        q, k, v = q[0], k[0], v[0]  # [N, H, D], [N, Hkv, D]
        if meta.plans is None:
            meta.plans = self.plan(meta, q)
        k_pool, v_pool = self.kv_pool.k[layer], self.kv_pool.v[layer]  # [NB, BS, Hkv, D]
        scales = self.kv_pool.scales(layer)
        if scales is None:
            write_kv_planned(k, v, k_pool, v_pool, meta.slot_mapping)
        else:  # int8: quantize, then scatter
            write_kv(k, v, k_pool, v_pool, meta.slot_mapping, scales=scales)
        plans = meta.plans
        decode = self.decode
        # a pure decode step: no copy into `out`
        if plans.decode is not None and not plans.prefills:
            return decode(q, k_pool, v_pool, plans.decode, self.scale, scales)[None]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, H, D] contiguous
        if plans.decode is not None:
            rows = meta.decode_rows
            out[rows] = decode(q[rows], k_pool, v_pool, plans.decode, self.scale, scales)
        c_chunks = (plans.c_chunks if heads_side_by_side(k) and heads_side_by_side(v)
                    else frozenset())
        if c_chunks:  # the whole prompts, straight from the QKV projection's rows into `out`
            flash_prefill_planned(q, k, v, self.scale, plans.c_prefill, out)
        for i, (chunk, plan) in enumerate(zip(meta.prefills, plans.prefills, strict=True)):
            if i in c_chunks:
                continue
            rows = slice(chunk.lo, chunk.hi)
            out[rows] = prefill_planned(q[rows], k_pool, v_pool, plan, self.scale, scales,
                                        fresh=(k[rows], v[rows]))
        return out[None]  # [1, N, H, D]


def prefill_race(dtype: torch.dtype, H: int, Hkv: int, D: int):
    """T -> (C flash-prefill ms, torch fused-attention ms) for one whole T-token prompt of random
    q/k/v: what engine/fast/tuning.py races to find how long a prompt the C kernel should take."""
    from engine.fast.tuning import race_ms
    from kernels.paged_attention.sdpa import _attend_causal

    def race(T: int) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(T, H, D, generator=gen).to(dtype)  # [T, H, D]
        k, v = (torch.randn(T, Hkv, D, generator=gen).to(dtype) for _ in range(2))  # [T, Hkv, D]
        bounds, out, scale = torch.tensor([[0, T]], dtype=torch.int64), torch.empty_like(q), D**-0.5
        ms = race_ms({"c": lambda: flash_prefill_planned(q, k, v, scale, bounds, out),
                      "torch": lambda: _attend_causal(q[None], k[None], v[None], scale)}, repeats=3)
        return ms["c"], ms["torch"]
    return race

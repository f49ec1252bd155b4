"""One step's forward: pack the scheduled tokens of many requests into ONE row, run the model once.

No padding: the tokens of every scheduled request are laid end to end, each with its own position
and its own KV slot. A step with two decodes and a prefill chunk of 3 tokens:

    packed row        a5  b9 | c0  c1  c2          input_ids [1, N = 5]
    positions         5   9  | 0   1   2           positions [1, N]: RoPE angle of each token
    slot_mapping      37  70 | 4   5   6           where each token's K/V is written in the pools
    kind              decode | prefill chunk [0, 3)
    logits needed     a5  b9 |         c2          only the last token of a request that samples

Inside every layer, `PagedAttention.forward` writes the new K/V into their slots, then computes
attention per kind: all decode rows at once through `paged_decode_attention` (each reads its own
past through its block table), and each prefill chunk through `paged_prefill_attention`
(causal inside the chunk, and it sees its earlier chunks through the block table). The other
layers (projections, MLP, norms) never mix tokens, so one packed row serves them all.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.kv.block_manager import BlockManager, BlockMove
from engine.kv.kv_pool import PagedKVPool
from engine.model import LlamaModel
from engine.fast.native_layers import NativeLayers, native_layers_or_none
from engine.fast.packed_linear import bf16_instructions
from engine.scheduler import ScheduledWork
from kernels.flash_prefill.cpu_native import flash_prefill_planned
from kernels.flash_prefill.cpu_native import why_native_cannot_run as why_c_prefill_cannot_run
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
    why_native_cannot_run,
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

INDEX = torch.int32  # block tables and lengths, as the paged kernels expect
# The native backend's whole prompts go to the C flash-prefill kernel (kernels/flash_prefill/cpu_native.c), all of
# a step's in one call, except bf16 prompts of this many tokens or more where the CPU has bf16 instructions: there
# torch's flash kernel (AMX) overtook the C kernel's fp32 FMAs at ~500 tokens (Sapphire Rapids, 2 threads: C 1.2-1.9x
# faster at 100-255 tokens, 0.94x at 511, 0.58x at 1,023). fp32 prompts: C 1.1-1.8x faster up to 2,048 tokens.
C_PREFILL_BF16_MAX_TOKENS = 512


def _heads_side_by_side(t: Tensor) -> bool:
    """[N, heads, D] rows whose heads lie next to each other (any row stride): what the C flash-prefill kernel reads."""
    return t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


@dataclass
class PrefillChunk:
    """Rows [lo, hi) of the packed batch are positions `positions` of one sequence."""

    lo: int
    hi: int
    block_table: Tensor  # [num_blocks_of_seq] int32
    positions: Tensor  # [hi - lo] int64


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about the packed batch (an argument, never a global)."""

    slot_mapping: Tensor  # [N] int64: KV slot of every token
    decode_rows: Tensor  # [Bd] int64: rows of the packed batch that are decode tokens
    decode_block_tables: Tensor  # [Bd, max_blocks] int32, padded with 0 (never read past seq_lens)
    decode_seq_lens: Tensor  # [Bd] int32: cached tokens of each decode sequence, the new one included
    prefills: list[PrefillChunk] = field(default_factory=list)
    sample_rows: Tensor | None = None  # [S] int64: rows whose logits we sample from
    plans: StepPlans | None = None  # the planned backends' checked indices and masks, built at the first layer


@dataclass
class StepPlans:
    """What the sdpa and native backends compute once per step instead of once per layer
    (kernels/paged_attention/sdpa.py, cpu_native.py): the decode rows' gather index and mask (sdpa) or their
    tables made ready for C (native), one plan per prefill chunk; the slots and tables have been checked."""

    decode: DecodePlan | NativeDecodePlan | None
    prefills: list[PrefillPlan]
    c_prefill: Tensor | None = None  # [B, 2] int64 (lo, hi): the whole prompts the C flash-prefill kernel takes
    c_chunks: frozenset = frozenset()  # their indices in meta.prefills


class PagedAttention:
    """The attention backend: reads and writes the paged KV cache through a `PagedKVPool`.

    It holds no tensors of its own: the pool (engine/kv/kv_pool.py) owns them and does the block
    copies. `backend`: "torch" (the reference), "sdpa" (its fast batched twin), "native" (decode in C
    straight from the pools, a step's whole prompts in one C flash-prefill call, other prefill chunks as sdpa),
    "triton" or "cuda", or "auto": native where it can run (a
    CPU, a C compiler, fp32/bf16/int8 pools), else sdpa. A named backend that cannot run falls back with
    a warning ("native" to "sdpa", the others to "torch").
    """

    def __init__(self, kv_pool: PagedKVPool, backend: str = "torch", sliding_window: int | None = None):
        self.kv_pool = kv_pool
        self.sliding_window = sliding_window  # Mistral: each query reads at most its last W positions
        self.scale = kv_pool.head_dim ** -0.5  # the 1/sqrt(D) of scaled dot-product attention
        if backend == "auto":
            backend = "native" if why_native_cannot_run(kv_pool.device, kv_pool.dtype) is None else "sdpa"
        self.backend = resolve_backend(backend, kv_pool.device, kv_pool.dtype)  # warns once here, not per layer
        if self.backend == "cuda" and kv_pool.dtype == torch.int8:
            warnings.warn("the CUDA paged-attention kernel has no int8 variant: int8 KV runs on 'torch'",
                          RuntimeWarning, stacklevel=2)
            self.backend = "torch"

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        if self.backend in ("sdpa", "native"):
            return self._forward_planned(layer, q, k, v, meta)
        q, k, v = q[0], k[0], v[0]  # [N, H, D], [N, Hkv, D]: the packed batch is one row
        k_pool, v_pool = self.kv_pool.k[layer], self.kv_pool.v[layer]  # [NB, BS, Hkv, D]
        scales = self.kv_pool.scales(layer)  # int8 KV: (k_scale, v_scale) [NB, BS, Hkv]; else None
        write_kv(k, v, k_pool, v_pool, meta.slot_mapping, backend=self.backend, scales=scales)
        out = torch.empty_like(q)  # [N, H, D]
        if meta.decode_rows.numel():
            rows = meta.decode_rows
            out[rows] = paged_decode_attention(q[rows], k_pool, v_pool, meta.decode_block_tables,
                                               meta.decode_seq_lens, self.scale, backend=self.backend,
                                               sliding_window=self.sliding_window, scales=scales)
        for chunk in meta.prefills:
            out[chunk.lo:chunk.hi] = paged_prefill_attention(
                q[chunk.lo:chunk.hi], k_pool, v_pool, chunk.block_table, chunk.positions, self.scale,
                backend=self.backend, sliding_window=self.sliding_window, scales=scales)
        return out[None]  # [1, N, H, D]

    def plan(self, meta: AttentionMetadata, q: Tensor) -> StepPlans:
        """Check the step's slots and tables and build the sdpa gathers and masks: once per step, not per layer."""
        k_pool, v_pool, scales = self.kv_pool.k[0], self.kv_pool.v[0], self.kv_pool.scales(0)
        check_slots(meta.slot_mapping, k_pool, v_pool, scales)
        decode = None
        if meta.decode_rows.numel() and self.backend == "native":
            decode = plan_decode_native(meta.decode_block_tables, meta.decode_seq_lens, self.sliding_window)
            check_block_tables(decode.block_tables, decode.seq_lens, k_pool.shape[0], k_pool.shape[1],
                               first_positions=None if self.sliding_window is None else
                               first_visible_position(decode.seq_lens, self.sliding_window))
        elif meta.decode_rows.numel():
            decode = plan_decode(meta.decode_block_tables, meta.decode_seq_lens, k_pool.shape[1], k_pool.shape[0],
                                 self.sliding_window)
        prefills = [plan_prefill(q[c.lo:c.hi], k_pool, v_pool, c.block_table, c.positions, self.scale,
                                 self.sliding_window, scales) for c in meta.prefills]
        picked = self._c_prefill_chunks(meta, prefills, q, k_pool.dtype, scales)
        if not picked:
            return StepPlans(decode, prefills)
        bounds = torch.tensor([(meta.prefills[i].lo, meta.prefills[i].hi) for i in picked], dtype=torch.int64)
        return StepPlans(decode, prefills, bounds, frozenset(picked))

    def _c_prefill_chunks(self, meta: AttentionMetadata, prefills: list[PrefillPlan], q: Tensor,
                          pool_dtype: torch.dtype, scales) -> list[int]:
        """The prefill chunks the C flash-prefill kernel takes: whole prompts (no mask: query i at position i, no
        window) whose fresh K/V are what the pools hold (float pools of the model's dtype), on the native backend;
        see C_PREFILL_BF16_MAX_TOKENS for bf16."""
        if self.backend != "native" or not meta.prefills or scales is not None or q.dtype != pool_dtype:
            return []
        if not _heads_side_by_side(q) or why_c_prefill_cannot_run(q) is not None:
            return []
        long_bf16 = C_PREFILL_BF16_MAX_TOKENS if q.dtype == torch.bfloat16 and bf16_instructions() else None
        return [i for i, (c, plan) in enumerate(zip(meta.prefills, prefills, strict=True))
                if plan.mask is None and (long_bf16 is None or c.hi - c.lo < long_bf16)]

    def _forward_planned(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """The sdpa and native backends: the same work as `forward`, with the step's checks and indices done
        at layer 0."""
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
        decode = decode_native_planned if self.backend == "native" else decode_planned
        if plans.decode is not None and not plans.prefills:  # a pure decode step: no copy into `out`
            return decode(q, k_pool, v_pool, plans.decode, self.scale, scales)[None]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, H, D] contiguous
        if plans.decode is not None:
            out[meta.decode_rows] = decode(q[meta.decode_rows], k_pool, v_pool, plans.decode, self.scale, scales)
        c_chunks = plans.c_chunks if _heads_side_by_side(k) and _heads_side_by_side(v) else frozenset()
        if c_chunks:  # the whole prompts, straight from the QKV projection's rows into `out`
            flash_prefill_planned(q, k, v, self.scale, plans.c_prefill, out)
        for i, (chunk, plan) in enumerate(zip(meta.prefills, plans.prefills, strict=True)):
            if i in c_chunks:
                continue
            rows = slice(chunk.lo, chunk.hi)
            out[rows] = prefill_planned(q[rows], k_pool, v_pool, plan, self.scale, scales, fresh=(k[rows], v[rows]))
        return out[None]  # [1, N, H, D]


def build_batch(work: list[ScheduledWork], block_manager: BlockManager, device) -> tuple[Tensor, Tensor,
                                                                                         AttentionMetadata]:
    """Pack the scheduled work: input_ids [1, N], positions [1, N] and the AttentionMetadata."""
    ids, positions, slots, sample_rows = [], [], [], []
    decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
    for w in work:
        lo = len(ids)
        ids += w.request.all_token_ids[w.start:w.end]
        positions += range(w.start, w.end)
        slots += w.slots
        table = block_manager.block_table(w.request.seq_id)
        if w.phase == "decode":
            decode_rows.append(lo)
            decode_tables.append(table)
            decode_lens.append(w.end)
        else:
            prefills.append(PrefillChunk(lo, len(ids), torch.tensor(table, dtype=INDEX, device=device),
                                         torch.arange(w.start, w.end, device=device)))
        if w.samples:
            sample_rows.append(len(ids) - 1)
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        decode_block_tables=torch.tensor(padded, dtype=INDEX, device=device).reshape(len(padded), width),
        decode_seq_lens=torch.tensor(decode_lens, dtype=INDEX, device=device),
        prefills=prefills,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
    )
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, N]
    return input_ids, torch.tensor([positions], device=device), meta  # positions [1, N]


class ModelRunner:
    """Runs a step's forward in this process: the block moves, the packed batch, the model.

    The parallel executors (engine/parallel/executor.py) have the same `execute`, and spread it over ranks."""

    def __init__(self, model: LlamaModel, attention: PagedAttention, layer_backend: str = "python"):
        self.attention, self.kv_pool, self.layer_backend = attention, attention.kv_pool, layer_backend
        self.model = model

    @property
    def model(self) -> LlamaModel:
        return self._model

    @model.setter
    def model(self, model: LlamaModel) -> None:
        """A new model (new packed weights, a pruned copy) gets new C layer descriptors, or none."""
        self._model = model
        self.native_layers = native_layers_or_none(model, self.attention, self.layer_backend)

    def execute(self, moves: list[BlockMove], work: list[ScheduledWork],
                block_manager: BlockManager) -> tuple[dict[str, int], Tensor | None]:
        """Apply the block moves (in order, even when nothing runs), then the forward; returns the blocks moved
        per kind and the logits [S, V] of the rows that sample (None when there is no work)."""
        moved = self.kv_pool.apply_moves(moves)
        if not work:
            return moved, None
        input_ids, positions, meta = build_batch(work, block_manager, self.kv_pool.device)
        return moved, run_model(self.model, self.attention, input_ids, positions, meta, self.native_layers)


@torch.inference_mode()
def run_model(model: LlamaModel, attention: PagedAttention, input_ids: Tensor, positions: Tensor,
              meta: AttentionMetadata, native_layers: NativeLayers | None = None) -> Tensor:
    """The model's layers over the packed row, then norm + lm_head on the sampled rows only: [S, V].

    This is `LlamaModel.forward` with its last two lines applied to S rows instead of N: with
    long prefill chunks most rows never need logits, and lm_head is the widest matmul (E x V).
    A decode step of a few sequences runs every layer in one C call where `native_layers` is given
    (engine/fast/native_layers.py): the same arithmetic, without ~540 small torch ops.
    """
    x = model.embed_tokens(input_ids)  # [1, N, E]
    cos, sin = model.rope(positions, x.dtype)  # [1, N, 1, D]
    if native_layers is not None and native_layers.covers(meta):
        x = native_layers.forward(x, cos, sin, meta)
    else:
        for layer in model.layers:
            x = layer(x, cos, sin, attention, meta)
    hidden = x[0, meta.sample_rows]  # [S, E]
    return model.lm_head(model.norm(hidden))  # [S, V]

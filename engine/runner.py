"""One step's forward: pack the scheduled tokens of many requests into ONE row, run the model once.

No padding: the tokens of every scheduled request are laid end to end, each with its own position
and its own KV slot. A step with two decodes and a prefill chunk of 3 tokens:

    packed row        a5  b9 | c0  c1  c2          input_ids [1, N = 5]
    positions         5   9  | 0   1   2           positions [1, N]: RoPE angle of each token
    slot_mapping      37  70 | 4   5   6           where each token's K/V is written in the pools
    kind              decode | prefill chunk [0, 3)
    logits needed     a5  b9 |         c2          the scored rows: the last token of a request
                                                   that samples

Inside every layer, `PagedAttention.forward` writes the new K/V into their slots, then computes
attention per kind: all decode rows at once through `paged_decode_attention` (each reads its own
past through its block table), and each prefill chunk through `paged_prefill_attention`
(causal inside the chunk, and it sees its earlier chunks through the block table). The other
layers (projections, MLP, norms) never mix tokens, so one packed row serves them all.

A request may ask for the logits of its last `num_scored` rows instead of one (speculative decoding
verifies several guessed tokens in one forward): those rows are all kept, in order.

This file is the readable path (`speed="reference"`): every layer of engine/model.py runs in Python
and attention is kernels/paged_attention/reference.py. The fast wing (engine/fast/, `speed="fast"`)
plugs in through the two seams defined here, handed over as an `Acceleration` by engine/speed.py:
- an attention backend: any object with `PagedAttention`'s `forward` (and its `kv_pool`, `scale`,
  `sliding_window` and `backend` name);
- a `DecodeStep`: something that runs ALL layers of the steps it `covers` in one go (C layers today,
  a CUDA graph tomorrow); every other step runs `model.layers` one by one, here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from engine.kv.block_manager import BlockManager, BlockMove
from engine.kv.kv_pool import PagedKVPool
from engine.model import LlamaModel
from engine.sampling import argmax_rows
from engine.scheduler import ScheduledWork
from kernels.paged_attention.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)

INDEX = torch.int32  # block tables and lengths, as the paged kernels expect


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
    decode_seq_lens: Tensor  # [Bd] int32: cached tokens of each decode sequence, new one included
    prefills: list[PrefillChunk] = field(default_factory=list)
    sample_rows: Tensor | None = None  # [S] int64: the scored rows, whose logits we keep
    plans: Any = None  # a backend's per-step work (checked indices, masks), made at layer 0


class PagedAttention:
    """The reference attention backend: reads and writes the paged KV cache of a `PagedKVPool`.

    It holds no tensors of its own: the pool (engine/kv/kv_pool.py) owns them and does the block
    copies. Each layer writes the new tokens' K/V into their slots, then attends: every decode row
    at once against its own past (through its block table), and each prefill chunk causally.
    """

    backend = "torch"  # the name the trace records; the fast wing's backends have their own

    def __init__(self, kv_pool: PagedKVPool, sliding_window: int | None = None):
        self.kv_pool = kv_pool
        # Mistral: each query reads at most its last W positions
        self.sliding_window = sliding_window
        self.scale = kv_pool.head_dim ** -0.5  # the 1/sqrt(D) of scaled dot-product attention

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                meta: AttentionMetadata) -> Tensor:
        q, k, v = q[0], k[0], v[0]  # [N, H, D], [N, Hkv, D]: the packed batch is one row
        k_pool, v_pool = self.kv_pool.k[layer], self.kv_pool.v[layer]  # [NB, BS, Hkv, D]
        scales = self.kv_pool.scales(layer)  # int8 KV: (k_scale, v_scale) [NB, BS, Hkv]; else None
        write_kv_ref(k, v, k_pool, v_pool, meta.slot_mapping, scales)
        out = torch.empty_like(q)  # [N, H, D]
        if meta.decode_rows.numel():
            rows = meta.decode_rows
            out[rows] = paged_decode_attention_ref(q[rows], k_pool, v_pool,
                                                   meta.decode_block_tables,
                                                   meta.decode_seq_lens, self.scale,
                                                   self.sliding_window, scales)
        for chunk in meta.prefills:
            rows = slice(chunk.lo, chunk.hi)
            out[rows] = paged_prefill_attention_ref(q[rows], k_pool, v_pool, chunk.block_table,
                                                    chunk.positions, self.scale,
                                                    sliding_window=self.sliding_window,
                                                    scales=scales)
        return out[None]  # [1, N, H, D]


class DecodeStep(Protocol):
    """Runs every decoder layer of the steps it covers in one go (the fast wing's C layers)."""

    def covers(self, meta: AttentionMetadata) -> bool:
        """Is this step its work? (e.g. decodes only, at most a few rows)"""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        """x [1, N, E] embedded, cos/sin [1, N, 1, D] -> x after the last layer, [1, N, E]."""


@dataclass
class Acceleration:
    """What a runner computes with: the model (the one given, or the fast wing's transformed copy),
    its attention backend, an optional `DecodeStep`, the greedy argmax, and what was chosen and
    why."""

    model: nn.Module
    attention: PagedAttention  # the reference, or a fast-wing subclass with the same forward
    decode_step: DecodeStep | None = None
    argmax: Callable[[Tensor], Tensor] = argmax_rows
    choices: dict[str, str] = field(default_factory=dict)  # e.g. {"attention": "native"}
    reasons: dict[str, str] = field(default_factory=dict)  # why each choice, in words


def build_batch(work: list[ScheduledWork], block_manager: BlockManager,
                device) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """Pack the scheduled work: input_ids [1, N], positions [1, N] and the AttentionMetadata."""
    ids, positions, slots, sample_rows = [], [], [], []
    decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
    for w in work:
        lo = len(ids)
        ids += w.fed_token_ids()
        positions += range(w.start, w.end)
        slots += w.slots
        table = block_manager.block_table(w.request.seq_id)
        if w.phase == "decode":
            # One decode row per fed token: a verify step's k + 1 rows share one block table and
            # row i reads i + 1 more positions than the cache held (every layer writes all rows'
            # K/V before any row attends, so row i sees the guesses before it: causal).
            for i in range(w.end - w.start):
                decode_rows.append(lo + i)
                decode_tables.append(table)
                decode_lens.append(w.start + i + 1)
        else:
            prefills.append(PrefillChunk(lo, len(ids),
                                         torch.tensor(table, dtype=INDEX, device=device),
                                         torch.arange(w.start, w.end, device=device)))
        sample_rows += range(len(ids) - w.num_scored, len(ids))  # the work's last num_scored rows
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        decode_block_tables=torch.tensor(padded, dtype=INDEX,
                                         device=device).reshape(len(padded), width),
        decode_seq_lens=torch.tensor(decode_lens, dtype=INDEX, device=device),
        prefills=prefills,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
    )
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, N]
    return input_ids, torch.tensor([positions], device=device), meta  # positions [1, N]


class ModelRunner:
    """Runs a step's forward in this process: the block moves, the packed batch, the model.

    The parallel executors (engine/parallel/executor.py) have the same `execute`, and spread it over
    ranks."""

    def __init__(self, acceleration: Acceleration):
        self.load(acceleration)

    def load(self, acceleration: Acceleration) -> None:
        """Compute with a new model (new weights, a pruned copy): the engine hands over a new
        Acceleration."""
        self.acceleration = acceleration
        self.model, self.attention = acceleration.model, acceleration.attention
        self.kv_pool, self.decode_step = self.attention.kv_pool, acceleration.decode_step

    def execute(self, moves: list[BlockMove], work: list[ScheduledWork],
                block_manager: BlockManager) -> tuple[dict[str, int], Tensor | None]:
        """Apply the block moves (in order, even when nothing runs), then the forward; returns the
        blocks moved per kind and the logits [S, V] of the scored rows (None when there is no
        work)."""
        moved = self.kv_pool.apply_moves(moves)
        if not work:
            return moved, None
        input_ids, positions, meta = build_batch(work, block_manager, self.kv_pool.device)
        return moved, run_model(self.model, self.attention, input_ids, positions, meta,
                                self.decode_step)


@torch.inference_mode()
def run_model(model: LlamaModel, attention, input_ids: Tensor, positions: Tensor,
              meta: AttentionMetadata, decode_step: DecodeStep | None = None) -> Tensor:
    """The model's layers over the packed row, then norm + lm_head on the scored rows only: [S, V].

    This is `LlamaModel.forward` with its last two lines applied to S rows instead of N: with
    long prefill chunks most rows never need logits, and lm_head is the widest matmul (E x V).
    """
    x = model.embed_tokens(input_ids)  # [1, N, E]
    cos, sin = model.rope(positions, x.dtype)  # [1, N, 1, D]
    if decode_step is not None and decode_step.covers(meta):
        x = decode_step.forward(x, cos, sin, meta)  # every layer at once (speed="fast" only)
    else:
        for layer in model.layers:
            x = layer(x, cos, sin, attention, meta)
    hidden = x[0, meta.sample_rows]  # [S, E]
    return model.lm_head(model.norm(hidden))  # [S, V]

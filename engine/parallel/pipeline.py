"""Pipeline parallelism: the layers split into stages, one stage per rank,
micro-batches to fill the pipe.

Stage s holds a contiguous slice of the layers (and its share of the KV cache: those layers only).
A token's hidden state [N, E] goes through stage 0, is SENT to stage 1, and so on; the last stage
applies the final norm and the LM head and sends the logits back to rank 0, which samples:

    rank 0:  embed ─► layers 0..L/2-1 ──send [N, E]──►  rank 1:  layers L/2..L-1 ─► norm ─► lm_head
       ▲                                                                                       │
       └──────────────────────────── send logits [S, V] ◄───────────────────────────────────────┘

One batch alone keeps only one stage busy at a time: with P stages each works 1/P of the time. So
we cut the step's requests into M micro-batches: while stage 1 works on micro-batch 1, stage 0
already works on micro-batch 2. With equal stages of time t per micro-batch the step takes
(M + P - 1) t instead of M P t, and the idle share (the "bubble") is (P - 1) / (M + P - 1):

    stage 0 | mb1 | mb2 | mb3 |     |
    stage 1 |     | mb1 | mb2 | mb3 |      P = 2, M = 3: bubble = 1 / 4 of the stage-time
             ─────────── time ───────►

A micro-batch is a group of whole requests: each request's attention reads only its own blocks,
so the groups are independent. Sends are asynchronous (`isend`): stage 0 goes on to the next
micro-batch while the previous one is on the wire. `StageTimeline` records when each stage worked
on each micro-batch, so chapter 08 can draw the picture above from a real step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from engine.model import LlamaModel
from engine.parallel.comm import Comm
from engine.parallel.tensor_parallel import shallow_copy


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The layers of `stage`: contiguous, as equal as can be, the first stages one
    longer when it doesn't divide."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} is more stages than the model's "
                         f"num_hidden_layers={num_layers}: every stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def split_into_micro_batches(items: list, num_micro_batches: int, weight=len) -> list[list]:
    """Cut `items` (in order) into at most `num_micro_batches` contiguous
    non-empty groups of similar weight."""
    if not items:
        return []
    total = sum(weight(i) for i in items)
    groups, current, done = [], [], 0
    for item in items:
        current.append(item)
        done += weight(item)
        if (done >= total * (len(groups) + 1) / num_micro_batches
                and len(groups) < num_micro_batches - 1):
            groups.append(current)
            current = []
    return groups + ([current] if current else [])


def make_stage(model: LlamaModel, stage: int, num_stages: int) -> LlamaModel:
    """A copy of `model` with only `stage`'s layers (renumbered from 0, so they index this stage's
    KV pool); the embedding stays on the first stage, the final norm and LM head on the last."""
    keep = stage_layers(model.config.num_hidden_layers, num_stages, stage)
    shard = shallow_copy(model)  # the same parameter tensors, our own module tree
    layers = []
    for local, index in enumerate(keep):
        layer = shallow_copy(model.layers[index])
        layer.self_attn = shallow_copy(layer.self_attn)
        layer.self_attn.layer = local  # this stage's KV pool has len(keep) layers
        layers.append(layer)
    shard.layers = nn.ModuleList(layers)
    if stage != 0:
        shard.embed_tokens = None
    if stage != num_stages - 1:
        shard.norm, shard.lm_head = None, None
    shard.layer_range = keep
    return shard.eval()


@dataclass
class StageTimeline:
    """When each stage worked on each micro-batch in one step:
    (stage, micro_batch, start_s, end_s) on the machine's monotonic clock
    (time.perf_counter: comparable between processes of one machine)."""

    spans: list[tuple[int, int, float, float]] = field(default_factory=list)

    def bubble_fraction(self) -> float:
        """Idle share of the stages between the first start and the last end:
        1 - busy / (P x span)."""
        if not self.spans:
            return 0.0
        start, end = min(s[2] for s in self.spans), max(s[3] for s in self.spans)
        stages = {s[0] for s in self.spans}
        busy = sum(s[3] - s[2] for s in self.spans)
        return 1.0 - busy / (len(stages) * (end - start)) if end > start else 0.0


@torch.inference_mode()
def run_stage(stage_model: LlamaModel, attention, batches: list, comm: Comm, stage: int,
              num_stages: int, timeline: StageTimeline) -> Tensor | None:
    """This rank's part of a pipelined step over `batches` [(input_ids, positions, meta), ...];
    rank 0 returns the logits [S, V] of all micro-batches in order, other ranks None."""
    first, last = stage == 0, stage == num_stages - 1
    dtype, E = stage_model.layers[0].input_layernorm.weight.dtype, stage_model.config.hidden_size
    pending, logits = [], []
    for mb, (input_ids, positions, meta) in enumerate(batches):
        x = (stage_model.embed_tokens(input_ids) if first
             else comm.recv((1, input_ids.shape[1], E), dtype, stage - 1))
        t0 = time.perf_counter()
        cos, sin = stage_model.rope(positions, x.dtype)  # [1, N, 1, D]
        for layer in stage_model.layers:
            x = layer(x, cos, sin, attention, meta)  # [1, N, E]
        if last:
            x = stage_model.lm_head(stage_model.norm(x[0, meta.sample_rows]))  # [S, V]
        timeline.spans.append((stage, mb, t0, time.perf_counter()))
        if last and first:
            logits.append(x)
        elif not last:
            pending.append(comm.isend(x, stage + 1))
        # a micro-batch of non-final prefill chunks has no logits to send
        elif len(meta.sample_rows):
            pending.append(comm.isend(x, 0))
    for work in pending:
        comm.wait(work)
    if first and not last:  # rank 0 collects what the last stage computed
        V = stage_model.config.vocab_size
        logits = [comm.recv((len(meta.sample_rows), V), dtype, num_stages - 1)
                  for _, _, meta in batches if len(meta.sample_rows)]
    if first and not logits:
        return torch.empty(0, stage_model.config.vocab_size, dtype=dtype)
    return torch.cat(logits) if first else None

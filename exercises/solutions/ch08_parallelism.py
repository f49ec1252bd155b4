"""Chapter 08 reference answers: a linear layer split column- and row-wise (and run as W simulated
ranks), the bytes a tensor-parallel group all-reduces per token, the pipeline bubble, and the
smallest TP that fits."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.companions.memory import dtype_bytes, kv_bytes_per_token
from engine.config import ModelConfig

# attention's o_proj and the MLP's down_proj are row-parallel: one all-reduce each
ALLREDUCES_PER_LAYER = 2
# a ring all-reduce is a reduce-scatter and then an all-gather, each (W - 1)/W of the message
RING_PASSES = 2
# engine/companions/memory.py's ACTIVATION_RESERVE_FRACTION: kept back for activations
RESERVE_FRACTION = 0.10


def column_shard(weight: torch.Tensor, bias: torch.Tensor | None, rank: int,
                 world: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank `rank`'s output rows of an nn.Linear weight [out, in] (and of its bias [out])."""
    out = weight.shape[0]
    base, extra = divmod(out, world)  # the first `extra` ranks get one row more
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    return weight[start:stop], None if bias is None else bias[start:stop]  # [out_r, in], [out_r]


def row_shard(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s input columns of an nn.Linear weight [out, in]: [out, in_r]."""
    n_in = weight.shape[1]
    base, extra = divmod(n_in, world)  # the first `extra` ranks get one column more
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    return weight[:, start:stop]  # [out, in_r]


def tensor_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           world: int, kind: str) -> torch.Tensor:
    """F.linear(x, weight, bias) computed by `world` simulated ranks,
    split by `kind` ("column" or "row")."""
    if kind == "column":
        # W x [..., out_r]
        parts = [F.linear(x, *column_shard(weight, bias, rank, world)) for rank in range(world)]
        # the all-gather: the ranks' outputs side by side, [..., out]
        return torch.cat(parts, dim=-1)
    if kind == "row":
        total, start = None, 0
        for rank in range(world):
            w = row_shard(weight, rank, world)  # [out, in_r]
            # [..., out]: this rank's partial sum
            partial = F.linear(x[..., start:start + w.shape[1]], w)
            total = partial if total is None else total + partial  # all-reduce adds W partial sums
            start += w.shape[1]
        return total if bias is None else total + bias  # the bias once, after the sum
    raise ValueError(f"kind={kind!r} must be 'column' or 'row'")


def allreduce_bytes_per_token(model: ModelConfig, tp: int, dtype) -> float:
    """Bytes each GPU of a TP group sends per token:
    L x 2 all-reduces x 2 (TP - 1)/TP x E x bytes."""
    if tp < 1:
        raise ValueError(f"tp={tp!r} must be >= 1 (GPUs in the tensor-parallel group)")
    # one token's [E] output of o_proj or down_proj
    message = model.hidden_size * dtype_bytes(dtype)
    per_allreduce = RING_PASSES * (tp - 1) / tp * message
    return model.num_hidden_layers * ALLREDUCES_PER_LAYER * per_allreduce


def pipeline_bubble(num_stages: int, num_micro_batches: int) -> float:
    """The idle share of P stages running M equal micro-batches: (P - 1) / (M + P - 1)."""
    for name, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    P, M = num_stages, num_micro_batches
    return (P - 1) / (M + P - 1)  # P x (M + P - 1) stage-slots, M x P of them busy


def pick_layout(model: ModelConfig, device_memory_bytes: int, num_devices: int, context_tokens: int,
                dtype="bf16") -> tuple[int, int]:
    """The smallest TP whose shard fits one sequence of `context_tokens`, and the replicas:
    (tp, num_devices // tp)."""
    H, Hkv, I = model.num_attention_heads, model.num_key_value_heads, model.intermediate_size
    reserve = math.ceil(device_memory_bytes * RESERVE_FRACTION)
    for tp in range(1, num_devices + 1):
        if H % tp or I % tp or (Hkv % tp and tp % Hkv):
            continue  # whole query heads, whole MLP columns, whole (or copied) KV heads per GPU
        shard = replace(model, num_attention_heads=H // tp, num_key_value_heads=max(1, Hkv // tp),
                        intermediate_size=I // tp, vocab_size=math.ceil(model.vocab_size / tp))
        # one GPU's share of the weights
        weights = math.ceil(shard.num_params() * dtype_bytes(dtype))
        # one sequence's KV, this GPU's heads
        kv = context_tokens * kv_bytes_per_token(shard, dtype)
        if weights + reserve + kv <= device_memory_bytes:
            return tp, num_devices // tp
    raise ValueError(f"num_devices={num_devices}: no TP from 1 to {num_devices} fits {model.name} "
                     f"with {context_tokens:,} tokens of context in {device_memory_bytes:,} "
                     "bytes a GPU; add GPUs, take bigger ones, shorten the context or use "
                     "a smaller dtype")

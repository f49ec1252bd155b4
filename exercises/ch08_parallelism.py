"""Chapter 08 exercises: split a linear layer column- and row-wise and check it against the
whole matmul, count the bytes tensor parallelism all-reduces per token, the pipeline bubble,
and pick a layout.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch08

nn.Linear keeps its weight as [out, in] and computes y = x W^T + b. Megatron-LM splits it two ways:

    column-parallel: split the OUTPUTS          row-parallel: split the INPUTS

             in                                       in_0   in_1
          +------+                                  +------+------+
    out_0 |rank 0|  y_0 = x W_0^T + b_0         out |rank 0|rank 1|  p_r = x[..., in_r] W_r^T
          +------+                                  |      |      |  (a partial sum of ALL outputs)
    out_1 |rank 1|  y_1 = x W_1^T + b_1             +------+------+
          +------+
    all-gather: y = [y_0 | y_1]                     all-reduce: y = p_0 + p_1, then + b ONCE

When W ranks do not divide n rows (or columns) evenly, split them as evenly as can be, the first
n % W ranks one longer (as engine/parallel/pipeline.py's stage_layers splits layers): 10 rows over
4 ranks are 3, 3, 2, 2. (The engine's own TP layers split only evenly, because a rank must hold
whole heads.)

`allreduce_bytes_per_token` has the engine's name and signature (engine/companions/placement.py),
and the engine's version passes the same checks; try not to peek until yours does.
"""

from __future__ import annotations

import math  # noqa: F401
from dataclasses import replace  # noqa: F401

import torch
import torch.nn.functional as F  # noqa: F401

from engine.companions.memory import dtype_bytes, kv_bytes_per_token  # noqa: F401
from engine.config import ModelConfig

# engine/companions/memory.py's ACTIVATION_RESERVE_FRACTION: kept back for activations
RESERVE_FRACTION = 0.10


def column_shard(weight: torch.Tensor, bias: torch.Tensor | None, rank: int,
                 world: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank `rank`'s share of a column-parallel nn.Linear: its output features.

    weight [out, in], bias [out] or None. Returns (weight rows [out_r, in], bias [out_r] or None),
    where out_r is rank's share of `out` split `world` ways (the first out % world ranks one
    row longer).
    """
    raise NotImplementedError(
        "which dimension of nn.Linear's [out, in] weight holds the outputs? When world does not "
        "divide it, where does rank r's share start and stop?")


def row_shard(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s share of a row-parallel nn.Linear: its input features,
    weight columns [out, in_r].

    (No bias here: the bias is added once, after the all-reduce, by tensor_parallel_linear.)
    """
    raise NotImplementedError(
        "which dimension holds the inputs? Can column_shard's arithmetic do the split?")


def tensor_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           world: int, kind: str) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., in],
    computed by `world` simulated ranks in this one process.

    kind="column": each rank computes its outputs from the whole x with its column_shard; the
    "all-gather" puts them side by side. kind="row": each rank multiplies its slice of x's input
    features by its row_shard; the "all-reduce" adds the partial sums; the bias goes on once, at the
    end. A ValueError naming kind for anything else. The result must equal F.linear up to float
    rounding.
    """
    raise NotImplementedError(
        "in a column split, what does each rank compute and how do the pieces combine? In a row "
        "split, which slice of x does a rank see, how do the partial sums combine, and how often "
        "is the bias added?")


def allreduce_bytes_per_token(model: ModelConfig, tp: int, dtype) -> float:
    """Bytes each GPU of a tensor-parallel group of `tp` sends per token, all layers together.

    Every layer all-reduces twice (after attention's o_proj and after the MLP's down_proj) a message
    of one token's [E] activations (model.hidden_size values of `dtype`: "fp32" 4 bytes,
    "bf16"/"fp16" 2, "fp8"/"int8" 1; engine.companions.memory.dtype_bytes knows them). A ring
    all-reduce of an n-byte message sends 2 (tp - 1) / tp x n bytes from each GPU: a reduce-scatter
    then an all-gather, (tp - 1) / tp each.
    Layers: model.num_hidden_layers.
    """
    raise NotImplementedError(
        "how many all-reduces does one layer do, how big is each message, and how many bytes does "
        "a ring all-reduce of an n-byte message send from each GPU?")


def pipeline_bubble(num_stages: int, num_micro_batches: int) -> float:
    """The idle share of P pipeline stages that run M equal micro-batches
    (each taking one slot a stage):

        stage 0 | mb1 | mb2 | mb3 |     |
        stage 1 |     | mb1 | mb2 | mb3 |      P = 2, M = 3: 2 of the 8 stage-slots idle = 1/4

    Count the idle stage-slots over all stage-slots from the first start to the last end. A
    ValueError naming the field unless both are ints >= 1.
    """
    raise NotImplementedError(
        "how many slots does the whole schedule take, and how many of the P x slots are busy? "
        "Which inputs make no sense?")


def pick_layout(model: ModelConfig, device_memory_bytes: int, num_devices: int, context_tokens: int,
                dtype="bf16") -> tuple[int, int]:
    """The smallest tensor-parallel size that fits, and how many replicas of it the devices hold:
    (tp, replicas).

    Try tp = 1, 2, ..., num_devices; skip a tp that does not split the model into whole pieces: it
    must divide num_attention_heads and intermediate_size, and either divide num_key_value_heads or
    be a multiple of it (then every GPU keeps ONE copied KV head, as vLLM does).
    One GPU of a TP group holds:

        H / tp query heads, max(1, Hkv // tp) KV heads, I / tp MLP columns,
        ceil(V / tp) rows of the embedding (and of the LM head, unless it is tied), whole norms

    which is itself a smaller model, so `dataclasses.replace` of `model` with those four numbers
    gives its `num_params()` and `engine.companions.memory.kv_bytes_per_token`.
    tp fits when, in bytes, on one GPU:

        ceil(params x dtype bytes) + ceil(device_memory_bytes x RESERVE_FRACTION)
            + context_tokens x KV per token <= device_memory_bytes

    (weights and KV both in `dtype`). replicas = num_devices // tp (the rest stay idle). A
    ValueError naming num_devices when no tp fits. (The models here have no sliding window.)
    """
    raise NotImplementedError(
        "which tp values split the heads and the MLP into whole pieces? For one that does, what "
        "does one GPU hold, and does that fit with the reserve and one sequence's KV?")

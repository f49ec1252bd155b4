"""Tensor parallelism: every layer's matmuls split over W ranks,
one all-reduce after each half-layer.

A Llama layer is two blocks, attention and MLP, and each is
"widen, work per head/per channel, narrow":

    attention:  x ─► q,k,v = x Wq, x Wk, x Wv ─► attention per head ─► o = heads Wo ─► x + o
    MLP:        x ─► g, u = x Wg, x Wu       ─► silu(g) * u per channel ─► d = h Wd ─► x + d

Megatron-LM's split (Shoeybi et al., 2019) cuts the WIDE dimension in both, so the middle needs no
communication at all:

    column-parallel  Wq, Wk, Wv, Wg, Wu   [E, out] cut by columns: rank r computes out/W of the
                                          outputs, i.e. its H/W query heads, Hkv/W KV heads,
                                          F/W MLP channels
    row-parallel     Wo, Wd               [in, E] cut by rows: rank r multiplies ITS part of the
                                          heads / channels and gets a PARTIAL sum of the full
                                          [T, E] result
    all-reduce       the W partial sums add up to exactly x Wo (or h Wd), on every rank

              rank 0                          rank 1
    x [T,E] ─► heads 0..H/2-1 ─► partial o₀    x [T,E] ─► heads H/2..H-1 ─► partial o₁
                         └──────────── all-reduce: o = o₀ + o₁ ────────────┘

So each layer costs two all-reduces of a [T, E] activation per rank, whatever the model's width
inside. The KV cache splits with the KV heads: each rank stores K/V for its Hkv/W heads only
(GQA keeps working, because query heads are cut in the same proportion, so a rank's query heads
use exactly its KV heads).

The vocabulary is split too (vocab-parallel embedding and LM head): rank r holds rows
[r Vp, (r+1) Vp) of the embedding matrix; a token's row lives on one rank, the others contribute
zeros, and an all-reduce assembles [T, E]. The LM head gives each rank Vp logits per token, and an
all-gather puts the V side by side. (Vp = ceil(V / W); the last rank's rows past V are zero
padding, cut off after the gather.)

Sums in a different order round differently: logits of a split model differ from the whole model's
by float rounding (~1e-6 relative in fp32), so greedy tokens agree except at near-ties.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.model import LlamaModel
from engine.parallel.comm import Comm
from engine.surgery import replaced


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming what `tp` must divide, if it does not."""
    for name, value in (("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            ok = [d for d in range(1, value + 1)
                  if value % d == 0 and cfg.num_attention_heads % d == 0
                  and cfg.num_key_value_heads % d == 0 and cfg.intermediate_size % d == 0]
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value} of this "
                             "model: every rank must get whole heads and channels; sizes that "
                             f"work: {ok}")


def _rows(weight: Tensor, rank: int, world: int) -> Tensor:
    """Rank `rank`'s share of `weight`'s first dimension
    (nn.Linear's OUTPUT features): equal parts."""
    n = weight.shape[0] // world
    return weight[rank * n:(rank + 1) * n].clone()


class ColumnParallelLinear(nn.Linear):
    """y_r = x W_r^T: this rank's out/W output features. No communication:
    the output stays split."""

    @classmethod
    def from_linear(cls, full: nn.Linear, rank: int, world: int) -> ColumnParallelLinear:
        layer = cls(full.in_features, full.out_features // world, bias=full.bias is not None,
                    dtype=full.weight.dtype, device=full.weight.device)
        with torch.no_grad():
            layer.weight.copy_(_rows(full.weight, rank, world))  # [out/W, in]
            if full.bias is not None:
                layer.bias.copy_(_rows(full.bias, rank, world))
        return layer


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ bias once): this rank holds in/W
    input features; all-reduce."""

    def __init__(self, full: nn.Linear, rank: int, world: int, comm: Comm):
        super().__init__()
        n = full.in_features // world
        self.weight = nn.Parameter(full.weight[:, rank * n:(rank + 1) * n].clone(),
                                   requires_grad=False)  # [E, in/W]
        self.bias = (None if full.bias is None
                     else nn.Parameter(full.bias.clone(), requires_grad=False))
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:  # x [..., in/W] -> [..., E]
        y = self.comm.all_reduce(F.linear(x, self.weight).contiguous())  # the W partial sums, added
        return y if self.bias is None else y + self.bias


def vocab_rows(full: Tensor, rank: int, world: int) -> Tensor:
    """Rank `rank`'s rows [r Vp, (r+1) Vp) of a [V, E] table, Vp = ceil(V / W); the last rank's rows
    past V are zero padding, so every rank's share has the same shape (the all-gather needs it)."""
    V, E = full.shape
    per_rank = math.ceil(V / world)  # Vp
    rows = full[rank * per_rank:(rank + 1) * per_rank]
    padded = torch.zeros(per_rank, E, dtype=full.dtype, device=full.device)
    padded[:rows.shape[0]] = rows
    return padded  # [Vp, E]


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + Vp) of the embedding table on this rank;
    other ranks' tokens read as zeros; all-reduce."""

    def __init__(self, full: Tensor, rank: int, world: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(vocab_rows(full, rank, world), requires_grad=False)  # [Vp, E]
        self.per_rank = self.weight.shape[0]  # Vp
        self.lo = rank * self.per_rank
        self.comm = comm

    def forward(self, ids: Tensor) -> Tensor:  # ids [B, T] -> [B, T, E]
        local = ids - self.lo
        mine = (local >= 0) & (local < self.per_rank)
        x = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)  # [B, T, E]
        x = x * mine[..., None].to(x.dtype)  # tokens another rank holds: zero here
        return self.comm.all_reduce(x.contiguous())


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's Vp vocabulary rows, all-gathered into the full [S, V]."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Comm):
        super().__init__()
        self.weight, self.vocab_size, self.comm = weight, vocab_size, comm  # weight [Vp, E]

    def forward(self, x: Tensor) -> Tensor:  # x [S, E] -> [S, V]
        parts = self.comm.all_gather(F.linear(x, self.weight))  # W x [S, Vp]
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


# Which way each projection is split: by output columns (no communication) or by input rows (one
# all-reduce of the partial sums after it): Megatron-LM's pairing, one all-reduce per half-layer.
COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_SPLIT = ("o_proj", "down_proj")


def shard_model(model: LlamaModel, comm: Comm) -> LlamaModel:
    """A copy of `model` holding only rank `comm.rank`'s share of every layer
    (the model is left as it is).

    The copy is still a `LlamaModel` with the full `config`: its modules are
    replaced by the parallel ones above (engine/surgery.py does the walking), so
    `runner.run_model` runs it unchanged and the all-reduces happen inside."""
    cfg, rank, world = model.config, comm.rank, comm.world_size
    check_tensor_parallel(cfg, world)

    def split(name: str, module: nn.Module) -> nn.Module | None:
        leaf = name.rpartition(".")[2]
        if leaf in COLUMN_SPLIT or leaf in ROW_SPLIT:
            linear = _linear(module, leaf)
            if leaf in COLUMN_SPLIT:
                return ColumnParallelLinear.from_linear(linear, rank, world)
            return RowParallelLinear(linear, rank, world, comm)
        if name == "embed_tokens":
            return VocabParallelEmbedding(module.weight.detach(), rank, world, comm)
        return None

    shard = replaced(model, split)  # replaced layers hold 1/W copies; the rest is shared
    for layer in shard.layers:
        attn = layer.self_attn
        attn.H, attn.Hkv = attn.H // world, attn.Hkv // world  # this rank's heads (attn is a copy)
    if cfg.tie_word_embeddings:
        head_weight = shard.embed_tokens.weight  # tied: the same [Vp, E] rows
    else:
        head_weight = nn.Parameter(vocab_rows(model.lm_head.weight.detach(), rank, world),
                                   requires_grad=False)
    shard.lm_head = VocabParallelLMHead(head_weight, cfg.vocab_size, comm)
    return shard.eval()


def shallow_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose submodules we may replace without touching the original's."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def _linear(layer: nn.Module, name: str) -> nn.Linear:
    if type(layer) is not nn.Linear:
        raise TypeError(f"tensor parallelism splits plain nn.Linear layers; {name} is a "
                        f"{type(layer).__name__} (a quantized model?): split the float model, "
                        "or run it with tensor_parallel_size=1")
    return layer

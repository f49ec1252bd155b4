"""Fused projections: q, k and v as ONE matrix, and the MLP's gate and up as one, as vLLM's
`QKVParallelLinear` and `MergedColumnParallelLinear` do.

q_proj, k_proj and v_proj all multiply the same input x; so do gate_proj and up_proj. Stacking their
weights along the output axis gives one matrix, and one matmul computes all three outputs at once:

    W_q [H*D, E]                     ┐
    W_k [Hkv*D, E]   ─ stacked ─►    │ W_qkv [(H + 2 Hkv) * D, E]
    W_v [Hkv*D, E]                   ┘

    x W_qkv^T ─► [..., (H + 2 Hkv) * D] ─ split ─► q, k, v (views, no copy)

The arithmetic is the same: every output is the same row times the same x, so the numbers equal the
three separate matmuls' up to float rounding (and exactly, for a kernel that sums each row in one
fixed order). What changes is the cost around the arithmetic: at decode time a matmul is small, and
each call pays its dispatch, reads x again and, for the native int4/int8 kernel, rounds x to int8
again: fusing turns 7 matmuls per layer into 4 (benchmarks/results/quantization.md has the engine's
numbers).

The fast wing fuses a COPY of the model (engine/surgery.py), so the model you passed in keeps its
separate q/k/v layers. Layers that cannot be stacked stay separate: quantized layers stack only if
they share bits, group size and kernel, with per-channel or per-group scales (a per-tensor scale is
one number per matrix) and no activation quantization or smoothing of their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.loading.quantization import QuantLinear
from engine.model import MLP, Attention
from engine.surgery import replaced
from kernels.quant_matmul import QuantizedWeight


class FusedAttention(Attention):
    """engine/model.py's Attention with q, k and v computed by ONE matmul (`qkv_proj`)."""

    def __init__(self, attn: Attention, qkv_proj: nn.Module):
        nn.Module.__init__(self)  # no fresh weights: we take attn's
        self.layer, self.H, self.Hkv, self.D = attn.layer, attn.H, attn.Hkv, attn.D
        self.qkv_proj, self.o_proj = qkv_proj, attn.o_proj
        self.qkv_sizes = [attn.H * attn.D, attn.Hkv * attn.D, attn.Hkv * attn.D]

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # views into [B, T, (H + 2 Hkv) * D]


class FusedMLP(MLP):
    """engine/model.py's SwiGLU MLP with gate and up computed by ONE matmul (`gate_up_proj`)."""

    def __init__(self, mlp: MLP, gate_up_proj: nn.Module):
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = gate_up_proj, mlp.down_proj

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # one matmul, [B, T, 2 Fi] split in halves
        return self.down_proj(F.silu(gate) * up)  # [B, T, E]


def fuse_projections(model: nn.Module) -> nn.Module:
    """A copy of `model` whose attention layers and MLPs are fused where their layers can be
    stacked; the original model is left as it was (every other tensor is shared)."""
    return replaced(model, _fused)


def _fused(name: str, module: nn.Module) -> nn.Module | None:
    if type(module) is Attention:
        fused = stack_linears((module.q_proj, module.k_proj, module.v_proj))
        return None if fused is None else FusedAttention(module, fused)
    if type(module) is MLP:
        fused = stack_linears((module.gate_proj, module.up_proj))
        return None if fused is None else FusedMLP(module, fused)
    return None


def stack_linears(parts) -> nn.Module | None:
    """One layer computing every part's output side by side ([..., sum of N]), or None if they
    cannot be stacked."""
    if all(type(p) is nn.Linear for p in parts):
        return _stack_float(parts)
    if all(type(p) is QuantLinear for p in parts):
        return _stack_quantized(parts)
    return None


def _stack_float(parts) -> nn.Linear | None:
    w0 = parts[0].weight
    if (any(p.weight.dtype != w0.dtype or p.weight.device != w0.device
            or p.in_features != w0.shape[1] for p in parts)
            or len({p.bias is None for p in parts}) != 1):
        return None
    fused = nn.Linear(w0.shape[1], sum(p.out_features for p in parts),
                      bias=parts[0].bias is not None, device=w0.device, dtype=w0.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))  # [sum N, K]
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    fused.requires_grad_(False)
    return fused


def _stack_quantized(parts) -> QuantLinear | None:
    first = parts[0]
    key = (first.bits, first.group_size, first.backend, first.in_features)
    same = all((p.bits, p.group_size, p.backend, p.in_features) == key for p in parts)
    own_scaling = any(p.act_quant or p.smooth is not None or p.qw.per_tensor for p in parts)
    mixed = len({p.bias is None for p in parts}) != 1 or len({p.zeros is None for p in parts}) != 1
    if not same or own_scaling or mixed:
        return None
    qws = [p.qw for p in parts]
    qw = QuantizedWeight(first.bits, torch.cat([q.qweight for q in qws]),
                         torch.cat([q.scales for q in qws]),
                         None if first.zeros is None else torch.cat([q.zeros for q in qws]),
                         first.group_size, (sum(q.shape[0] for q in qws), first.in_features))
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    return QuantLinear(qw, bias, backend=first.backend)

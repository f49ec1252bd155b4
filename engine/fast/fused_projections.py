"""Fused projections: q, k and v as ONE matrix, and the MLP's gate and up as one, as vLLM's
`QKVParallelLinear` and `MergedColumnParallelLinear` do.

q_proj, k_proj and v_proj all multiply the same input x; so do gate_proj and up_proj. Stacking their
weights along the output axis gives one matrix, and one matmul computes all three outputs at once:

    W_q [H*D, E]                     ┐
    W_k [Hkv*D, E]   ─ stacked ─►    │ W_qkv [(H + 2 Hkv) * D, E]      x W_qkv^T ─► [..., (H + 2 Hkv) * D]
    W_v [Hkv*D, E]                   ┘                                  └─ split ─► q, k, v (views, no copy)

The arithmetic is the same: every output is the same row times the same x, so the numbers equal the three
separate matmuls' up to float rounding (and exactly, for a kernel that sums each row in one fixed order).
What changes is the cost around the arithmetic: at decode time a matmul is small, and each call pays its
dispatch, reads x again and, for the native int4/int8 kernel, rounds x to int8 again. In SmolLM2-135M's 30
layers, fusing turns 210 matmuls per token into 120; at batch 1 on one thread that was ~7% of a decode step
(17.7 -> 16.5 ms, int4 weights; benchmarks/quantization.py has the engine's numbers).

The engine fuses a shallow COPY of the model when it packs weights (engine/fast/packed_linear.py), so the model you
passed in keeps its separate q/k/v layers (the transformers oracle, the notebooks and the quantizer read
those). Layers that cannot be stacked stay separate: quantized layers stack only if they share bits, group
size and kernel, with per-channel or per-group scales (a per-tensor scale is one number per matrix) and no
activation quantization or smoothing of their own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine.loading.quantization import QuantLinear
from kernels.quant_matmul import QuantizedWeight


def fuse_projections(model: nn.Module) -> nn.Module:
    """A shallow copy of `model` whose attention layers have `qkv_proj` and MLPs `gate_up_proj` where the
    layers can be stacked; the original model is left as it was (every other tensor is shared)."""
    twin = copy.copy(model)
    twin._modules = dict(model._modules)
    twin.layers = nn.ModuleList(_fuse_layer(layer) for layer in model.layers)
    return twin


def _fuse_layer(layer: nn.Module) -> nn.Module:
    twin = copy.copy(layer)
    twin._modules = dict(layer._modules)
    attn, mlp = copy.copy(layer.self_attn), copy.copy(layer.mlp)
    attn._modules, mlp._modules = dict(attn._modules), dict(mlp._modules)
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    if (fused := stack_linears(parts)) is not None:
        attn.qkv_proj, attn.qkv_sizes = fused, [p.out_features for p in parts]
        del attn.q_proj, attn.k_proj, attn.v_proj  # the copy computes through the fused matrix only
    if (fused := stack_linears((mlp.gate_proj, mlp.up_proj))) is not None:
        mlp.gate_up_proj = fused
        del mlp.gate_proj, mlp.up_proj
    twin.self_attn, twin.mlp = attn, mlp
    return twin


def stack_linears(parts) -> nn.Module | None:
    """One layer computing every part's output side by side ([..., sum of N]), or None if they cannot be stacked."""
    if all(type(p) is nn.Linear for p in parts):
        return _stack_float(parts)
    if all(type(p) is QuantLinear for p in parts):
        return _stack_quantized(parts)
    return None


def _stack_float(parts) -> nn.Linear | None:
    w0 = parts[0].weight
    if any(p.weight.dtype != w0.dtype or p.weight.device != w0.device or p.in_features != w0.shape[1]
           for p in parts) or len({p.bias is None for p in parts}) != 1:
        return None
    fused = nn.Linear(w0.shape[1], sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                      device=w0.device, dtype=w0.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))  # [sum N, K]
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    fused.requires_grad_(False)
    return fused


def _stack_quantized(parts) -> QuantLinear | None:
    first = parts[0]
    same = all((p.bits, p.group_size, p.backend, p.in_features) == (first.bits, first.group_size, first.backend,
                                                                    first.in_features) for p in parts)
    own_scaling = any(p.act_quant or p.smooth is not None or p.qw.per_tensor for p in parts)
    mixed = len({p.bias is None for p in parts}) != 1 or len({p.zeros is None for p in parts}) != 1
    if not same or own_scaling or mixed:
        return None
    qws = [p.qw for p in parts]
    qw = QuantizedWeight(first.bits, torch.cat([q.qweight for q in qws]), torch.cat([q.scales for q in qws]),
                         None if first.zeros is None else torch.cat([q.zeros for q in qws]), first.group_size,
                         (sum(q.shape[0] for q in qws), first.in_features))
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    return QuantLinear(qw, bias, backend=first.backend)

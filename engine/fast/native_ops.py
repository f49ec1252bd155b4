"""RMSNorm, SiLU-times-up and RoPE as fused C kernels (kernels/layer_ops) in the engine's copy of the model.

engine/model.py writes each of them as a few PyTorch ops, which is the clearest way to read them and a slow way
to run them on a CPU: every op is a pass over a [tokens, width] tensor, and in bf16 most of them also widen
their input to fp32 and round the result back. The engine computes with its own copy of the model anyway
(packed and fused: engine/fast/packed_linear.py, engine/fast/fused_projections.py); here that copy's norms, MLPs and
attention layers become the subclasses below, which call one C function where the model calls several ops:

    RMSNorm      x.float(), pow(2), mean, + eps, rsqrt, *, .to(dtype), * weight   ->  rms_norm_native(x, w)
    MLP          gate, up = chunk(gate_up); silu(gate) * up                         ->  silu_mul_native(gate_up)
    Attention    x * cos + cat(-x2, x1) * sin, for q and for k                     ->  rope_native_(qkv) in place

The arithmetic is the same, rounded where torch rounds (tests/test_layer_ops.py compares each with its
PyTorch twin; the engine tests compare greedy tokens with the naive loop). vLLM's CPU backend has the same
three as custom ops. The model you passed in keeps its PyTorch modules; `layer_backend="python"` keeps them in
the engine too.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

from engine.model import MLP, Attention, RMSNorm
from kernels.layer_ops import rms_norm_native, rope_native_, silu_mul_native, why_layer_ops_cannot_run


class NativeRMSNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != self.weight.dtype or why_layer_ops_cannot_run(x) is not None:
            return super().forward(x)
        return rms_norm_native(x, self.weight.detach(), self.eps)


class NativeMLP(MLP):
    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None or why_layer_ops_cannot_run(x) is not None:
            return super().forward(x)
        return self.down_proj(silu_mul_native(self.gate_up_proj(x)))  # [B, T, 2F] -> [B, T, F] -> [B, T, E]


class NativeAttention(Attention):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend, meta) -> Tensor:
        if self.qkv_proj is None or why_layer_ops_cannot_run(x) is not None:
            return super().forward(x, cos, sin, backend, meta)
        B, T, _ = x.shape  # x [B, T, E]
        qkv = self.qkv_proj(x)  # [B, T, (H + 2 Hkv) * D], a fresh tensor: RoPE may rotate it in place
        rows, D = qkv.view(B * T, -1), self.D
        cos32, sin32 = cos.reshape(B * T, D).float(), sin.reshape(B * T, D).float()  # [B*T, D]
        rope_native_(rows, cos32, sin32, self.H)  # the q heads
        rope_native_(rows[:, self.H * D:], cos32, sin32, self.Hkv)  # the k heads, right after them
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q, k, v = q.view(B, T, self.H, D), k.view(B, T, self.Hkv, D), v.view(B, T, self.Hkv, D)
        out = backend.forward(self.layer, q, k, v, meta)  # [B, T, H, D]
        return self.o_proj(out.reshape(B, T, self.H * D))  # [B, T, E]


def _as(module: nn.Module, cls: type) -> nn.Module:
    """A shallow copy of `module` that computes with `cls` (a subclass adding no state): the original is untouched."""
    twin = copy.copy(module)
    twin.__class__ = cls
    return twin


def with_native_ops(model: nn.Module) -> nn.Module:
    """A shallow copy of `model` whose norms, MLPs and attention layers use the C ops (where they can run, on this
    model's weights); every weight is shared. Returns `model` itself where the C library cannot be built."""
    if why_layer_ops_cannot_run(model.embed_tokens.weight) is not None:
        return model
    twin = copy.copy(model)
    twin._modules = dict(model._modules)
    layers = []
    for layer in model.layers:
        new = copy.copy(layer)
        new._modules = dict(layer._modules)
        new.input_layernorm = _as(layer.input_layernorm, NativeRMSNorm)
        new.post_attention_layernorm = _as(layer.post_attention_layernorm, NativeRMSNorm)
        new.self_attn, new.mlp = _as(layer.self_attn, NativeAttention), _as(layer.mlp, NativeMLP)
        layers.append(new)
    twin.layers = nn.ModuleList(layers)
    twin.norm = _as(model.norm, NativeRMSNorm)
    return twin

"""RMSNorm, SiLU-times-up and RoPE as fused C kernels (kernels/layer_ops) in the engine's copy of
the model.

engine/model.py writes each of them as a few PyTorch ops, which is the clearest way to read them and
a slow way to run them on a CPU: every op is a pass over a [tokens, width] tensor, and in bf16 most
of them also widen their input to fp32 and round the result back. The engine computes with its own
copy of the model anyway (fused and packed: engine/fast/fused_projections.py,
engine/fast/packed_linear.py); here that copy's norms, MLPs and attention layers become the modules
below, which call one C function where the model calls several ops:

    RMSNorm    x.float(), pow(2), mean, + eps, rsqrt, *,      ->  rms_norm_native(x, w)
               .to(dtype), * weight
    MLP        gate, up = chunk(gate_up); silu(gate) * up     ->  silu_mul_native(gate_up)
    Attention  x * cos + cat(-x2, x1) * sin, for q and for k  ->  rope_native_(qkv) in place

The arithmetic is the same, rounded where torch rounds (tests/test_layer_ops.py compares each with
its PyTorch twin; the engine tests compare greedy tokens with the naive loop). vLLM's CPU backend
has the same three as custom ops. The model you passed in keeps its PyTorch modules;
`layer_backend="python"` keeps them in the engine too.
"""

from __future__ import annotations

from torch import Tensor, nn

from engine.fast.fused_projections import FusedAttention, FusedMLP
from engine.model import RMSNorm
from engine.surgery import replaced
from kernels.layer_ops import (
    rms_norm_native,
    rope_native_,
    silu_mul_native,
    why_layer_ops_cannot_run,
)


class NativeRMSNorm(RMSNorm):
    """RMSNorm in one C pass; the same weight and eps as the norm it replaces."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != self.weight.dtype or why_layer_ops_cannot_run(x) is not None:
            return super().forward(x)
        return rms_norm_native(x, self.weight.detach(), self.eps)


class NativeMLP(FusedMLP):
    """The fused MLP with SiLU-times-up in one C pass."""

    def __init__(self, mlp: FusedMLP):
        super().__init__(mlp, mlp.gate_up_proj)

    def forward(self, x: Tensor) -> Tensor:
        if why_layer_ops_cannot_run(x) is not None:
            return super().forward(x)
        # [B, T, 2F] -> [B, T, F] -> [B, T, E]
        return self.down_proj(silu_mul_native(self.gate_up_proj(x)))


class NativeAttention(FusedAttention):
    """The fused attention layer with RoPE applied in C, in place, on the q and k heads of the qkv
    rows."""

    def __init__(self, attn: FusedAttention):
        super().__init__(attn, attn.qkv_proj)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend, meta) -> Tensor:
        if why_layer_ops_cannot_run(x) is not None:
            return super().forward(x, cos, sin, backend, meta)
        B, T, _ = x.shape  # x [B, T, E]
        # a fresh tensor: RoPE may rotate it in place
        qkv = self.qkv_proj(x)  # [B, T, (H + 2 Hkv) * D]
        rows, D = qkv.view(B * T, -1), self.D
        cos32, sin32 = cos.reshape(B * T, D).float(), sin.reshape(B * T, D).float()  # [B*T, D]
        rope_native_(rows, cos32, sin32, self.H)  # the q heads
        rope_native_(rows[:, self.H * D:], cos32, sin32, self.Hkv)  # the k heads, right after them
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q, k, v = q.view(B, T, self.H, D), k.view(B, T, self.Hkv, D), v.view(B, T, self.Hkv, D)
        out = backend.forward(self.layer, q, k, v, meta)  # [B, T, H, D]
        return self.o_proj(out.reshape(B, T, self.H * D))  # [B, T, E]


NATIVE_TWINS = {RMSNorm: NativeRMSNorm, FusedMLP: NativeMLP, FusedAttention: NativeAttention}


def with_native_ops(model: nn.Module) -> nn.Module:
    """A copy of `model` whose norms and fused MLPs and attention layers use the C ops; every weight
    is shared. Returns `model` itself where the C library cannot be built."""
    if why_layer_ops_cannot_run(model.embed_tokens.weight) is not None:
        return model
    return replaced(model,
                    lambda name, m: NATIVE_TWINS[type(m)](m) if type(m) in NATIVE_TWINS else None)

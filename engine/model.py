"""The whole Llama-family decoder in one file.

One class covers Llama 2/3 (with Llama 3.1's `llama3` RoPE scaling), Mistral (sliding window),
Qwen2 (bias on q/k/v) and SmolLM (tied embeddings). Read it top to bottom:

    token ids ─► embed ─► [ RMSNorm ─► attention ─► + ─► RMSNorm ─► SwiGLU MLP ─► + ] × L ─► ...
                            └────── residual ───────┘    └────────── residual ──────────┘
    ... ─► RMSNorm ─► lm_head ─► logits

Shape notation, used in every comment of the engine:
    B  batch (sequences)          T  tokens per sequence in this forward
    H  query heads                Hkv key/value heads (H % Hkv == 0;
                                      Hkv < H is GQA, Hkv == 1 is MQA)
    D  head dim                   E  hidden size          F  MLP intermediate size
    V  vocabulary                 NB KV blocks            BS tokens per KV block

The model itself keeps no cache and knows nothing of requests. Attention goes through a *backend*
object passed to `forward`: it receives the new tokens' q, k, v (RoPE already applied) and returns
the attention output. The no-cache backend below attends over exactly the tokens it is given;
later chapters pass backends that also write k, v into a KV cache and read the past from it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig


class AttentionBackend(Protocol):
    """What the model asks of attention: `q [B,T,H,D], k/v [B,T,Hkv,D] -> out [B,T,H,D]`."""

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: Any) -> Tensor: ...


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """Share each KV head with `group` query heads: [B, T, Hkv, D] -> [B, T, Hkv*group, D]."""
    return x if group == 1 else x.repeat_interleave(group, dim=2)


class NoCacheAttention:
    """Causal attention over exactly the tokens of this forward (chapter 01: no cache at all).

    `meta` may be None; if the model has a sliding window, each query sees at most that many keys.
    """

    def __init__(self, sliding_window: int | None = None):
        self.sliding_window = sliding_window

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: Any = None) -> Tensor:
        T, group = q.shape[1], q.shape[2] // k.shape[2]
        k, v = repeat_kv(k, group), repeat_kv(v, group)  # [B, T, H, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if self.sliding_window is None or T <= self.sliding_window:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        else:
            mask = causal_mask(T, T, self.sliding_window, q.device)  # [T, T] True = may attend
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2)  # [B, T, H, D]


def causal_mask(Tq: int, Tk: int, window: int | None, device) -> Tensor:
    """[Tq, Tk] boolean mask; the last query sits at key position Tk-1 (queries are the newest
    tokens)."""
    q_pos = torch.arange(Tk - Tq, Tk, device=device)[:, None]
    k_pos = torch.arange(Tk, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like the reference implementation."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """The D/2 rotation frequencies θ_i = base^(-2i/D), optionally rescaled the Llama 3.1 way."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    if cfg.rope_scaling is None:
        return inv_freq
    return llama3_scale_frequencies(inv_freq, cfg.rope_scaling)


def llama3_scale_frequencies(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1 context extension: slow (long-wavelength) frequencies are divided by `factor`,
    fast ones are kept, and the band in between is interpolated smoothly."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (i, i + D/2) of every head by its position's angle.
    x [B,T,h,D], cos/sin [B,T,1,D]."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        E, H, Hkv, D = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim)
        self.layer, self.H, self.Hkv, self.D = layer, H, Hkv, D
        self.q_proj = nn.Linear(E, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(E, Hkv * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(E, Hkv * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, E, bias=cfg.o_bias)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, T, H*D], k and v [B, T, Hkv*D]: three matmuls of the same x."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend,
                meta: Any) -> Tensor:
        B, T, _ = x.shape  # x [B, T, E]
        q, k, v = self.project(x)
        q = q.view(B, T, self.H, self.D)  # [B, T, H, D]
        k = k.view(B, T, self.Hkv, self.D)  # [B, T, Hkv, D]
        v = v.view(B, T, self.Hkv, self.D)  # [B, T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(self.layer, q, k, v, meta)  # [B, T, H, D]
        return self.o_proj(out.reshape(B, T, self.H * self.D))  # [B, T, E]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, Fi = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(E, Fi, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(E, Fi, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(Fi, E, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # [B, T, Fi] each
        return self.down_proj(F.silu(gate) * up)  # [B, T, E]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend,
                meta: Any) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, L decoder layers, final norm and the LM head.

    forward(input_ids [B, T], positions [B, T], backend, meta) -> logits [B, T, V]
    (or [B, V] for the last position only, which is all a generation step needs).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # [D/2] fp32

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [B, T, 1, D] for integer positions [B, T] (angles computed in fp32)."""
        angles = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, D]
        return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        backend: AttentionBackend | None = None,
        meta: Any = None,
        last_only: bool = False,
    ) -> Tensor:
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
        if backend is None:
            backend = NoCacheAttention(self.config.sliding_window)
        x = self.embed_tokens(input_ids)  # [B, T, E]
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, backend, meta)
        if last_only:
            x = x[:, -1]  # [B, E]
        return self.lm_head(self.norm(x))  # [B, T, V] or [B, V]

"""Chapter 03, reference answers: the KV cache formula, writing into a cache, and capacity."""

from __future__ import annotations

import math

import torch

KV_TENSORS = 2  # K and V
BYTES_PER_GB = 10**9  # spec-sheet GB


def kv_cache_bytes(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int,
                   dtype_bytes: float) -> float:
    """M_KV = 2 * L * B * T * Hkv * D * b:
    the bytes of K and V for every layer, sequence and token."""
    return KV_TENSORS * layers * batch * tokens * kv_heads * head_dim * dtype_bytes


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             positions: torch.Tensor) -> None:
    """Write new keys and values [B, T, Hkv, D] into cache slots `positions` [B, T], in place."""
    # [B, 1], broadcasts with [B, T]
    rows = torch.arange(cache_k.shape[0], device=cache_k.device)[:, None]
    cache_k[rows, positions] = k_new  # cache_k[rows, positions] is [B, T, Hkv, D]
    cache_v[rows, positions] = v_new


def max_sequences(gpu_gb: float, weights_gb: float, kv_bytes_per_token: float,
                  context_tokens: int) -> int:
    """How many sequences of `context_tokens` tokens fit after the weights (GB = 10**9 bytes)."""
    free_bytes = (gpu_gb - weights_gb) * BYTES_PER_GB
    per_sequence = kv_bytes_per_token * context_tokens
    return max(0, math.floor(free_bytes / per_sequence))

"""Chapter 03 exercises: the KV cache formula, writing into a cache, and how many sequences fit.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch03

Notation: L layers, B batch (sequences), T tokens, S slots of a cache, Hkv KV heads, D head dim.
The engine's versions live in engine/companions/memory.py and engine/companions/kv_cache.py; try not
to peek until the checks pass.
"""

from __future__ import annotations

import torch


def kv_cache_bytes(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int,
                   dtype_bytes: float) -> float:
    """M_KV = 2 * L * B * T * Hkv * D * b:
    the bytes of K and V for every layer, sequence and token."""
    raise NotImplementedError(
        "which factor of the formula counts what (layers, sequences, tokens, heads, dims), and "
        "what is the 2 for? Can dtype_bytes be a fraction?")


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             positions: torch.Tensor) -> None:
    """Write new keys and values into one layer's cache, in place, at the given slots.

        cache_k, cache_v   [B, S, Hkv, D]   the cache (S slots per sequence)
        k_new, v_new       [B, T, Hkv, D]   the new tokens' keys and values
        positions          [B, T] (long)    the slot of each new token; sequences may differ

    So cache_k[b, positions[b, t]] must become k_new[b, t] (and the same for V); every other slot
    must keep its value. Return nothing: the caller's tensors are the cache.
    """
    raise NotImplementedError(
        "how can one indexing expression address slot positions[b, t] of sequence b for every b "
        "and t at once? And what must change for the caller to see the write: their tensors, or "
        "new ones?")


def max_sequences(gpu_gb: float, weights_gb: float, kv_bytes_per_token: float,
                  context_tokens: int) -> int:
    """How many sequences of `context_tokens` tokens fit in the KV cache of one card.

    The cache gets what the weights leave: (gpu_gb - weights_gb) GB, with GB = 10**9 bytes as on
    spec sheets (no reserve for activations here: the engine's `plan_memory` keeps 10% aside).
    A sequence needs kv_bytes_per_token * context_tokens bytes. Whole sequences only; 0 if the
    weights leave no room.
    """
    raise NotImplementedError(
        "how many bytes do the weights leave on the card, how many does one sequence need, and "
        "which way must a count of whole sequences round? What if the weights alone do not fit?")

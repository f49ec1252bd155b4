"""Chapter 02, reference answers: the FLOPs and bytes of one decode step, and the roofline verdict.

Notation: L layers, B batch, T context (the new token included), H query heads, Hkv KV heads,
D head dim.
"""

from __future__ import annotations

FLOPS_PER_MAC = 2  # a multiply and an add
ATTENTION_FLOPS_PER_PAIR_PER_DIM = 4  # q.k (D MACs) and the weighted sum of V (D MACs): 2 D MACs
KV_TENSORS = 2  # K and V


def decode_step_flops(matmul_params: int, layers: int, heads: int, head_dim: int, batch: int,
                      context_tokens: int) -> int:
    """FLOPs of one decode step: every sequence of the batch adds one token."""
    matmuls = FLOPS_PER_MAC * matmul_params * batch
    attention = (ATTENTION_FLOPS_PER_PAIR_PER_DIM * layers * heads * head_dim * context_tokens
                 * batch)
    return matmuls + attention


def decode_step_bytes(weight_params: int, layers: int, kv_heads: int, head_dim: int, batch: int,
                      context_tokens: int, weight_bytes: float, kv_bytes: float) -> float:
    """Bytes one decode step moves: the weights once, the context's KV read,
    the new token's KV written."""
    # for all B sequences
    kv_per_token = KV_TENSORS * layers * batch * kv_heads * head_dim * kv_bytes
    return weight_params * weight_bytes + kv_per_token * context_tokens + kv_per_token * 1


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs done per byte moved."""
    return flops / bytes_moved


def classify(intensity: float, peak_flops: float, bandwidth_bytes_per_s: float) -> str:
    """"compute-bound" at or right of the ridge point (peak / bandwidth), else "bandwidth-bound"."""
    ridge = peak_flops / bandwidth_bytes_per_s
    return "compute-bound" if intensity >= ridge else "bandwidth-bound"

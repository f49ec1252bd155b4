"""Chapter 02 exercises: the FLOPs and bytes of one decode step,
and where that puts it on a roofline.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch02

Notation: L layers, B batch (sequences decoding together), T context (tokens each sequence attends
to, the new one included), H query heads, Hkv KV heads, D head dim. The engine's version of this
accounting is `engine.companions.roofline.forward_cost`; try not to peek until the checks pass.
"""

from __future__ import annotations


def decode_step_flops(matmul_params: int, layers: int, heads: int, head_dim: int, batch: int,
                      context_tokens: int) -> int:
    """FLOPs of one decode step: every sequence of the batch adds one token.

    matmul_params: the parameters every token is multiplied by (the q/k/v/o projections, the MLP
    and the LM head; for a ModelConfig, `config.matmul_params()`). Count:
      - matmuls: 2 FLOPs (a multiply and an add) per parameter per new token;
      - attention: per layer, per query head, per new token, per context token, q.k costs D
        multiply-adds and the weighted sum of V another D, so 4 * D FLOPs.
    """
    raise NotImplementedError(
        "2 * matmul_params * batch for the matmuls, plus 4 * layers * heads * head_dim * "
        "context_tokens * batch for attention")


def decode_step_bytes(weight_params: int, layers: int, kv_heads: int, head_dim: int, batch: int,
                      context_tokens: int, weight_bytes: float, kv_bytes: float) -> float:
    """Bytes one decode step moves between memory and the chip (activations left out).

      - the weights, read once for the whole batch: weight_params * weight_bytes;
      - the KV cache of the context, read: 2 (K and V) * L * B * T * Hkv * D * kv_bytes;
      - the new token's K and V, written: the same with T = 1.
    """
    raise NotImplementedError(
        "weights once (not once per sequence!) + the KV read for context_tokens tokens + the KV "
        "write for 1 token, each KV term being "
        "2 * layers * batch * tokens * kv_heads * head_dim * kv_bytes")


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs done per byte moved."""
    raise NotImplementedError("one division")


def classify(intensity: float, peak_flops: float, bandwidth_bytes_per_s: float) -> str:
    """"compute-bound" at or right of the ridge point (peak / bandwidth), else "bandwidth-bound"."""
    raise NotImplementedError(
        "the ridge point is peak_flops / bandwidth_bytes_per_s FLOP per byte; "
        "compare the intensity with it")

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
        "how many FLOPs does one parameter cost one new token (a multiply and an add)? In "
        "attention, what does a new token pay per head, layer and context token, for q.k and for "
        "the weighted sum of V?")


def decode_step_bytes(weight_params: int, layers: int, kv_heads: int, head_dim: int, batch: int,
                      context_tokens: int, weight_bytes: float, kv_bytes: float) -> float:
    """Bytes one decode step moves between memory and the chip (activations left out).

      - the weights, read once for the whole batch: weight_params * weight_bytes;
      - the KV cache of the context, read: 2 (K and V) * L * B * T * Hkv * D * kv_bytes;
      - the new token's K and V, written: the same with T = 1.
    """
    raise NotImplementedError(
        "which bytes does the step read once for the whole batch, which once per sequence and "
        "context token, and what does the new token write?")


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs done per byte moved."""
    raise NotImplementedError("intensity is FLOPs per byte: which number goes on top?")


def classify(intensity: float, peak_flops: float, bandwidth_bytes_per_s: float) -> str:
    """"compute-bound" at or right of the ridge point (peak / bandwidth), else "bandwidth-bound"."""
    raise NotImplementedError(
        "at how many FLOPs per byte does the chip take as long to compute as to move the bytes? "
        "Which side of that point, the point itself included, is compute-bound?")

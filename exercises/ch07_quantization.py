"""Chapter 07 exercises: a per-group int4 quantizer with zero points, a dequantizing GEMV, a
granularity picked from an error budget, and the bytes behind "smaller is not always faster".

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch07

The formats are the engine's (kernels/quant_matmul/reference.py): an int4 weight is stored as codes
q in 0..15, packed two per byte (the even input k in the low nibble, k + 1 in the high one), with
one fp32 scale s and one zero point z per group of G consecutive inputs of a row; w = (q - z) * s.
int8 is symmetric: w = q * s, no zero point. You may use `QuantizedWeight`, `quantize` and
`dequantize` from there where a function below is not itself the exercise.
"""

from __future__ import annotations

import torch

from kernels.quant_matmul.reference import QuantizedWeight, dequantize, quantize  # noqa: F401

GRANULARITIES = ("per-tensor", "per-channel", 128, 64, 32)  # coarse (fewest bytes) to fine


def int4_scale_and_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The asymmetric grid through a group's min and max: 0 maps to lo, 15 to hi (0 stays exact).

    lo, hi: each group's smallest and largest weight (any shape, the same for both). Returns (scale,
    zero) of that shape. Stretch the range to include 0.0 first (lo <= 0 <= hi), so a zero weight
    stays exactly zero; an all-zero group still needs a positive scale (use 1e-12 at least).
    """
    raise NotImplementedError(
        "which grid of 16 codes runs from lo to hi, and why stretch [lo, hi] to include 0 first? "
        "What scale would an all-zero group get?")


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Per-group int4 with zero points:
    weight [N, K] -> QuantizedWeight(4, packed, scales, zeros, G, (N, K)).

    packed is uint8 [N, K // 2]; scales and zeros are fp32 [N, K // G]. Raise ValueError naming
    group_size when G does not divide K (or is odd: a byte must not straddle two groups).
    """
    raise NotImplementedError(
        "how do you see [N, K] as groups of G inputs in each row, and where do a group's lo and "
        "hi come from? Two 4-bit codes share one byte: which goes in the low nibble? Which group "
        "sizes cannot work?")


def quant_matmul_ref(x: torch.Tensor, qw: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(qw)^T (+ bias) -> [..., N], computed in fp32, returned in x.dtype.

    Write the dequantization yourself (do not call `dequantize`): int8 codes as they are, int4 codes
    unpacked from the nibbles; subtract each group's zero point, multiply by its scale. qw.scales is
    [N, K // G], or [1, 1] for a per-tensor weight.
    """
    raise NotImplementedError(
        "how do two codes come back out of one byte, and in which order? Each scale serves G "
        "inputs of a row: how do you line the scales up with the [N, K] codes? In which dtype do "
        "you compute, and return?")


def pick_granularity(weight: torch.Tensor, bits: int, max_error: float,
                     candidates=GRANULARITIES) -> str | int:
    """The first (coarsest) of ``candidates`` whose relative error ||W - W_q|| / ||W|| is at most
    ``max_error``; a group size that does not divide K is skipped. ValueError naming max_error if
    none meets it. "per-tensor" is quantize(w, bits, per_tensor=True), "per-channel"
    quantize(w, bits).
    """
    raise NotImplementedError(
        "in which order do you try the candidates, how do you measure one's relative error, and "
        "which group sizes cannot split this K? What if none is good enough?")


def quantized_bytes(n: int, k: int, bits: int, group_size: int) -> int:
    """Bytes of an [N, K] weight stored as ``bits``-bit codes with groups of ``group_size``: the
    codes, plus one fp32 scale per group, plus (int4 only) one fp32 zero point per group."""
    raise NotImplementedError(
        "how many bytes do N x K codes of `bits` bits take, how many groups are there, and what "
        "does each group store besides its codes?")


def gemv_bytes_per_output(K: int, bits: int, group_size: int) -> dict[str, int]:
    """Bytes moved per output of a GEMV with K inputs, by way of computing it:
    {"fp32": ..., "bf16": ..., "naive": ..., "fused": ...}.

    fused: the codes of one row + its scales (and int4 zero points), read once.
    naive: the same, + writing the dequantized fp32 row + reading it back for the matmul.
    """
    raise NotImplementedError(
        "one output reads one row of K weights: how many bytes is that in fp32, in bf16, and as "
        "codes plus their metadata? What does writing the dequantized row out and reading it back "
        "add?")

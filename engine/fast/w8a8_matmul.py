"""W8A8 with a real integer matmul: int8 activations times int8 weights, summed in int32.

The readable W8A8 (``kernels.quant_matmul.reference.w8a8_matmul_ref``) emulates the integer sum in
float64 so that anyone can read it; it is exact, and slow. Here the same arithmetic runs through
``torch._int_mm``, torch's int8 x int8 -> int32 GEMM (oneDNN on a CPU, using VNNI/AMX where the CPU
has them; cuBLAS on a GPU):

    per token: s_x = max|x| / 127, q_x = round(x / s_x)    q_x int8 [M, K], s_x fp32 [M, 1]
    acc = q_x @ q_w^T                                      int32 [M, N] (the integer GEMM)
    y = acc * s_x * s_w                                    fp32 [M, N] (the scales, outside the sum)

The integer sums are exact in both, so the result equals the reference's up to the fp32 rounding of
the two scale multiplications. Chapter 07 times it against fp32 and bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.quant_matmul.reference import (
    QuantizedWeight,
    check_quantized_weight,
    quantize_per_token_int8,
)


@dataclass(frozen=True)
class W8A8Weight:
    """An int8 per-channel weight laid out for ``torch._int_mm``: ``weight_kn`` int8 [K, N]
    (contiguous, the GEMM's preferred layout), ``scales`` fp32 [N] (or [1] per-tensor)."""

    weight_kn: Tensor
    scales: Tensor


def prepare_w8a8(qw: QuantizedWeight) -> W8A8Weight:
    """Lay out an int8 per-channel (or per-tensor) weight once, before the timed calls."""
    check_quantized_weight(qw)
    if qw.bits != 8 or qw.scales.shape[1] != 1:
        raise ValueError(f"qw: W8A8 needs an int8 per-channel or per-tensor weight, got "
                         f"{qw.bits}-bit with group_size {qw.group_size}; quantize(w, 8)")
    return W8A8Weight(qw.qweight.T.contiguous(), qw.scales.reshape(-1).float())


def w8a8_linear(x: Tensor, weight: W8A8Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] -> [..., N]: x rounded to int8 per token, one int32 GEMM, then both scales."""
    k, n = weight.weight_kn.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: last dim must be K = {k}, got shape {tuple(x.shape)}")
    qx, sx = quantize_per_token_int8(x.reshape(-1, k))  # [M, K] int8, [M, 1] fp32
    acc = torch._int_mm(qx, weight.weight_kn)  # [M, N] int32
    y = acc.float() * sx * weight.scales  # per token [M, 1] x per channel [N]
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], n).to(x.dtype)

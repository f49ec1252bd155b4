"""Chapter 07 reference answers: per-group int4 with zero points, a dequantizing GEMV, a granularity
picked from an error budget, and the byte counts behind "smaller is not always faster"."""

from __future__ import annotations

import torch

from kernels.quant_matmul.reference import QuantizedWeight, dequantize, quantize

INT4_MAX = 15  # int4 codes are 0..15
SCALE_BYTES, ZERO_BYTES, FP32_BYTES, BF16_BYTES = 4, 4, 4, 2
TINY_SCALE = 1e-12  # an all-zero group: any positive scale will do, and it must not be 0
GRANULARITIES = ("per-tensor", "per-channel", 128, 64, 32)  # coarse (fewest bytes) to fine


def int4_scale_and_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The asymmetric grid through a group's min and max: 0 maps to lo, 15 to hi (0 stays exact)."""
    # keep 0.0 inside the range, so zero weights stay zero
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = ((hi - lo) / INT4_MAX).clamp(min=TINY_SCALE)
    zero = (-lo / scale).round().clamp(0, INT4_MAX)
    return scale, zero


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Per-group int4 with zero points:
    weight [N, K] -> QuantizedWeight (codes packed two per byte)."""
    n, k = weight.shape
    if group_size < 1 or k % group_size or group_size % 2:
        raise ValueError(f"group_size: {group_size} must be even and divide K = {k}")
    groups = weight.float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
    scale, zero = int4_scale_and_zero(groups.amin(-1), groups.amax(-1))  # [N, K/G] each
    q = (groups / scale[..., None] + zero[..., None]).round().clamp(0, INT4_MAX)  # [N, K/G, G]
    q = q.reshape(n, k).to(torch.uint8)
    # [N, K/2]: even k in the low nibble, odd k in the high one
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return QuantizedWeight(4, packed, scale, zero, group_size, (n, k))


def quant_matmul_ref(x: torch.Tensor, qw: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(qw)^T (+ bias) -> [..., N], computed in fp32, returned in x.dtype."""
    n, k = qw.shape
    if qw.bits == 8:
        q = qw.qweight.float()  # [N, K]
    else:
        low, high = qw.qweight & 0xF, qw.qweight >> 4  # [N, K/2] each: inputs 2j and 2j + 1
        q = torch.stack((low, high), dim=-1).reshape(n, k).float()  # [N, K/2, 2] -> [N, K]
    # inputs per (scale, zero): G, or K per channel / per tensor
    per_group = k // qw.scales.shape[1]
    w = q if qw.zeros is None else q - qw.zeros.expand(n, -1).repeat_interleave(per_group, dim=1)
    w = w * qw.scales.expand(n, -1).repeat_interleave(per_group, dim=1)  # [N, K]
    y = x.float() @ w.T  # [..., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _relative_error(weight: torch.Tensor, qw: QuantizedWeight) -> float:
    return ((dequantize(qw) - weight.float()).norm() / weight.float().norm()).item()


def pick_granularity(weight: torch.Tensor, bits: int, max_error: float,
                     candidates=GRANULARITIES) -> str | int:
    """The first (coarsest) of ``candidates`` whose relative error ||W - W_q|| / ||W|| is at most
    ``max_error``; a group size that does not divide K is skipped. ValueError if none meets it."""
    k = weight.shape[1]
    for c in candidates:
        if c == "per-tensor":
            qw = quantize(weight, bits, per_tensor=True)
        elif c == "per-channel":
            qw = quantize(weight, bits)
        elif k % c == 0:
            qw = quantize(weight, bits, c)
        else:
            continue
        if _relative_error(weight, qw) <= max_error:
            return c
    raise ValueError(f"max_error: no granularity in {list(candidates)} reaches {max_error}")


def quantized_bytes(n: int, k: int, bits: int, group_size: int) -> int:
    """Bytes of an [N, K] weight:
    the codes plus an fp32 scale per group (int4: and an fp32 zero)."""
    groups = n * (k // group_size)
    meta = SCALE_BYTES + (ZERO_BYTES if bits == 4 else 0)
    return n * k * bits // 8 + groups * meta


def gemv_bytes_per_output(K: int, bits: int, group_size: int) -> dict[str, int]:
    """Bytes read (and written) per output of a GEMV with K inputs: fp32, bf16, naive and fused."""
    meta = (K // group_size) * (SCALE_BYTES + (ZERO_BYTES if bits == 4 else 0))
    integers = K * bits // 8
    return {"fp32": K * FP32_BYTES, "bf16": K * BF16_BYTES,
            "naive": integers + meta + 2 * K * FP32_BYTES,  # write the fp32 row, then read it back
            "fused": integers + meta}

"""Quantized matmul in plain PyTorch: the formats, the quantizers and the oracle every kernel meets.

A linear layer computes y = x @ W^T with W [N, K] (N outputs, K inputs). Weight-only quantization
stores W as small integers q plus a few floats that map them back:

    symmetric int8      w = q * s                 q in -127..127, one scale s per group
    asymmetric int4     w = (q - z) * s           q in 0..15, a scale s and a zero point z per group

How many weights share one (s, z) is the *granularity*; a group is G consecutive inputs of one row:

    per-tensor   G = K, one pair for the whole matrix   scales [1, 1]
    per-channel  G = K, one pair per output row         scales [N, 1]
    per-group    G = 32/64/128                          scales [N, K // G]

               k ->  0 ........ G-1 | G ...... 2G-1 | ...
    row n:          [ s[n,0], z[n,0] | s[n,1], z[n,1] | ... ]

One outlier weight stretches the range of every weight that shares its scale: per-tensor int4 gives
a whole matrix 16 levels, per-group gives each 32 weights their own 16 (chapter 07 measures it).

int4 values travel packed two to a byte, the even input k in the low nibble, k + 1 in the high one:

    packed[n, j] = q[n, 2j] | (q[n, 2j + 1] << 4)        packed [N, K // 2] uint8

The oracle is the obvious one: dequantize the whole W to fp32, then matmul. It reads N*K packed
bytes, writes and re-reads N*K*4 bytes of fp32 weights: the waste the kernels exist to remove.
``check_quantized_weight`` is the input contract every backend enforces first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127  # symmetric int8 uses -127..127, so +w and -w quantize to +q and -q
INT4_LEVELS = 15  # asymmetric int4 uses 0..15
SUPPORTED_BITS = (8, 4)
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# an all-zero group gets this scale instead of 0, so dequantizing never divides by 0
TINY_SCALE = 1e-12


def _fail(field: str, message: str):
    raise ValueError(f"{field}: {message}")


@dataclass
class QuantizedWeight:
    """One quantized [N, K] weight. ``qweight`` is int8 [N, K] (bits 8) or packed uint8 [N, K // 2]
    (bits 4); ``scales`` fp32 [1, 1] (per-tensor) or [N, K // group_size]; ``zeros`` the int4 zero
    points, same shape as ``scales`` (None for symmetric int8)."""

    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    shape: tuple[int, int]  # (N, K)

    @property
    def per_tensor(self) -> bool:
        return tuple(self.scales.shape) == (1, 1) and self.shape[0] > 1

    def nbytes(self) -> int:
        """Bytes stored: the integers plus every scale and zero point."""
        zeros = 0 if self.zeros is None else self.zeros.nbytes
        return self.qweight.nbytes + self.scales.nbytes + zeros


# ---- the input contract ------------------------------------------------------------------------


def check_weight_shape(weight: torch.Tensor, bits: int, group_size: int) -> None:
    """A float [N, K] weight that ``bits``-bit groups of ``group_size`` inputs can cover."""
    if bits not in SUPPORTED_BITS:
        _fail("bits", f"{bits} is not supported; use one of {SUPPORTED_BITS}")
    if weight.dim() != 2:
        _fail("weight", f"expected a 2-D [N, K] matrix, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        _fail("weight", f"dtype {weight.dtype} is not floating point; quantize float weights")
    n, k = weight.shape
    if group_size < 1 or k % group_size != 0:
        _fail("group_size", f"{group_size} does not divide the input width K = {k}; "
                            f"pick a divisor of K (e.g. {_divisors_hint(k)}) "
                            "or group_size = K for per-channel")
    if bits == 4 and k % 2 != 0:
        _fail("weight", f"int4 packs two inputs per byte, so K must be even, got K = {k}")


def _divisors_hint(k: int) -> list[int]:
    return [g for g in (32, 64, 128, k) if k % g == 0]


def check_quantized_weight(qw: QuantizedWeight) -> None:
    """Every field consistent with ``shape``, ``bits`` and ``group_size`` (the contract of all
    backends)."""
    n, k = qw.shape
    if qw.bits not in SUPPORTED_BITS:
        _fail("bits", f"{qw.bits} is not supported; use one of {SUPPORTED_BITS}")
    if qw.group_size < 1 or k % qw.group_size != 0:
        _fail("group_size", f"{qw.group_size} does not divide the input width K = {k}")
    expected = (torch.int8, (n, k)) if qw.bits == 8 else (torch.uint8, (n, k // 2))
    if qw.qweight.dtype != expected[0] or tuple(qw.qweight.shape) != expected[1]:
        _fail("qweight", f"{qw.bits}-bit weights are {expected[0]} {list(expected[1])}, "
                         f"got {qw.qweight.dtype} {list(qw.qweight.shape)}")
    groups = (n, k // qw.group_size)
    if tuple(qw.scales.shape) not in (groups, (1, 1)) or qw.scales.dtype != torch.float32:
        _fail("scales", f"expected float32 {list(groups)} (or [1, 1] per-tensor), "
                        f"got {qw.scales.dtype} {list(qw.scales.shape)}")
    if (qw.zeros is None) != (qw.bits == 8):
        _fail("zeros", "int4 needs zero points and int8 (symmetric) takes none")
    if qw.zeros is not None and qw.zeros.shape != qw.scales.shape:
        _fail("zeros", f"shape {list(qw.zeros.shape)} must equal scales' {list(qw.scales.shape)}")


def check_activations(x: torch.Tensor, qw: QuantizedWeight) -> None:
    """x [..., K] floating point, on the weight's device."""
    if x.dtype not in ACTIVATION_DTYPES:
        _fail("x", f"dtype {x.dtype} is not supported; use one of {ACTIVATION_DTYPES}")
    if x.dim() < 1 or x.shape[-1] != qw.shape[1]:
        _fail("x", f"last dim must be K = {qw.shape[1]} (the weight's input width), "
                   f"got shape {tuple(x.shape)}")
    if x.device != qw.qweight.device:
        _fail("x", f"is on {x.device} but the weight is on {qw.qweight.device}")


# ---- packing ---------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K // 2] uint8: even k in the low nibble, odd k in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] uint8 values 0..15 (the inverse of ``pack_int4``)."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)  # [N, K/2, 2] -> [N, K]


# ---- quantizers (round to nearest) -------------------------------------------------------------


def _groups(weight: torch.Tensor, group_size: int, per_tensor: bool) -> torch.Tensor:
    """[N, K] -> [N, K // G, G] (per-tensor: [1, 1, N*K], one group of everything)."""
    n, k = weight.shape
    if per_tensor:
        return weight.float().reshape(1, 1, n * k)
    return weight.float().reshape(n, k // group_size, group_size)


def int4_scale_and_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The asymmetric grid through a group's min and max: 0 maps to lo, 15 to hi (0 stays exact)."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # keep 0 inside the range, so zero weights stay zero
    scale = ((hi - lo) / INT4_LEVELS).clamp(min=TINY_SCALE)
    zero = (-lo / scale).round().clamp(0, INT4_LEVELS)
    return scale, zero


def quantize(weight: torch.Tensor, bits: int, group_size: int | None = None,
             per_tensor: bool = False) -> QuantizedWeight:
    """Round-to-nearest quantization of a float [N, K] weight.

    bits 8: symmetric, scale = max|w| / 127.  bits 4: asymmetric, scale and zero from min and max.
    group_size None means per-channel (G = K); per_tensor=True shares one scale by the whole matrix.
    """
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    group_size = k if (group_size is None or per_tensor) else group_size
    check_weight_shape(weight, bits, group_size)
    g = _groups(weight, group_size, per_tensor)  # [N or 1, groups, G]
    if bits == 8:
        scale = (g.abs().amax(-1) / INT8_MAX).clamp(min=TINY_SCALE)  # [N or 1, groups]
        q = (g / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return QuantizedWeight(8, q.reshape(n, k), scale, None, group_size, (n, k))
    scale, zero = int4_scale_and_zero(g.amin(-1), g.amax(-1))
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, INT4_LEVELS)
    return QuantizedWeight(4, pack_int4(q.reshape(n, k)), scale, zero, group_size, (n, k))


def _expand(per_group: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """scales or zeros [N or 1, K // G] -> one value per weight [N, K]."""
    n, k = qw.shape
    return per_group.expand(n, -1).repeat_interleave(k // per_group.shape[1], dim=1)


def integer_weight(qw: QuantizedWeight) -> torch.Tensor:
    """The stored integers as float32 [N, K] (int8 as is, int4 unpacked)."""
    return qw.qweight.float() if qw.bits == 8 else unpack_int4(qw.qweight).float()


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """QuantizedWeight -> float32 [N, K]: w = (q - z) * s, z = 0 for int8."""
    check_quantized_weight(qw)
    q = integer_weight(qw)
    if qw.zeros is not None:
        q = q - _expand(qw.zeros, qw)
    return q * _expand(qw.scales, qw)


def quant_matmul_ref(x: torch.Tensor, qw: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: x [..., K] @ dequantize(W)^T (+ bias) -> [..., N], computed in fp32, returned in
    x.dtype."""
    check_quantized_weight(qw)
    check_activations(x, qw)
    y = x.float() @ dequantize(qw).T  # [..., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---- W8A8: activations quantized too -----------------------------------------------------------


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [..., K] -> int8 [..., K] and one fp32 scale per token
    [..., 1].

    "Dynamic" because the scale is computed from this very token at run time (no calibration)."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=TINY_SCALE)
    return (x / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def w8a8_matmul_ref(x: torch.Tensor, qw: QuantizedWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (q_x @ q_w^T) * s_x * s_w: both operands int8, one integer matmul, two scales outside it.

    Needs a per-channel (or per-tensor) int8 weight: a per-group weight scale would sit inside the
    sum over K, and the integer matmul could no longer run over all of K at once."""
    check_quantized_weight(qw)
    check_activations(x, qw)
    if qw.bits != 8 or qw.scales.shape[1] != 1:
        _fail("qw", f"W8A8 needs an int8 per-channel or per-tensor weight, got {qw.bits}-bit with "
                    f"group_size {qw.group_size}")
    qx, sx = quantize_per_token_int8(x)  # [..., K], [..., 1]
    # float64 holds the int32 products' sums exactly (|sum| < K * 127^2, far below 2^53)
    acc = qx.double() @ qw.qweight.double().T  # [..., N]
    y = acc.float() * sx * qw.scales.reshape(-1)  # per token [..., 1] x per channel [N] (or [1])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

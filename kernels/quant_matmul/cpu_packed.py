"""The CPU fast path: torch's own packed int8 / int4 matmul ops (the ones torchao and gpt-fast use).

    torch.ops.aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])        y = x @ (w * s)^T
    torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_int32 [N, K], 1)
                                                                  -> opaque uint8 [N, K // 2]
    torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz [K // G, N, 2])
                                                        w = (q - 8) * sz[..., 0] + sz[..., 1]

What we found by experiment in torch 2.13 (tests/test_quant_matmul.py keeps each one true):
- x must be 2-D; x, the scales and the output share one dtype. They are FAST only with bfloat16 x:
  with float32 x both ops fall onto a slow generic path (kernels/README.md): we cast x to bf16 and
  the output back. That cast is the one numerical difference from the reference (bf16 has 8
  mantissa bits: about 3 significant digits per activation).
- int4: G must be 32, 64, 128 or 256 and N a multiple of 16. torch's zero is not ours: it adds
  zero = (8 - z) * s after (q - 8) * s, which is our (q - z) * s. A per-channel or per-tensor
  weight runs with its scale repeated over groups of 32..256 (the same numbers, more copies).
- int8: one scale per output channel only (no groups), and K a multiple of 8: K = 100 gave wrong
  numbers and K = 98 crashed the process, so we refuse such K before calling the op.

At batch 1 a GEMV is bandwidth-bound, so int8 (1/4 of fp32's bytes) and int4 (1/8) "should" be 4x
and 8x faster. On an AVX2-only CPU the unpacking work keeps both far short of that, and with fp32
x they run slower than the plain fp32 matmul (the table and its machine: kernels/README.md,
"Measured"). On CPUs with avx512_bf16 / AMX (`grep -o 'avx512_bf16\\|amx' /proc/cpuinfo`) the same
ops use bf16 dot-product instructions (reported upstream as 5x and 10x; not measured here).
benchmarks/quantization.py measures whole models per scheme on the reader's machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import QuantizedWeight, check_activations, check_quantized_weight, unpack_int4

INT4_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
INT8_K_MULTIPLE = 8  # measured: other K give wrong results or crash (see the module docstring)
TORCH_INT4_OFFSET = 8  # torch's int4 format centres q at 8: w = (q - 8) * scale + zero
INNER_K_TILES = 1  # an argument of the GPU layout; the CPU packer ignores it
FAST_DTYPE = torch.bfloat16  # the activation dtype these ops are fast with


@dataclass
class CPUPackedWeight:
    """A weight in the layout torch's packed op wants (built once by ``prepack``)."""

    bits: int
    packed: torch.Tensor  # int8 [N, K] (bits 8) or torch's opaque int4 layout (bits 4)
    scales: torch.Tensor  # bf16 [N] (bits 8) or scales-and-zeros [K // G, N, 2] (bits 4)
    group_size: int  # G as torch sees it (bits 4)


def _int4_group_size(qw: QuantizedWeight) -> int | None:
    """The largest group size torch accepts that fits inside one of our groups (None if none
    does)."""
    return next((g for g in INT4_GROUP_SIZES if qw.group_size % g == 0), None)


def why_packed_cannot_run(qw: QuantizedWeight, device: torch.device) -> str | None:
    """None if torch's packed op can compute this weight on ``device``, else the reason."""
    n, k = qw.shape
    if device.type != "cpu":
        return f"the packed ops are CPU ops and the weight is on {device}"
    if qw.bits == 8:
        if qw.scales.shape[1] != 1:
            return ("_weight_int8pack_mm takes one scale per output channel, "
                    f"not groups of {qw.group_size}")
        if k % INT8_K_MULTIPLE:
            return f"_weight_int8pack_mm needs K to be a multiple of {INT8_K_MULTIPLE}, got K = {k}"
        return None
    if _int4_group_size(qw) is None:
        return ("_weight_int4pack_mm_for_cpu needs a group size divisible by 32, "
                f"got {qw.group_size}")
    if n % INT4_N_MULTIPLE:
        return ("_convert_weight_to_int4pack_for_cpu needs N to be a multiple of "
                f"{INT4_N_MULTIPLE}, got {n}")
    return None


def prepack(qw: QuantizedWeight) -> CPUPackedWeight:
    """Our format -> torch's. Raises ValueError (with the reason) where the op cannot run."""
    check_quantized_weight(qw)
    why = why_packed_cannot_run(qw, qw.qweight.device)
    if why is not None:
        raise ValueError(f"qw: {why}")
    n, k = qw.shape
    if qw.bits == 8:
        return CPUPackedWeight(8, qw.qweight, qw.scales.expand(n, 1).reshape(n).to(FAST_DTYPE), k)
    group = _int4_group_size(qw)
    repeat = k // group // qw.scales.shape[1]  # torch groups inside one of ours
    scales = qw.scales.expand(n, -1).repeat_interleave(repeat, dim=1)  # [N, K // group]
    zeros = qw.zeros.expand(n, -1).repeat_interleave(repeat, dim=1)
    torch_zero = (TORCH_INT4_OFFSET - zeros) * scales  # (q - 8) * s + (8 - z) * s == (q - z) * s
    # [K // group, N, 2]
    scales_and_zeros = torch.stack((scales, torch_zero), dim=-1).transpose(0, 1)
    q = unpack_int4(qw.qweight).to(torch.int32)  # [N, K] values 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    return CPUPackedWeight(4, packed, scales_and_zeros.contiguous().to(FAST_DTYPE), group)


def quant_matmul_packed(x: torch.Tensor, qw: QuantizedWeight, pw: CPUPackedWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``quant_matmul_ref``: x [..., K] -> [..., N], through torch's packed op in
    bf16."""
    check_activations(x, qw)
    x2 = x.reshape(-1, qw.shape[1]).to(FAST_DTYPE)  # [M, K]: the ops take 2-D bf16 activations
    if pw.bits == 8:
        y = torch.ops.aten._weight_int8pack_mm(x2, pw.packed, pw.scales)  # [M, N]
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, pw.packed, pw.group_size, pw.scales)
    y = y.to(x.dtype).reshape(*x.shape[:-1], qw.shape[0])
    return y if bias is None else y + bias.to(x.dtype)

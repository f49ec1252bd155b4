"""The "native" backend: cpu_native.c, a fused dequant-GEMV in C (AVX2 where the CPU has it),
through ctypes.

    # x [..., K] fp32/bf16/fp16 -> y [..., N] in x's dtype
    y = quant_matmul(x, qw, backend="native")

Why it exists: torch's packed int8/int4 ops (cpu_packed.py) are fast only with bf16 activations on
CPUs with bf16 dot-product instructions. On an AVX2-only CPU they run near 2x fp32 where the bytes
promise 4x and 8x. This kernel reads the weight's integers as they are stored (no second copy) and
multiplies them by x rounded to int8 in blocks of 32 inputs (``round_activations``), with integer
dot-product instructions, as llama.cpp does. Its numbers are exactly
``quant_matmul_ref(round_activations(x), qw)`` up to the order of the float additions; the rounding
of x is the one difference from the unrounded reference (a first try that converted every weight to
a float and multiplied in fp32 was exact but compute-bound, well short of what the bytes allow:
kernels/README.md, "Measured").

Rows of x: up to ``FUSED_MAX_ROWS`` go through the fused kernel (each weight row is read from memory
once and reused from the L1 cache for every row of x). With more rows the work is a real GEMM, where
a float matmul's blocking beats a dot-product loop: W is then dequantized once per call (in C, in
parallel) and torch multiplies it by the same rounded x, so both paths keep one numerical contract.
The fused kernel's time grows with the rows of x (each row is more integer work per weight read)
while the GEMM's barely does, so there is a crossover: ``FUSED_MAX_ROWS``, where it lay on the
machine we measured (the table and the machine: kernels/README.md, "Measured").

The library is compiled on first use (about a second; kept in ~/.cache/servelab/kernels) by
kernels/toolchain.py; ``why_native_cannot_run`` says why when it cannot be.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.toolchain import build_c_library, cached_library

from .reference import ACTIVATION_DTYPES, QuantizedWeight, check_activations, check_quantized_weight

C_FILE = Path(__file__).with_name("cpu_native.c")
# inputs per activation scale and per inner step of the C kernel: K and G must be multiples of it
BLOCK = 32
QX_MAX = 127  # x rounds to -127..127 per block (as in the C file)
FUSED_MAX_ROWS = 8  # more rows: dequantize once, then a float GEMM (crossover: kernels/README.md)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def load_library(flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile (or find in the cache) and load cpu_native.c; ``flags`` None: the machine's own
    (kernels/toolchain.py: AVX2 where the CPU has it). Tests pass plain flags to run the C
    fallback."""
    lib = build_c_library(C_FILE, "quantized matmul kernel", flags)
    lib.servelab_quant_matmul.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64,
                                          _i64, _i64, _ptr]
    lib.servelab_quant_matmul.restype = ctypes.c_int
    lib.servelab_dequantize.argtypes = [ctypes.c_int, _ptr, _ptr, _ptr,
                                        _i64, _i64, _i64, _i64, _ptr]
    lib.servelab_dequantize.restype = None
    lib.servelab_round_activations.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.servelab_round_activations.restype = None
    return lib


_library, why_library_cannot_load = cached_library(load_library)  # built on first use, once


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded the way the kernel rounds it, in PyTorch: each block
    of 32 inputs to int8 levels of its own scale max|x| / 127, returned as fp32 [..., K] (the
    oracle's input)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"x: last dim must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)  # [..., K / 32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, QX_MAX / amax, torch.zeros_like(amax))
    q = (blocks * inv).round()  # -127..127, half to even like C's lrintf
    return (q * (amax / QX_MAX)).reshape(x.shape)


def round_activations_native(x: torch.Tensor) -> torch.Tensor:
    """The same rounding done by the C library (x [M, K] in, float32 [M, K] out): tests hold it to
    ``round_activations``."""
    x2 = x.float().contiguous()
    out = torch.empty_like(x2)
    _library().servelab_round_activations(x2.data_ptr(), x2.shape[0], x2.shape[1], out.data_ptr())
    return out


def why_native_cannot_run(qw: QuantizedWeight, device: torch.device) -> str | None:
    """None if the C kernel can compute this weight on ``device``, else the reason in words."""
    n, k = qw.shape
    if device.type != "cpu":
        return f"the native kernel is a CPU kernel and the weight is on {device}"
    if k % BLOCK or qw.group_size % BLOCK:
        return (f"the native kernel works in blocks of {BLOCK} inputs: K = {k} and the group size "
                f"{qw.group_size} must both be multiples of {BLOCK}")
    return why_library_cannot_load()


@dataclass
class NativeWeight:
    """What the C functions take for one weight, checked once (``prepare_native``): the weight (its
    tensors kept alive here) and the C arguments that never change, so that a call does no checking.
    A decode step calls some 200 of these, so the Python on the way (microseconds a call) is a share
    of the step worth cutting."""

    qw: QuantizedWeight
    n: int
    k: int
    # (qweight, scales, zeros, scale_row_stride, G, N) as C wants them, after (bits, x, M, K)
    weight_args: tuple


def prepare_native(qw: QuantizedWeight) -> NativeWeight:
    """Check ``qw`` against the kernel's contract once. Raises ValueError with the reason."""
    check_quantized_weight(qw)
    why = why_native_cannot_run(qw, qw.qweight.device)
    if why is not None:
        raise ValueError(f"qw: {why}")
    for name, t in (("qweight", qw.qweight), ("scales", qw.scales), ("zeros", qw.zeros)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"qw.{name}: the native kernel needs contiguous tensors")
    n, k = qw.shape
    zeros = None if qw.zeros is None else qw.zeros.data_ptr()
    # 0: one per-tensor pair for every row
    row_stride = 0 if qw.scales.shape[0] == 1 else qw.scales.shape[1]
    return NativeWeight(qw, n, k, (qw.qweight.data_ptr(), qw.scales.data_ptr(), zeros, row_stride,
                                   qw.group_size, n))


def dequantize_native(nw: NativeWeight) -> torch.Tensor:
    """dequantize(qw) in C: float32 [N, K] (the same numbers as reference.dequantize)."""
    w = torch.empty(nw.n, nw.k, dtype=torch.float32)
    q, s, z, stride, g, n = nw.weight_args
    _library().servelab_dequantize(nw.qw.bits, q, s, z, stride, g, n, nw.k, w.data_ptr())
    return w


def quant_matmul_native(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                        prepared: NativeWeight | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: ``quant_matmul_ref(round_activations(x), qw)`` up to the
    order of the additions. Pass ``prepared=prepare_native(qw)`` to skip the weight's checks on
    every call."""
    return native_linear(x, prepared if prepared is not None else prepare_native(qw), bias)


def native_linear(x: torch.Tensor, nw: NativeWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The hot path (QuantLinear calls it): x [..., K] -> [..., N] in x.dtype, for a prepared
    weight."""
    k = nw.k
    if x.shape[-1] != k or x.dtype not in ACTIVATION_DTYPES or not x.is_cpu:
        check_activations(x, nw.qw)  # raises with the reason
    # (each torch call costs microseconds: only those needed)
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()  # [M, K]
    m = x2.shape[0]
    if m > FUSED_MAX_ROWS:
        # a GEMM, where float matmul's blocking wins; x rounded all the same (one contract)
        y = round_activations_native(x2) @ dequantize_native(nw).T  # [M, N]
    else:
        y = torch.empty(m, nw.n, dtype=torch.float32)
        if _library().servelab_quant_matmul(nw.qw.bits, x2.data_ptr(), m, k, *nw.weight_args,
                                            y.data_ptr()):
            raise MemoryError(f"the native kernel could not allocate {m} x {k} bytes of scratch")
    if bias is not None:
        y = y + bias.float()
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], nw.n)

"""The matrix-vector product of a decode step in plain PyTorch: the C kernel's oracle.

At decode time every linear layer multiplies a few token rows x [M, K] by its weight W [N, K],
stored the way ``nn.Linear`` stores it (one row per output):

    y [M, N] = x [M, K] @ W^T (+ b [N])        y[m, n] = sum_k x[m, k] * W[n, k]  (+ b[n])

Why it is memory-bound. Count what one call moves, with s bytes per weight (4 fp32, 2 bf16):

    weights   N * K * s        read once, and each weight serves only M multiply-adds
    x, bias   M * K * 4 + N * 4
    y         M * N * 4        (written)
    flops     2 * M * N * K

so the arithmetic intensity is about 2 * M / s flops per byte: 0.5 for one fp32 row, 1 for one
bf16 row. A CPU core does ten or more flops in the time its share of the memory bandwidth
delivers a byte, so for M = 1..16 the time is the weight's bytes over the bandwidth, and the art
of the kernel (cpu_native.c) is to stream W once at full speed and let the M rows ride along.
One of SmolLM2-135M's stacked gate/up weights, N = 3072 and K = 576, is 7.1 MB in fp32 (3.5 MB
in bf16), read again at every decode step. What the kernel achieves on the machines we measured
it on: kernels/README.md, "Measured".

The kernel's promise, which this function keeps: the arithmetic is fp32; a bf16 weight is
widened to fp32 (exactly: every bf16 value is an fp32 value) before it is multiplied; the bias is
added in fp32; y is fp32. The C kernel sums each dot product in its own order (16 sums in vector
registers), so it equals this function up to float rounding, not bit for bit. With
``accumulate=torch.float64`` the products are summed in double and rounded to fp32 once at the
end: the exact answer that both fp32 sums approximate (tests/test_gemv_native.py uses it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads: nn.Linear's fp32 or bf16
ACCUMULATE_DTYPES = (torch.float32, torch.float64)


def _fail(field: str, message: str):
    raise ValueError(f"{field}: {message}")


def check_gemv_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The contract: x fp32 [M, K] with M >= 1; weight fp32 or bf16 [N, K]; bias None or fp32
    [N]; all on one device. Raises ValueError naming the field. (The C kernel also wants
    M <= GEMV_MAX_ROWS and contiguous tensors: cpu_native.py checks those.)"""
    if weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES:
        _fail("weight", f"expected fp32 or bf16 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != K or x.dtype != torch.float32:
        _fail("x", f"expected fp32 [M >= 1, K = {K}], got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32):
        _fail("bias", f"expected None or fp32 [N = {N}], got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("x", x), ("bias", bias)):
        if t is not None and t.device != weight.device:
            _fail(name, f"is on {t.device} but the weight is on {weight.device}")


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             accumulate: torch.dtype = torch.float32) -> torch.Tensor:
    """y = x @ weight^T (+ bias): x fp32 [M, K], weight fp32 or bf16 [N, K], bias fp32 [N] or
    None -> y fp32 [M, N]. ``accumulate``: the dtype the products are summed in, fp32 (what the
    kernel does) or fp64 (the exact sum, rounded to fp32 once)."""
    check_gemv_inputs(x, weight, bias)
    if accumulate not in ACCUMULATE_DTYPES:
        _fail("accumulate", f"expected one of {ACCUMULATE_DTYPES}, got {accumulate}")
    w = weight.to(accumulate)  # bf16 -> fp32 is exact: bf16 is fp32 with 16 mantissa bits cut off
    b = None if bias is None else bias.to(accumulate)
    return F.linear(x.to(accumulate), w, b).to(torch.float32)  # [M, N]

"""The C matrix-vector product (cpu_native.c) via ctypes: y [M, N] = x [M, K] @ W [N, K]^T (+ b).

    y = gemv_native(x, weight, bias)   # x fp32 [M <= GEMV_MAX_ROWS, K]; weight fp32 or bf16 [N, K]

Why it exists: at decode time a linear layer only streams its weight (reference.py counts the
bytes), and torch's matmuls for a few rows of x left part of the memory bandwidth unused; this
kernel streams W once for up to 16 rows. The weight is read as nn.Linear stores it, so no second
copy is needed. Its bandwidth against torch's, and on which machine: kernels/README.md, "Measured".
The oracle is ``gemv_ref`` (reference.py), tested in tests/test_gemv_native.py.

Compiled on first use (kernels/toolchain.py, cached in ~/.cache/servelab/kernels).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.toolchain import build_c_library, cached_library

C_FILE = Path(__file__).with_name("cpu_native.c")
# rows of x the kernel takes: a decode step of up to 16 sequences (more rows: a GEMM's job)
GEMV_MAX_ROWS = 16
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # -> the C function's `bf16` flag

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def load_library(flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile (or find in the cache) and load cpu_native.c; ``flags`` None: this machine's (tests
    pass others)."""
    lib = build_c_library(C_FILE, "matrix-vector kernel", flags)
    lib.servelab_gemv.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr]
    lib.servelab_gemv.restype = None
    return lib


_library, why_library_cannot_load = cached_library(load_library)  # built on first use, once


def why_gemv_cannot_run(weight: torch.Tensor) -> str | None:
    """None if the C kernel can multiply by ``weight`` [N, K], else the reason in words."""
    if weight.device.type != "cpu":
        return f"it is a CPU kernel and the weight is on {weight.device}"
    if weight.dtype not in WEIGHT_DTYPES:
        return f"it reads fp32 and bf16 weights, not {weight.dtype}"
    if weight.dim() != 2 or not weight.is_contiguous():
        return "it needs a contiguous [N, K] weight"
    return why_library_cannot_load()


def gemv_native(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 contiguous, M in 1..GEMV_MAX_ROWS -> fp32 [M, N]. The caller has checked
    ``weight`` (``why_gemv_cannot_run``) and gives ``bias`` as fp32 [N] or None: this is a hot path,
    nothing is re-checked but the rows."""
    M, K = x.shape
    if not 1 <= M <= GEMV_MAX_ROWS or K != weight.shape[1] or x.dtype != torch.float32 \
            or not x.is_contiguous():
        raise ValueError(f"x: expected fp32 contiguous [1..{GEMV_MAX_ROWS}, {weight.shape[1]}], "
                         f"got {x.dtype} {tuple(x.shape)}")
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    _library().servelab_gemv(WEIGHT_DTYPES[weight.dtype], x.data_ptr(), M, K, weight.data_ptr(),
                             None if bias is None else bias.data_ptr(), N, y.data_ptr())
    return y

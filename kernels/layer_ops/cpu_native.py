"""The fused RMSNorm, SiLU-times-up and RoPE of cpu_native.c through ctypes.

    y = rms_norm_native(x, weight, eps)  # x [..., E] fp32 or bf16 -> y like x (weight: x's dtype)
    h = silu_mul_native(gu)              # gu [..., 2F] = [gate | up] -> [..., F]
    rope_native_(x, cos, sin, heads)     # x [T, >= heads * D] rotated in place; cos, sin [T, D]
    ids = argmax_rows_native(logits)     # logits [R, V] fp32 or bf16 -> [R] int64,
                                         # torch.argmax's rules

Each equals its reference in reference.py, the PyTorch of engine/model.py (fp32: exactly but for
RMSNorm's summation order; bf16: every intermediate rounded where torch rounds it). Compiled on
first use (kernels/toolchain.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.toolchain import build_c_library, cached_library

C_FILE = Path(__file__).with_name("cpu_native.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # -> the C functions' `bf16` flag

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def load_library(flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile (or find in the cache) and load cpu_native.c; ``flags`` None: this machine's (tests
    pass others)."""
    lib = build_c_library(C_FILE, "layer ops", flags)
    lib.servelab_rms_norm.argtypes = [ctypes.c_int, _ptr, _i64, _ptr, _ptr, _i64, _i64,
                                      ctypes.c_float]
    lib.servelab_silu_mul.argtypes = [ctypes.c_int, _ptr, _ptr, _i64, _i64]
    lib.servelab_rope.argtypes = [ctypes.c_int, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64]
    lib.servelab_argmax_rows.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr]
    for f in (lib.servelab_rms_norm, lib.servelab_silu_mul, lib.servelab_rope,
              lib.servelab_argmax_rows):
        f.restype = None
    return lib


_library, why_library_cannot_load = cached_library(load_library)  # built on first use, once


def why_layer_ops_cannot_run(x: torch.Tensor) -> str | None:
    """None if the C ops can take ``x`` (a CPU fp32/bf16 tensor), else why not."""
    if x.device.type != "cpu":
        return f"they are CPU kernels and x is on {x.device}"
    if x.dtype not in DTYPES:
        return f"they compute fp32 and bf16, not {x.dtype}"
    return why_library_cannot_load()


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as [rows, width] with unit stride along the width (a view where it can be one)."""
    if x.dtype not in DTYPES or x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU fp32 or bf16 tensor, got {x.dtype} on {x.device}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x, "x")
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(f"weight: expected {x.dtype} [{x.shape[-1]}] contiguous, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype)
    T, E = rows.shape
    _library().servelab_rms_norm(DTYPES[x.dtype], rows.data_ptr(), rows.stride(0),
                                 weight.data_ptr(), out.data_ptr(), T, E, eps)
    return out


def silu_mul_native(gu: torch.Tensor) -> torch.Tensor:
    rows = _rows(gu, "gu").contiguous()
    T, width = rows.shape
    if width % 2:
        raise ValueError(f"gu: the last dim holds [gate | up], so it must be even, got {width}")
    out = torch.empty(*gu.shape[:-1], width // 2, dtype=gu.dtype)
    _library().servelab_silu_mul(DTYPES[gu.dtype], rows.data_ptr(), out.data_ptr(), T, width // 2)
    return out


def rope_native_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate the first ``heads`` heads of every row of x [T, W] (unit stride along W, any row
    stride) in place."""
    T, D = cos.shape
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] != T or x.shape[1] < heads * D or D % 2:
        raise ValueError(f"x: expected [T={T}, >= {heads} * {D}] with unit stride along a row, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in DTYPES or x.device.type != "cpu":
        raise ValueError(f"x: expected a CPU fp32 or bf16 tensor, got {x.dtype} on {x.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.shape != (T, D) or not t.is_contiguous():
            raise ValueError(f"{name}: expected fp32 [{T}, {D}] contiguous, "
                             f"got {t.dtype} {tuple(t.shape)}")
    _library().servelab_rope(DTYPES[x.dtype], x.data_ptr(), x.stride(0), cos.data_ptr(),
                             sin.data_ptr(), T, heads, D)
    return x


def argmax_rows_native(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, logits [R, V] -> [R] int64: the first of equal maxima,
    a NaN counting as the largest (torch.argmax's rules), in one vectorized pass and a short look
    back."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected [R, V] with V >= 1, got {tuple(logits.shape)}")
    rows = _rows(logits, "logits")
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    _library().servelab_argmax_rows(DTYPES[rows.dtype], rows.data_ptr(), rows.stride(0),
                                    rows.shape[0], rows.shape[1], out.data_ptr())
    return out

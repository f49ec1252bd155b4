"""The C flash-prefill kernel (cpu_native.c) through ctypes: causal attention of whole prompts, all
at once.

    # one prompt: q [T, H, D], k/v [T, Hkv, D]
    out = flash_prefill_native(q, k, v, scale)
    # two prompts (row 40: not one)
    out = flash_prefill_native(q, k, v, scale, prompts=[(0, 40), (41, 95)])

q, k and v may be column slices of a fused QKV projection's output (each row's heads side by side,
any row stride): nothing is copied before the call. fp32 or bf16; the result is contiguous [N, H, D]
in that dtype. Compiled on first use (kernels/toolchain.py, cached in ~/.cache/servelab/kernels).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.toolchain import build_c_library, cached_library

from .reference import check_flash_inputs

C_FILE = Path(__file__).with_name("cpu_native.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # -> the C function's `bf16` flag

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def load_library(flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile (or find in the cache) and load cpu_native.c; ``flags`` None: this machine's (tests
    pass others)."""
    lib = build_c_library(C_FILE, "flash prefill kernel", flags)
    lib.servelab_flash_prefill.argtypes = [ctypes.c_int, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr,
                                           _i64, _i64, _i64, _i64, ctypes.c_float, _ptr]
    lib.servelab_flash_prefill.restype = ctypes.c_int
    return lib


_library, why_library_cannot_load = cached_library(load_library)  # built on first use, once


def why_native_cannot_run(q: torch.Tensor) -> str | None:
    """None if the C kernel takes tensors like ``q``, else the reason in words."""
    if q.device.type != "cpu":
        return f"it is a CPU kernel and q is on {q.device}"
    if q.dtype not in DTYPES:
        return f"it reads fp32 and bf16, not {q.dtype}"
    return why_library_cannot_load()


def _rows_of_heads(name: str, t: torch.Tensor) -> None:
    """The C kernel reads row i, head h at data_ptr + i * stride(0) + h * D: heads side by side in a
    row."""
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
        raise ValueError(f"{name}: each row's heads must lie side by side "
                         f"(strides (*, {t.shape[2]}, 1)), got strides {tuple(t.stride())}")


def check_prompts(prompts, num_tokens: int) -> list[tuple[int, int]]:
    """prompts: (lo, hi) row ranges, in order and apart, inside 0 .. N (prompt b is rows
    lo .. hi - 1)."""
    out, end = [], 0
    for pair in prompts:
        lo, hi = (int(x) for x in pair)
        if not end <= lo < hi <= num_tokens:
            raise ValueError("prompts: expected (lo, hi) row ranges in order, apart, "
                             f"with at least one row, inside 0 .. {num_tokens}; "
                             f"got {list(prompts)}")
        out.append((lo, hi))
        end = hi
    if not out:
        raise ValueError("prompts: expected at least one (lo, hi) row range, got none")
    return out


def flash_prefill_native(q, k, v, scale: float, prompts=None):
    """Causal attention of each prompt over itself: q [N, H, D], k/v [N, Hkv, D] -> [N, H, D]
    contiguous. ``prompts``: (lo, hi) row ranges, one per prompt (None: one prompt of all N rows);
    rows outside every range are left uninitialized in the result."""
    check_flash_inputs(q, k, v, scale)
    why = why_native_cannot_run(q)
    if why is not None:
        raise ValueError(f"q: the C flash-prefill kernel cannot run: {why}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _rows_of_heads(name, t)
    prompts = check_prompts([(0, q.shape[0])] if prompts is None else prompts, q.shape[0])
    out = torch.empty(q.shape, dtype=q.dtype)
    flash_prefill_planned(q, k, v, scale, torch.tensor(prompts, dtype=torch.int64), out)
    return out


def flash_prefill_planned(q, k, v, scale: float, bounds: torch.Tensor, out: torch.Tensor) -> None:
    """`flash_prefill_native` with nothing re-checked (the engine checks once per step): bounds
    int64 [B, 2] contiguous, out [N, H, D] contiguous in q's dtype, written in the prompts' rows."""
    _, H, D = q.shape
    failed = _library().servelab_flash_prefill(
        DTYPES[q.dtype], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
        v.stride(0), bounds.data_ptr(), bounds.shape[0], H, k.shape[1], D, scale, out.data_ptr())
    if failed:
        raise MemoryError("the C flash-prefill kernel could not allocate its scratch")

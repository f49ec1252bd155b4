"""The "native" backend: paged decode attention in C (cpu_native.c), reading K/V straight out of the
pools.

    out = paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale, backend="native")

The "sdpa" backend copies every sequence's K and V out of the pool (a gather), masks the padding and
calls torch's fused attention; at decode time, one query per sequence, the copies and the call's
fixed costs are most of the work. The C kernel follows the block table instead (the reference's
loop, written in C: see the diagram in cpu_native.c), reads each K and V row once for the query
heads that share it (GQA), and computes in fp32 like the reference, so it equals
``paged_decode_attention_ref`` up to the order of the float additions. fp32, bf16 and int8 pools
(with their scales); fp16 pools and GPU tensors are not its job (``why_native_cannot_run`` says so,
and the engine then uses "sdpa").

Prefill is left to "sdpa": with many queries per sequence, attention is a real matrix product and
torch's flash kernel (tiled, online softmax) is the right tool; the copy is small beside it.

Compiled on first use (kernels/toolchain.py, cached in ~/.cache/servelab/kernels), called through
ctypes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.toolchain import build_c_library, cached_library

from .reference import check_paged_inputs

C_FILE = Path(__file__).with_name("cpu_native.c")
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # pool dtype -> the C file's enum
# query/output dtype -> servelab_paged_decode_rows' io_bf16
IO_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
NO_WINDOW = 0  # the C kernel's "every position is visible"

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def load_library(flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile (or find in the cache) and load cpu_native.c; ``flags`` None: this machine's (tests
    pass others)."""
    lib = build_c_library(C_FILE, "paged decode attention kernel", flags)
    lib.servelab_paged_decode.argtypes = [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                                          _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                          ctypes.c_float, _ptr]
    lib.servelab_paged_decode.restype = ctypes.c_int
    lib.servelab_paged_decode_rows.argtypes = [ctypes.c_int, ctypes.c_int, _ptr, _i64, _ptr, _ptr,
                                               _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                                               _i64, _i64, ctypes.c_float, _ptr]
    lib.servelab_paged_decode_rows.restype = ctypes.c_int
    return lib


_library, why_library_cannot_load = cached_library(load_library)  # built on first use, once


def why_native_cannot_run(device, pool_dtype: torch.dtype | None = None) -> str | None:
    """None if the C kernel can run on pools of ``pool_dtype`` on ``device``, else the reason in
    words."""
    if torch.device(device).type != "cpu":
        return f"it is a CPU kernel and the KV pools are on {device}"
    if pool_dtype is not None and pool_dtype not in KV_KINDS:
        return f"it reads fp32, bf16 and int8 pools, not {pool_dtype}"
    return why_library_cannot_load()


@dataclass
class NativeDecodePlan:
    """One step's decode tables as C reads them, checked and made contiguous once for all L
    layers."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, contiguous
    window: int  # the sliding window, or NO_WINDOW


def plan_decode_native(block_tables, seq_lens, sliding_window: int | None) -> NativeDecodePlan:
    """The C arguments that every layer of a step shares (the caller has checked the tables)."""
    return NativeDecodePlan(block_tables.contiguous(), seq_lens.contiguous(),
                            NO_WINDOW if sliding_window is None else sliding_window)


def decode_native_planned(q, k_pool, v_pool, plan: NativeDecodePlan, scale: float, scales=None):
    """One layer, nothing re-checked: q [B, H, D] -> [B, H, D] contiguous in q's dtype. fp32 and
    bf16 queries are read where they lie (rows with any stride, e.g. the query columns of the fused
    QKV output; each row's heads side by side); others are copied to fp32 first, the kernel's
    arithmetic."""
    B, H, D = q.shape
    _, BS, Hkv, _ = k_pool.shape
    io = (q if q.dtype in IO_DTYPES and q.stride(2) == 1 and (H == 1 or q.stride(1) == D)
          else q.float().contiguous())
    out = torch.empty((B, H, D), dtype=io.dtype)
    k_scale, v_scale = ((None, None) if scales is None
                        else (scales[0].data_ptr(), scales[1].data_ptr()))
    failed = _library().servelab_paged_decode_rows(
        KV_KINDS[k_pool.dtype], IO_DTYPES[io.dtype], io.data_ptr(), io.stride(0), k_pool.data_ptr(),
        v_pool.data_ptr(), k_scale, v_scale, plan.block_tables.data_ptr(),
        plan.block_tables.shape[1], plan.seq_lens.data_ptr(), B, H, Hkv, D, BS, plan.window, scale,
        out.data_ptr())
    if failed:
        raise MemoryError(f"the native attention kernel could not allocate scratch for {B} "
                          "sequences")
    return out if out.dtype == q.dtype else out.to(q.dtype)


def paged_decode_attention_native(q, k_pool, v_pool, block_tables, seq_lens, scale: float,
                                  sliding_window: int | None = None, scales=None):
    """Same contract as ``paged_decode_attention_ref``: q [B, H, D] -> out [B, H, D]."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens, scale, sliding_window, scales)
    why = why_native_cannot_run(q.device, k_pool.dtype)
    if why is not None:
        raise ValueError(f"k_pool: the native paged-attention kernel cannot run: {why}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: the native kernel needs a contiguous pool")
    if scales is not None and not (scales[0].is_contiguous() and scales[1].is_contiguous()):
        raise ValueError("scales: the native kernel needs contiguous scale tensors")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return decode_native_planned(q, k_pool, v_pool,
                                 plan_decode_native(block_tables, seq_lens, sliding_window),
                                 scale, scales)

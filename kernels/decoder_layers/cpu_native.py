"""The C decoder layers (cpu_native.c) through ctypes: the structures it reads, and the call.

    status = decoder_layers_native(dims, layers, x, cos, sin, slots, block_tables, seq_lens)

``ModelDims`` holds the shapes, RMSNorm's epsilon, attention's scale, whether activations are bf16,
and the addresses of the three C kernels it calls (``kernel_pointers``). ``layers`` is a ctypes
array of ``Layer``, one per decoder layer: the two norm weights, four ``Linear`` (q/k/v stacked, o,
gate/up stacked, down) and the layer's two KV pools, all as raw addresses. Building them from a
model, and keeping the tensors behind the addresses alive, is engine/fast/native_layers.py's job:
this module checks only the per-step arguments.

Compiled on first use (kernels/toolchain.py, cached in ~/.cache/servelab/kernels).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

C_FILE = Path(__file__).with_name("cpu_native.c")
# The C file's LINEAR_* enum: a float weight by its dtype, a quantized one by its bits.
LINEAR_KINDS = {torch.float32: 0, torch.bfloat16: 1, 4: 4, 8: 8}
STATUS = {1: "could not allocate scratch memory",
          2: "a matmul kernel failed (out of scratch memory)"}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class Linear(ctypes.Structure):
    """One linear layer (the C file's linear_t): y [M, n] = x [M, k] @ W^T (+ bias)."""

    _fields_ = [("kind", _i64), ("n", _i64), ("k", _i64), ("weight", _ptr), ("bias", _ptr),
                ("scales", _ptr), ("zeros", _ptr), ("scale_row_stride", _i64), ("group_size", _i64)]


class Layer(ctypes.Structure):
    """One decoder layer (layer_t)."""

    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear), ("k_pool", _ptr), ("v_pool", _ptr)]


class ModelDims(ctypes.Structure):
    """What every layer shares (model_t)."""

    _fields_ = [("E", _i64), ("H", _i64), ("Hkv", _i64), ("D", _i64), ("F", _i64), ("BS", _i64),
                ("window", _i64), ("eps", ctypes.c_double), ("scale", ctypes.c_double),
                ("bf16", _i64), ("gemv", _ptr), ("quant", _ptr), ("attend", _ptr)]


@functools.cache
def _library() -> ctypes.CDLL:
    from kernels.toolchain import build_c_library

    lib = build_c_library(C_FILE, "decoder layers")
    lib.servelab_decoder_layers.argtypes = [ctypes.POINTER(ModelDims), ctypes.POINTER(Layer), _i64,
                                            _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
    lib.servelab_decoder_layers.restype = ctypes.c_int
    return lib


@functools.cache
def why_library_cannot_load() -> str | None:
    """None if this library and the three kernels it calls compile and load here, else the
    reason."""
    from kernels.gemv.cpu_native import why_library_cannot_load as gemv_why
    from kernels.paged_attention.cpu_native import why_library_cannot_load as attention_why
    from kernels.quant_matmul.cpu_native import why_library_cannot_load as quant_why
    from kernels.toolchain import why_cannot_load

    return why_cannot_load(_library) or gemv_why() or quant_why() or attention_why()


@functools.cache
def kernel_pointers() -> tuple[int, int, int]:
    """The addresses of servelab_gemv, servelab_quant_matmul and servelab_paged_decode (for
    ``ModelDims``)."""
    from kernels.gemv.cpu_native import _library as gemv
    from kernels.paged_attention.cpu_native import _library as attention
    from kernels.quant_matmul.cpu_native import _library as quant

    return tuple(ctypes.cast(f, _ptr).value
                 for f in (gemv().servelab_gemv, quant().servelab_quant_matmul,
                           attention().servelab_paged_decode))


def decoder_layers_native(dims: ModelDims, layers, x: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor) -> None:
    """Run every layer of ``layers`` over x [M, E] fp32 (updated in place). cos, sin fp32 [M, D];
    slots int64 [M]; block_tables int32 [M, W]; seq_lens int32 [M]. The caller has checked the slots
    and tables against the pools (PagedAttention.plan): a wrong slot here would write outside a
    pool."""
    M, E = x.shape
    D = dims.D
    args = ((x, torch.float32, (M, E)), (cos, torch.float32, (M, D)), (sin, torch.float32, (M, D)),
            (slots, torch.int64, (M,)), (seq_lens, torch.int32, (M,)))
    for name, (t, dtype, shape) in zip(("x", "cos", "sin", "slots", "seq_lens"), args, strict=True):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name}: expected {dtype} {shape} contiguous, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if E != dims.E or block_tables.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.shape[0] != M or not block_tables.is_contiguous():
        raise ValueError(f"x [M, {dims.E}] and block_tables int32 [M, W] contiguous expected, "
                         f"got x {tuple(x.shape)}"
                         f" and block_tables {block_tables.dtype} {tuple(block_tables.shape)}")
    status = _library().servelab_decoder_layers(
        ctypes.byref(dims), layers, len(layers), M, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr())
    if status:
        raise MemoryError(f"the native decoder layers failed: {STATUS.get(status, status)}")

"""Quantized matmul: y = x @ dequantize(W)^T, in PyTorch (the oracle), torch's packed CPU ops,
Triton and CUDA, chosen by name.

    from kernels.quant_matmul import quantize, quant_matmul
    qw = quantize(w, bits=4, group_size=128)          # w [N, K] float -> QuantizedWeight
    y = quant_matmul(x, qw, backend="packed")          # x [..., K] -> y [..., N]

Backends (``BACKENDS``):
    "torch"   reference.py: dequantize the whole W to fp32, then matmul (readable, slow)
    "packed"  cpu_packed.py: torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu (bf16 inside)
    "native"  cpu_native.py: cpu_native.c, integer dot products on x rounded to int8 per 32 inputs
              (C, AVX2)
    "triton"  triton.py: a fused dequant-GEMV (on CPU tensors only under TRITON_INTERPRET=1)
    "cuda"    quant_matmul.cu through cuda.py (a CUDA GPU)

A backend that cannot run a given weight here falls back to "torch" with a RuntimeWarning that says
why (Python shows each such warning once per call site). Nothing heavy is imported until used.
"""

from __future__ import annotations

import warnings

import torch

from .reference import (
    QuantizedWeight,
    check_quantized_weight,
    dequantize,
    pack_int4,
    quant_matmul_ref,
    quantize,
    quantize_per_token_int8,
    unpack_int4,
    w8a8_matmul_ref,
)

BACKENDS = ("torch", "packed", "native", "triton", "cuda")

__all__ = [
    "BACKENDS", "QuantizedWeight", "check_quantized_weight", "dequantize", "pack_int4", "prepare",
    "quant_matmul", "quant_matmul_ref", "quantize", "quantize_per_token_int8", "resolve_backend",
    "unpack_int4", "w8a8_matmul_ref", "why_backend_cannot_run",
]


def why_backend_cannot_run(backend: str, qw: QuantizedWeight) -> str | None:
    """None if ``backend`` can compute ``qw`` on its device, else the reason in words."""
    device = qw.qweight.device
    if backend == "packed":
        from .cpu_packed import why_packed_cannot_run

        return why_packed_cannot_run(qw, device)
    if backend == "native":
        from .cpu_native import why_native_cannot_run

        return why_native_cannot_run(qw, device)
    if backend == "triton":
        try:
            from . import triton as triton_backend
        except (ImportError, RuntimeError) as err:
            return f"Triton could not be imported ({err})"
        if device.type == "cpu" and not triton_backend.runs_on_cpu():
            return "the weight is on the CPU and Triton was imported without TRITON_INTERPRET=1"
        if qw.bits == 4 and qw.group_size % 2:
            return f"the int4 kernel needs groups of an even size, got {qw.group_size}"
    if backend == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        if device.type != "cuda":
            return f"the weight is on {device}, not on a CUDA device"
    return None


def resolve_backend(backend: str, qw: QuantizedWeight) -> str:
    """The backend that will really run ``qw`` (warns when it is not ``backend``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    why = why_backend_cannot_run(backend, qw)
    if why is None:
        return backend
    warnings.warn(f"quantized matmul backend {backend!r} cannot run here: {why}; "
                  "using 'torch' instead", RuntimeWarning, stacklevel=3)
    return "torch"


def prepare(qw: QuantizedWeight, backend: str):
    """What ``quant_matmul`` needs besides ``qw`` for this backend, built once: torch's packed
    layout for "packed", the checked pointers for "native", None for the others (they read ``qw`` as
    it is)."""
    if backend == "packed":
        from .cpu_packed import prepack

        return prepack(qw)
    if backend == "native":
        from .cpu_native import prepare_native

        return prepare_native(qw)
    return None


def quant_matmul(x, qw: QuantizedWeight, bias=None, backend: str = "torch", prepared=None):
    """x [..., K] @ dequantize(qw)^T (+ bias) -> [..., N] on the chosen backend.

    For "packed" and "native", pass ``prepared=prepare(qw, backend)`` to do the weight's work once
    instead of on every call. "native" rounds x to int8 per block of 32 inputs (cpu_native.py).
    """
    chosen = resolve_backend(backend, qw)
    if chosen == "packed":
        from .cpu_packed import quant_matmul_packed

        return quant_matmul_packed(x, qw,
                                   prepared if prepared is not None else prepare(qw, "packed"),
                                   bias)
    if chosen == "native":
        from .cpu_native import quant_matmul_native

        return quant_matmul_native(x, qw, bias, prepared)
    if chosen == "triton":
        from .triton import quant_matmul_triton

        return quant_matmul_triton(x, qw, bias)
    if chosen == "cuda":
        from .cuda import quant_matmul_cuda

        return quant_matmul_cuda(x, qw, bias)
    return quant_matmul_ref(x, qw, bias)

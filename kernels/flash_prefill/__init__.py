"""Flash prefill: causal self-attention of a prompt, in PyTorch (tiled and naive), Triton and CUDA.

    from kernels.flash_prefill import flash_prefill_attention
    out = flash_prefill_attention(q, k, v, scale, backend="triton")   # q [T, H, D], k/v [T, Hkv, D]

Backends: "torch" is ``flash_attention_ref`` (the tiled online softmax, readable), "naive" is
``causal_attention_naive`` (the whole [H, T, T] score matrix: the oracle), "triton" and "cuda" the
kernels, "native" the same schedule in C on the CPU (cpu_native.c: what the engine's native backend
runs for whole prompts). A backend that cannot run here (no GPU for "cuda"; Triton missing, or CPU
tensors without ``TRITON_INTERPRET=1``) falls back to "torch" with a RuntimeWarning that says why
(Python shows it once per call site). Triton and the CUDA extension are imported only when asked
for, so importing this package is cheap.
"""

from __future__ import annotations

import warnings

import torch

from kernels.toolchain import chosen_backend

from .reference import causal_attention_naive, check_flash_inputs, flash_attention_ref

BACKENDS = ("torch", "naive", "triton", "cuda", "native")

__all__ = [
    "BACKENDS",
    "causal_attention_naive",
    "check_flash_inputs",
    "flash_attention_ref",
    "flash_prefill_attention",
    "resolve_backend",
]


def resolve_backend(backend: str, device, dtype: torch.dtype = torch.float32) -> str:
    """The backend that will really run for tensors on ``device`` (warns when it is not
    ``backend``)."""
    if backend == "native":
        from .cpu_native import why_native_cannot_run

        why = why_native_cannot_run(torch.empty(0, device=device, dtype=dtype))
        if why is None:
            return "native"
        warnings.warn(f"flash prefill backend 'native' cannot run here: {why}; "
                      "using 'torch' instead", RuntimeWarning, stacklevel=3)
        return "torch"
    return chosen_backend(backend, BACKENDS, device, "kernels.flash_prefill.triton",
                          "flash prefill")


def flash_prefill_attention(q, k, v, scale: float, backend: str = "torch"):
    """Causal attention of T tokens over themselves: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    chosen = resolve_backend(backend, q.device, q.dtype)
    if chosen == "native":
        from .cpu_native import flash_prefill_native as run
    elif chosen == "triton":
        from .triton import flash_attention_triton as run
    elif chosen == "cuda":
        from .cuda import flash_attention_cuda as run
    elif chosen == "naive":
        run = causal_attention_naive
    else:
        run = flash_attention_ref
    return run(q, k, v, scale)

"""Paged attention: the same op in PyTorch (the oracle), torch's fused attention, C, Triton and
CUDA, chosen by name.

    from kernels.paged_attention import paged_decode_attention, write_kv
    write_kv(k, v, k_pool, v_pool, slot_mapping, backend="triton")
    out = paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale, backend="cuda")

Layouts (see ``reference.py``): q/out [B, H, D]; k_pool, v_pool [NB, BS, Hkv, D];
block_tables [B, max_blocks] int32; seq_lens [B] int32; slot_mapping [N] int64.

A backend that cannot run here (no GPU for "cuda"; Triton missing, or CPU tensors without
``TRITON_INTERPRET=1``) falls back to "torch" with a RuntimeWarning that says why; "native" (the C
decode kernel, cpu_native.py) falls back to "sdpa", its fast torch twin, likewise. Triton and the
CUDA extension are imported only when asked for, so importing this package is cheap.
"""

from __future__ import annotations

import warnings

import torch

from kernels.toolchain import chosen_backend

from .reference import (
    NULL_BLOCK,
    check_paged_inputs,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)

# torch: the readable oracle; sdpa: its fast, batched twin; native: decode in C straight from the
# pools (CPU)
BACKENDS = ("torch", "sdpa", "native", "triton", "cuda")

__all__ = [
    "BACKENDS",
    "NULL_BLOCK",
    "check_paged_inputs",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "resolve_backend",
    "write_kv",
    "write_kv_ref",
]


def resolve_backend(backend: str, device, pool_dtype: torch.dtype | None = None) -> str:
    """The backend that will really run for tensors on ``device`` (warns when it is not
    ``backend``); ``pool_dtype``: the KV pools' dtype, which "native" needs to know (it reads fp32,
    bf16 and int8)."""
    if backend == "native":
        from .cpu_native import why_native_cannot_run

        why = why_native_cannot_run(device, pool_dtype)
        if why is None:
            return "native"
        warnings.warn(f"paged attention backend 'native' cannot run here: {why}; "
                      "using 'sdpa' instead", RuntimeWarning, stacklevel=3)
        return "sdpa"
    return chosen_backend(backend, BACKENDS, device, "kernels.paged_attention.triton",
                          "paged attention")


def paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale: float,
                           backend: str = "torch", sliding_window: int | None = None,
                           scales=None):
    """Decode attention over a paged KV cache: q [B, H, D] -> [B, H, D]; with ``sliding_window`` = W
    each query reads only its sequence's last W tokens (table entries before them are not read).
    int8 pools need ``scales = (k_scale, v_scale)``; the CUDA kernel has no int8 variant (torch
    runs)."""
    chosen = resolve_backend(backend, q.device, k_pool.dtype)
    if chosen == "cuda" and scales is not None:
        warnings.warn("the CUDA paged-attention kernel reads fp32/fp16/bf16 pools only; "
                      "int8 KV uses 'torch'", RuntimeWarning, stacklevel=2)
        chosen = "torch"
    if chosen == "triton":
        from .triton import paged_decode_attention_triton as run
    elif chosen == "cuda":
        from .cuda import paged_decode_attention_cuda as run
    elif chosen == "sdpa":
        from .sdpa import paged_decode_attention_sdpa as run
    elif chosen == "native":
        from .cpu_native import paged_decode_attention_native as run
    else:
        run = paged_decode_attention_ref
    return run(q, k_pool, v_pool, block_tables, seq_lens, scale, sliding_window, scales)


def paged_prefill_attention(q, k_pool, v_pool, block_table, q_positions, scale: float,
                            backend: str = "torch", sliding_window: int | None = None,
                            scales=None):
    """Chunked prefill of one sequence over the paged cache: q [Tq, H, D] -> [Tq, H, D]. "sdpa" runs
    PyTorch's fused attention, and so does "native" (its C kernel is for decode: a prefill chunk is
    a real matrix product, torch's flash kernel's job); every other backend the reference
    (kernels/flash_prefill holds the Triton and CUDA prefill kernels)."""
    if backend in ("sdpa", "native"):
        from .sdpa import paged_prefill_attention_sdpa as run
    else:
        run = paged_prefill_attention_ref
    return run(q, k_pool, v_pool, block_table, q_positions, scale, sliding_window=sliding_window,
               scales=scales)


def write_kv(k, v, k_pool, v_pool, slot_mapping, backend: str = "torch", scales=None) -> None:
    """Write new tokens' K/V [N, Hkv, D] into their slots, in place (quantized when the pools are
    int8).

    There is no CUDA write kernel: on a GPU, PyTorch's indexed assignment is already a single
    scatter kernel, so "cuda" uses the torch path (silently: nothing is missing). int8 writes
    (quantize, then scatter) also run in PyTorch on every backend.
    """
    if backend in ("cuda", "sdpa", "native") or scales is not None:
        write_kv_ref(k, v, k_pool, v_pool, slot_mapping, scales)
        return
    if resolve_backend(backend, k.device) == "triton":
        from .triton import write_kv_triton

        write_kv_triton(k, v, k_pool, v_pool, slot_mapping)
    else:
        write_kv_ref(k, v, k_pool, v_pool, slot_mapping)

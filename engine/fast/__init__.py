"""The fast wing: everything that makes a step faster without changing what it computes.

The spine (engine/runner.py, engine/model.py, engine/sampling.py, ...) is the readable engine and
never imports this package; `speed="fast"` brings it in through ONE door, engine/speed.py, which
calls `accelerate` below once per engine. What comes back is an `engine.runner.Acceleration`: the
seams the spine defines, filled in with faster parts.

    the model        a transformed COPY, built once (engine/surgery.py does the walking):
                     fused_projections.py  q/k/v and gate/up as one matrix each
                     packed_linear.py      each linear in the layout this CPU's matmul reads fastest
                     native_ops.py         RMSNorm, SiLU-times-up, RoPE as fused C ops
    attention        attention.py: "sdpa" and "native" planned once per step; the teaching
                     kernels by name
    decode step      native_layers.py: a small decode step's layers in ONE C call
                     (a `runner.DecodeStep`)
    argmax           the sampler's greedy argmax over a batch, in C

Which of these run is decided by probes.py, once, with the reasons in words
(`Acceleration.choices`, `.reasons`); `FastOptions` (engine/config.py) overrides them. Everything
here is checked against the spine: the same greedy tokens as the naive loop, logits equal up to
float rounding (the tests run both speeds).
"""

from __future__ import annotations

from torch import Tensor

from engine.config import FastOptions
from engine.fast import probes
from engine.fast.attention import KernelAttention, PlannedAttention
from engine.fast.fused_projections import fuse_projections
from engine.fast.native_layers import native_layers_or_none, why_native_layers_cannot_run
from engine.fast.native_ops import with_native_ops
from engine.fast.packed_linear import pack_linears
from engine.runner import Acceleration
from engine.sampling import argmax_rows
from kernels.layer_ops import argmax_rows_native, why_layer_ops_cannot_run

PLANNED = ("sdpa", "native")  # the backends that plan a step once (attention.py)


def accelerate(model, kv_pool, options: FastOptions, sliding_window: int | None,
               num_threads: int, transform_model: bool = True) -> Acceleration:
    """The fast parts for one engine: a transformed copy of `model` (`transform_model=False` keeps
    the model as given: a tensor-parallel rank's shards), its attention backend, decode step and
    argmax."""
    name, why_attention = probes.attention_backend(options.attention_backend, kv_pool.device,
                                                   kv_pool.dtype)
    attention = (PlannedAttention(kv_pool, name, sliding_window) if name in PLANNED else
                 KernelAttention(kv_pool, name, sliding_window))  # may fall back, with a warning
    weight = model.embed_tokens.weight if transform_model else None  # (a pipeline stage has none)
    packed = transform_model and probes.use_packed(options.weight_layout, weight.dtype,
                                                   weight.device)
    if packed:
        model = transformed(model, options, num_threads)
    decode_step = native_layers_or_none(model, attention, options.layer_backend) if packed else None
    choices = {"attention": attention.backend, "weight_layout": "packed" if packed else "linear",
               "layer_backend": "native" if decode_step is not None else "python"}
    reasons = {
        "attention": why_attention,
        "weight_layout": ("fused and packed for this CPU's matmuls" if packed
                          else f"kept as nn.Linear: {_why_linear(options, transform_model)}"),
        "layer_backend": ("small decode steps run every layer in one C call"
                          if decode_step is not None else _why_python(model, attention, options)),
    }
    return Acceleration(model, attention, decode_step, fast_argmax, choices, reasons)


def transformed(model, options: FastOptions, num_threads: int):
    """The fast wing's copy of `model`: q/k/v and gate/up stacked, every linear packed for this CPU
    (one column block per thread), and the norms, SiLU and RoPE as C ops unless layer_backend is
    "python". The model given is left as it was."""
    model = pack_linears(fuse_projections(model), blocks=num_threads)
    return with_native_ops(model) if options.layer_backend == "auto" else model


def fast_argmax(logits: Tensor) -> Tensor:
    """[P, V] -> [P]: the C argmax where it runs, else torch's; the same index either way (the
    first of equal maxima)."""
    if why_layer_ops_cannot_run(logits) is None:
        return argmax_rows_native(logits)
    return argmax_rows(logits)


def _why_linear(options: FastOptions, transform_model: bool) -> str:
    if not transform_model:
        return "each rank keeps its shards as they are"
    if options.weight_layout == "linear":
        return "weight_layout='linear'"
    return "packing pays only for fp32 and bf16 on a CPU"


def _why_python(model, attention, options: FastOptions) -> str:
    if not hasattr(model, "embed_tokens") or model.embed_tokens is None:
        return "a pipeline stage keeps its layers in Python"
    if options.layer_backend == "python":
        return "layer_backend='python'"
    return why_native_layers_cannot_run(model, attention) or "the C layers cannot run here"


__all__ = ["accelerate", "fast_argmax"]

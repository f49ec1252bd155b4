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

Which of these run is decided once, with the reasons in words (`Acceleration.choices`,
`.reasons`): probes.py asks what can run; tuning.py measures, per shape class, which of the paths
that can run is fastest on this machine (cached beside the compiled kernels; `python -m engine
doctor` prints it all); `FastOptions` (engine/config.py) overrides them. Everything
here is checked against the spine: the same greedy tokens as the naive loop, logits equal up to
float rounding (the tests run both speeds).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.config import FastOptions
from engine.fast import probes
from engine.fast.attention import KernelAttention, PlannedAttention, prefill_race
from engine.fast.fused_projections import fuse_projections
from engine.fast.native_layers import native_layers_or_none, why_native_layers_cannot_run
from engine.fast.native_ops import with_native_ops
from engine.fast.packed_linear import pack_linears
from engine.fast.tuning import PrefillPlan, Tuning, machine_facts, remeasure_on_build
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
    tuning = Tuning(num_threads)  # this machine's measured choices (tuning.py)
    prefill = c_prefill_plan(model.config, kv_pool, tuning) if name == "native" else None
    c_prefill_tokens = None if prefill is None else prefill.max_tokens  # None: probes.py's rule
    attention = (PlannedAttention(kv_pool, name, sliding_window, c_prefill_tokens)
                 if name in PLANNED else
                 KernelAttention(kv_pool, name, sliding_window))  # may fall back, with a warning
    weight = model.embed_tokens.weight if transform_model else None  # (a pipeline stage has none)
    packed = transform_model and probes.use_packed(options.weight_layout, weight.dtype,
                                                   weight.device)
    if packed:
        model = transformed(model, options, num_threads, tuning)
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
    if decode_step is not None:
        reasons["layer_backend"] += f" (up to {decode_step.max_rows} rows)"
    choices["tuning"], reasons["tuning"] = tuning.mode, f"answers kept in {tuning.folder}"
    for answer, (what, why) in tuning.summary().items():
        choices[answer], reasons[answer] = what, why
    return Acceleration(model, attention, decode_step, fast_argmax, choices, reasons)


def c_prefill_plan(config, kv_pool, tuning: Tuning) -> PrefillPlan | None:
    """How long a whole prompt the C flash-prefill kernel takes for this model's heads, measured
    (tuning.py); None where the pools are not float ones of a dtype it reads."""
    if kv_pool.device.type != "cpu" or kv_pool.dtype not in (torch.float32, torch.bfloat16):
        return None
    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    default_tokens = probes.c_prefill_max_tokens(torch.empty(1, H, D, dtype=kv_pool.dtype))
    default = PrefillPlan(default_tokens, "engine/fast/probes.py's rule", "defaults")
    race = prefill_race(kv_pool.dtype, H, Hkv, D) if default_tokens > 0 else None
    return tuning.c_prefill(kv_pool.dtype, H, Hkv, D, race, default)


def transformed(model, options: FastOptions, num_threads: int, tuning: Tuning | None = None):
    """The fast wing's copy of `model`: q/k/v and gate/up stacked, every linear packed for this CPU
    (one column block per thread, each shape's paths measured by `tuning`), and the norms, SiLU and
    RoPE as C ops unless layer_backend is "python". The model given is left as it was."""
    model = pack_linears(fuse_projections(model), blocks=num_threads, tuning=tuning)
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


__all__ = ["accelerate", "fast_argmax", "machine_facts", "remeasure_on_build"]

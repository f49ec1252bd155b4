"""A decoder layer's small operations fused in C for the CPU (cpu_native.c): RMSNorm, SiLU times
up, RoPE, each one pass over memory in fp32 or bf16, and the sampler's greedy argmax over a batch
of logits. Their oracles are in reference.py (``rms_norm_ref``, ``silu_mul_ref``, ``rope_ref`` /
``rope_ref_``, ``argmax_rows_ref``): the arithmetic of engine/model.py's RMSNorm, MLP and
apply_rope and of ``torch.argmax``, written again below the engine (tests/test_layer_ops.py checks
both links). engine/fast/native_ops.py puts the first three into the engine's copy of the model;
engine/sampling.py calls the argmax."""

from .cpu_native import (
    argmax_rows_native,
    rms_norm_native,
    rope_native_,
    silu_mul_native,
    why_layer_ops_cannot_run,
)
from .reference import argmax_rows_ref, rms_norm_ref, rope_ref, rope_ref_, silu_mul_ref

__all__ = ["argmax_rows_native", "argmax_rows_ref", "rms_norm_native", "rms_norm_ref",
           "rope_native_", "rope_ref", "rope_ref_", "silu_mul_native", "silu_mul_ref",
           "why_layer_ops_cannot_run"]

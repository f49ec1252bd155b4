"""A decoder layer's small operations fused in C for the CPU (cpu_native.c): RMSNorm, SiLU times up, RoPE, each one
pass over memory in fp32 or bf16, and the sampler's greedy argmax over a batch of logits. Oracles: engine/model.py's
RMSNorm, ``F.silu(gate) * up``, ``apply_rope`` and ``torch.argmax`` (tests/test_layer_ops.py). engine/fast/native_ops.py
puts the first three into the engine's copy of the model; engine/sampling.py calls the argmax."""

from .cpu_native import argmax_rows_native, rms_norm_native, rope_native_, silu_mul_native, why_layer_ops_cannot_run

__all__ = ["argmax_rows_native", "rms_norm_native", "rope_native_", "silu_mul_native", "why_layer_ops_cannot_run"]

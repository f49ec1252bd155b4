"""A decoder layer's small operations fused in C for the CPU (cpu_native.c): RMSNorm, SiLU times up, RoPE, each one
pass over memory in fp32 or bf16. Oracles: engine/model.py's RMSNorm, ``F.silu(gate) * up`` and ``apply_rope``
(tests/test_layer_ops.py). engine/native_ops.py puts them into the engine's copy of the model."""

from .cpu_native import rms_norm_native, rope_native_, silu_mul_native, why_layer_ops_cannot_run

__all__ = ["rms_norm_native", "rope_native_", "silu_mul_native", "why_layer_ops_cannot_run"]

"""Every decoder layer of a small decode step in one C call (cpu_native.c): the norms, RoPE, KV writes, residuals
and SwiGLU as plain loops, the matmuls and attention through the C kernels the Python path already uses
(kernels/gemv, kernels/quant_matmul, kernels/paged_attention). The oracle is engine/model.py's DecoderLayer;
engine/fast/native_layers.py decides when the engine uses it."""

from .cpu_native import (
    LINEAR_KINDS,
    Layer,
    Linear,
    ModelDims,
    decoder_layers_native,
    kernel_pointers,
    why_library_cannot_load,
)

__all__ = ["LINEAR_KINDS", "Layer", "Linear", "ModelDims", "decoder_layers_native", "kernel_pointers",
           "why_library_cannot_load"]

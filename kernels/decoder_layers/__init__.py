"""Every decoder layer of a small decode step in one C call (cpu_native.c): the norms, RoPE, KV
writes, residuals and SwiGLU as plain loops, the matmuls and attention through the C kernels the
Python path already uses (kernels/gemv, kernels/quant_matmul, kernels/paged_attention). The oracle
is ``decoder_layers_ref`` (reference.py: the same step over plain tensors, ``LayerTensors``, built
from those folders' references; tests/test_decoder_layers_reference.py), and through the engine
engine/model.py's DecoderLayer (tests/test_native_layers.py). engine/fast/native_layers.py decides
when the engine uses it."""

from .cpu_native import (
    LINEAR_KINDS,
    Layer,
    Linear,
    ModelDims,
    decoder_layers_native,
    kernel_pointers,
    why_library_cannot_load,
)
from .reference import LayerTensors, decoder_layer_ref, decoder_layers_ref

__all__ = ["LINEAR_KINDS", "Layer", "LayerTensors", "Linear", "ModelDims", "decoder_layer_ref",
           "decoder_layers_native", "decoder_layers_ref", "kernel_pointers",
           "why_library_cannot_load"]

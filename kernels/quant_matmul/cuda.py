"""Build, run and inspect the CUDA dequant-GEMV (``quant_matmul.cu``).

- ``quant_matmul_cuda(x, qw)`` compiles the .cu file into a PyTorch extension the first time
  (``torch.utils.cpp_extension.load``: a GPU build of torch, nvcc and ninja) and runs it. Same
  contract as ``quant_matmul_ref``.
- ``nvcc_resource_report()`` needs only ``nvcc``: it compiles to a cubin and returns ptxas's lines
  (registers per thread, spills) for each of the six kernels (3 activation types x int8/int4).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.paged_attention.cuda import registers_per_kernel
from kernels.toolchain import build_cuda_extension, demangle, ptxas_lines

from .reference import QuantizedWeight, check_activations, check_quantized_weight

CU_FILE = Path(__file__).with_name("quant_matmul.cu")
EXTENSION_NAME = "servelab_quant_matmul"

__all__ = ["nvcc_resource_report", "quant_matmul_cuda", "registers_per_kernel"]


@functools.cache  # compile once per process; torch also caches the build on disk
def load_cuda_extension():
    """Compile (or load from torch's build cache) the extension; needs CUDA, nvcc and ninja."""
    return build_cuda_extension(EXTENSION_NAME, CU_FILE, "quantized matmul")


def quant_matmul_cuda(x: torch.Tensor, qw: QuantizedWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``quant_matmul_ref``: x [..., K] -> [..., N] (fp32 accumulation)."""
    check_quantized_weight(qw)
    check_activations(x, qw)
    if x.device.type != "cuda":
        raise ValueError(f"x: the CUDA kernel needs tensors on a CUDA device, got {x.device}")
    if qw.bits == 4 and qw.group_size % 2:
        raise ValueError("group_size: int4 groups must hold an even number of inputs, "
                         f"got {qw.group_size}")
    n, k = qw.shape
    per_tensor = qw.per_tensor
    scales = qw.scales.contiguous()
    zeros = scales if qw.zeros is None else qw.zeros.contiguous()  # the int8 kernel never reads it
    stride_sn, stride_sg = (0, 0) if per_tensor else (scales.stride(0), 1)
    y = load_cuda_extension().dequant_gemv(x.reshape(-1, k).contiguous(), qw.qweight.contiguous(),
                                           scales, zeros, n, qw.bits, qw.group_size, stride_sn,
                                           stride_sg)
    y = y.reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


def nvcc_resource_report(arch: str = "sm_90", cu_file: Path = CU_FILE) -> str:
    """Compile ``cu_file`` for ``arch`` with ``nvcc -cubin -Xptxas -v``; return ptxas's lines per
    kernel.

    Raises RuntimeError when nvcc is missing or fails."""
    lines = ptxas_lines(cu_file, arch)
    return demangle("\n".join(lines))

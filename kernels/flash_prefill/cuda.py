"""Build, run and inspect the CUDA flash prefill kernel (``flash_prefill.cu``).

Two ways in, as for ``kernels/paged_attention/cuda.py``:
- ``flash_attention_cuda(q, k, v, scale)`` compiles the .cu file into a PyTorch extension the
  first time (``torch.utils.cpp_extension.load``: needs a GPU build of torch, nvcc and ninja;
  about a minute) and runs it. Same contract as ``causal_attention_naive``.
- ``nvcc_resource_report()`` needs only ``nvcc``, no GPU and no torch headers: it compiles the
  file to a cubin and returns what ptxas says about each kernel (registers per thread, spills,
  barriers). This kernel keeps up to 32 fp32 accumulators per thread (D = 256 over 8 lanes), so
  registers are the number to watch: they decide how many 128-thread blocks share one SM.
"""

from __future__ import annotations

import functools
from pathlib import Path

from kernels.toolchain import build_cuda_extension, demangle, ptxas_lines

from .reference import check_flash_inputs

CU_FILE = Path(__file__).with_name("flash_prefill.cu")
EXTENSION_NAME = "servelab_flash_prefill"
MAX_HEAD_DIM = 256  # MAX_HEAD_DIM in the .cu file: 8 lanes per query row x 32 accumulators each
SMEM_FLOATS_PER_BLOCK = "48 * (D + 1) + 272"  # Q, K, V tiles [16][D + 1] and P [16][17], in fp32


@functools.cache  # compile once per process; torch also caches the build on disk
def load_cuda_extension():
    """Compile (or load from torch's build cache) the extension; needs CUDA, nvcc and ninja."""
    return build_cuda_extension(EXTENSION_NAME, CU_FILE, "flash-prefill kernel")


def flash_attention_cuda(q, k, v, scale: float):
    """Same contract as ``causal_attention_naive``: q [T, H, D], k/v [T, Hkv, D] -> out
    [T, H, D]."""
    check_flash_inputs(q, k, v, scale)
    if q.device.type != "cuda":
        raise ValueError(f"q: the CUDA kernel needs tensors on a CUDA device, got {q.device}; "
                         "use backend 'torch' or 'triton' on the CPU")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D = {q.shape[2]} is above the kernel's maximum "
                         f"{MAX_HEAD_DIM}")
    ext = load_cuda_extension()
    return ext.flash_prefill(q.contiguous(), k.contiguous(), v.contiguous(), float(scale))


def nvcc_resource_report(arch: str = "sm_90", cu_file: Path = CU_FILE) -> str:
    """Compile ``cu_file`` for ``arch`` with ``nvcc -cubin -Xptxas -v``; return ptxas's lines.

    One block of lines per kernel instantiation (float, half, bfloat16), names demangled where
    ``c++filt`` exists, e.g. ``Used 96 registers, used 1 barriers``. Raises RuntimeError when
    nvcc is missing or fails.
    """
    lines = ptxas_lines(cu_file, arch)
    lines.append(f"dynamic shared memory per thread block: ({SMEM_FLOATS_PER_BLOCK}) * 4 bytes "
                 "(e.g. D = 128: 25856 bytes)")
    return demangle("\n".join(lines))


"""Build, run and inspect the CUDA paged decode kernels (``paged_attention.cu``): the one-pass
kernel, and split-K's partition and reduce kernels (``split_k.py`` says when each runs).

Two ways in:
- ``paged_decode_attention_cuda(...)`` compiles the .cu file into a PyTorch extension the first
  time (``torch.utils.cpp_extension.load``: needs a GPU build of torch, nvcc and ninja; about a
  minute) and runs it. Same contract as ``paged_decode_attention_ref``.
- ``nvcc_resource_report()`` needs only ``nvcc``, no GPU and no torch headers: it compiles the
  file to a cubin and returns what ptxas says about each kernel (registers per thread, spills,
  barriers). Registers decide how many thread blocks fit on one SM, so this is the first number
  to look at when a kernel is slower than its bandwidth says it should be.
"""

from __future__ import annotations

import functools
from pathlib import Path

from kernels.toolchain import build_cuda_extension, demangle, ptxas_lines

from .reference import check_paged_inputs
from .split_k import check_num_partitions, partition_plan

CU_FILE = Path(__file__).with_name("paged_attention.cu")
EXTENSION_NAME = "servelab_paged_attention"
MAX_HEAD_DIM = 512  # NUM_THREADS (128) x MAX_DIMS_PER_THREAD (4) in the .cu file
# the attention kernels' dynamic shared memory (one-pass and partition alike): q, scores,
# probabilities; the reduce kernel uses none
SMEM_FLOATS_PER_BLOCK = "D + 2 * BS"
MAX_SMEM_BYTES = 48 * 1024  # dynamic shared memory a launch gets without opting in to more


@functools.cache  # compile once per process; torch also caches the build on disk
def load_cuda_extension():
    """Compile (or load from torch's build cache) the extension; needs CUDA, nvcc and ninja."""
    return build_cuda_extension(EXTENSION_NAME, CU_FILE, "paged-attention kernel")


def paged_decode_attention_cuda(q, k_pool, v_pool, block_tables, seq_lens, scale: float,
                                sliding_window: int | None = None, scales=None,
                                num_partitions: int | None = None):
    """Same contract as ``paged_decode_attention_ref``: q [B, H, D] -> out [B, H, D] (float pools
    only). ``num_partitions``: 1 runs the one-pass kernel, P > 1 the split-K kernels (partitions,
    then the reduce), None lets ``split_k.choose_num_partitions`` pick for B * H thread blocks."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, seq_lens, scale, sliding_window, scales)
    check_num_partitions(num_partitions)
    if scales is not None:
        raise ValueError("scales: the CUDA kernel reads float pools only; "
                         "use backend 'torch' or 'triton' for int8 KV")
    if q.device.type != "cuda":
        raise ValueError(f"q: the CUDA kernel needs tensors on a CUDA device, got {q.device}")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D = {q.shape[2]} is above the kernel's maximum "
                         f"{MAX_HEAD_DIM}")
    smem_bytes = (q.shape[2] + 2 * k_pool.shape[1]) * 4
    if smem_bytes > MAX_SMEM_BYTES:
        max_bs = (MAX_SMEM_BYTES // 4 - q.shape[2]) // 2
        raise ValueError(f"k_pool: block size BS = {k_pool.shape[1]} needs {smem_bytes} bytes "
                         f"of shared memory, above {MAX_SMEM_BYTES}; use BS <= {max_bs}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim D must be contiguous (stride 1), "
                             f"got {pool.stride()}")
    # one thread block per query head: H of them per sequence before splitting
    num_partitions, per_partition = partition_plan(
        num_partitions, q.shape[0], q.shape[1], block_tables.shape[1], k_pool.shape[1],
        sliding_window, q.device)
    ext = load_cuda_extension()
    return ext.paged_decode(q.contiguous(), k_pool, v_pool, block_tables.contiguous(),
                            seq_lens.contiguous(), float(scale), int(sliding_window or 0),
                            num_partitions, per_partition)


def nvcc_resource_report(arch: str = "sm_90", cu_file: Path = CU_FILE) -> str:
    """Compile ``cu_file`` for ``arch`` with ``nvcc -cubin -Xptxas -v``; return ptxas's lines.

    One block of lines per kernel instantiation, names demangled where ``c++filt`` exists, e.g.
    ``Used 56 registers, used 1 barriers``. Raises RuntimeError when nvcc is missing or fails.
    """
    lines = ptxas_lines(cu_file, arch)
    lines.append(f"dynamic shared memory per thread block: ({SMEM_FLOATS_PER_BLOCK}) * 4 bytes "
                 "(e.g. D = 128, BS = 16: 640 bytes)")
    return demangle("\n".join(lines))


def registers_per_kernel(report: str) -> dict[str, int]:
    """{kernel name: registers per thread} from an ``nvcc_resource_report`` text."""
    registers, kernel = {}, None
    for line in report.splitlines():
        if "Compiling entry function" in line:
            kernel = line.split("'")[1]
        elif "registers" in line and kernel is not None:
            registers[kernel] = int(line.split("Used")[1].split()[0])
            kernel = None
    return registers

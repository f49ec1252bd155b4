"""Every question the fast wing asks the machine, and every threshold it picks a path by, in one
place.

The fast wing asks these once, when an engine is built (`engine.fast.accelerate`), and hands the
engine what it chose and why, in words (`Acceleration.choices` and `.reasons`). The engine records
both in its trace; the CLI prints them (`python -m engine generate ... --speed fast`, a line each).

The thresholds below were measured on the CPUs this project has run on; each says what it trades,
and the numbers behind it live in benchmarks/results/ (`attention_backends.md`,
`profile_offline.md`, `vs_vllm*.md`) and kernels/README.md, with the command that produced them.
They are the DEFAULTS: where the winner differs from CPU to CPU (the C gemv's rows, oneDNN or MKL
per row count, the C prefill's length), engine/fast/tuning.py races the paths on the machine
itself, once per shape class, and a measured answer replaces the constant when it wins clearly.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from kernels.flash_prefill.cpu_native import why_native_cannot_run as why_c_prefill_cannot_run
from kernels.gemv import GEMV_MAX_ROWS
from kernels.paged_attention.cpu_native import why_native_cannot_run as why_c_decode_cannot_run

# bf16 prompts of this many tokens or more stay on torch's flash kernel where the CPU has bf16
# instructions (AMX): there it overtakes the C flash-prefill kernel's fp32 FMAs at about this
# length. fp32 prompts and CPUs without bf16 instructions always take the C kernel
# (benchmarks/results/attention_backends.md).
C_PREFILL_BF16_MAX_TOKENS = 512
# Decode rows the C matrix-vector kernel takes in bf16 where oneDNN runs bf16 GEMMs in hardware:
# past this, oneDNN's AMX GEMM costs less than the C kernel's growing arithmetic. fp32 (and bf16
# without bf16 instructions): every row the kernel takes, GEMV_MAX_ROWS.
BF16_GEMV_MAX_ROWS = 8
# without the C kernel: the column-block bmm's rows (a decode step of 1 or 2)
COLUMN_BLOCK_MAX_ROWS = 2
# oneDNN picks its blocked layout for a typical row count; 16 served 2..1024 rows well (a hint of 1
# did not, 128 lost at 256 rows). It is a hint only: any row count runs.
ONEDNN_ROWS_HINT = 16
# Dtypes whose CPU matmuls run faster from the packed layout than nn.Linear's (packed_linear.py).
PACKED_IS_FASTER = {torch.float32: True, torch.bfloat16: True, torch.float16: False}


def onednn_available() -> bool:
    """Whether this torch build can pack a weight for oneDNN's CPU matmul."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def bf16_instructions() -> bool:
    """Whether oneDNN runs bf16 GEMMs in hardware here (avx512_bf16 / AMX); without them a bf16
    GEMM is emulated, several times slower than an fp32 one."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def gemv_max_rows(dtype: torch.dtype) -> int:
    """The most rows of x that go to the C matrix-vector kernel: all it takes in fp32 (and in bf16
    without bf16 instructions, where oneDNN would compute from an fp32 copy, twice the bytes);
    BF16_GEMV_MAX_ROWS in bf16 where oneDNN has them."""
    if dtype == torch.bfloat16 and bf16_instructions():
        return BF16_GEMV_MAX_ROWS
    return GEMV_MAX_ROWS


def use_packed(layout: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `weight_layout` = `layout` packs a model of this dtype on this device."""
    if layout == "auto":
        return device.type == "cpu" and PACKED_IS_FASTER.get(dtype, False)
    return layout == "packed"


def c_prefill_max_tokens(q: Tensor) -> int:
    """The longest whole prompt of queries like `q` the C flash-prefill kernel takes: 0 where it
    cannot run, C_PREFILL_BF16_MAX_TOKENS - 1 for bf16 where the CPU has bf16 instructions, else no
    limit (sys.maxsize)."""
    if why_c_prefill_cannot_run(q) is not None:
        return 0
    if q.dtype == torch.bfloat16 and bf16_instructions():
        return C_PREFILL_BF16_MAX_TOKENS - 1
    return sys.maxsize


def attention_backend(requested: str, device, pool_dtype: torch.dtype) -> tuple[str, str]:
    """The attention backend to build, and why: "auto" is native where its C kernel runs, else
    sdpa."""
    if requested != "auto":
        return requested, "asked for by attention_backend"
    why = why_c_decode_cannot_run(device, pool_dtype)
    if why is None:
        return "native", "the C decode kernel builds and reads these pools"
    return "sdpa", f"the C decode kernel cannot run ({why})"

"""Every question the fast wing asks the machine, and every threshold it picks a path by, in one
place.

The fast wing never guesses per call: `choose(...)` asks each question once, when an engine is
built, and returns `Choices`, what will run and why, in words. The engine records them in its trace;
the CLI prints them (`python -m engine generate ... --speed fast` logs one line each).

The thresholds below were measured on the CPUs this project has run on; each says what it trades,
and the numbers behind it live in benchmarks/results/ (`attention_backends.md`,
`profile_offline.md`, `vs_vllm*.md`) and kernels/README.md, with the command that produced them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def c_prefill_takes(q: Tensor, num_tokens: int) -> bool:
    """Does the C flash-prefill kernel take a whole prompt of `num_tokens` queries like `q`?"""
    if why_c_prefill_cannot_run(q) is not None:
        return False
    long_bf16 = q.dtype == torch.bfloat16 and bf16_instructions()
    return not long_bf16 or num_tokens < C_PREFILL_BF16_MAX_TOKENS


def attention_backend(requested: str, device, pool_dtype: torch.dtype) -> tuple[str, str]:
    """The attention backend to build, and why: "auto" is native where its C kernel runs, else
    sdpa."""
    if requested != "auto":
        return requested, "asked for by attention_backend"
    why = why_c_decode_cannot_run(device, pool_dtype)
    if why is None:
        return "native", "the C decode kernel builds and reads these pools"
    return "sdpa", f"the C decode kernel cannot run ({why})"


@dataclass
class Choices:
    """What the fast wing chose for one engine, each with its reason in words."""

    attention: str = "sdpa"
    weight_layout: str = "linear"
    layer_backend: str = "python"
    reasons: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, str]:
        """{"attention": "native (the C decode kernel builds ...)", ...}: for the trace and the
        CLI."""
        picked = {"attention": self.attention, "weight_layout": self.weight_layout,
                  "layer_backend": self.layer_backend}
        return {k: f"{v} ({self.reasons[k]})" if k in self.reasons else v
                for k, v in picked.items()}

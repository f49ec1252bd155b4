"""Decode-time matrix-vector products for the CPU (kernels/gemv/cpu_native.c): y = x W^T for one or two rows
of x, fp32 or bf16 weights as nn.Linear stores them. The oracle is ``torch.nn.functional.linear`` (with the
weight widened to fp32: the kernel computes in fp32). engine/fast/packed_linear.py calls it for decode rows."""

from .cpu_native import GEMV_MAX_ROWS, gemv_native, why_gemv_cannot_run

__all__ = ["GEMV_MAX_ROWS", "gemv_native", "why_gemv_cannot_run"]

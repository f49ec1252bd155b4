"""Decode-time matrix-vector products for the CPU (kernels/gemv/cpu_native.c): y = x W^T (+ b) for
1 to ``GEMV_MAX_ROWS`` (16) rows of x, fp32 or bf16 weights as nn.Linear stores them, fp32
arithmetic. The oracle is ``gemv_ref`` (reference.py: the same product in PyTorch, with the bytes
it reads counted). engine/fast/packed_linear.py calls the kernel for decode rows; how many rows it
gives it per dtype is ``gemv_max_rows``'s choice (engine/fast/probes.py)."""

from .cpu_native import GEMV_MAX_ROWS, gemv_native, why_gemv_cannot_run
from .reference import check_gemv_inputs, gemv_ref

__all__ = ["GEMV_MAX_ROWS", "check_gemv_inputs", "gemv_native", "gemv_ref", "why_gemv_cannot_run"]

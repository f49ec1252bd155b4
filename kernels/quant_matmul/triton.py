"""A fused dequantize-GEMV for int8 and int4 weights, in Triton.

What: y = x @ W^T where W [N, K] is stored as integers q with per-group scales s (and int4 zero
points z): w = (q - z) * s. At decode time x is a handful of rows (batch B, often 1): a GEMV.

Why a kernel: a GEMV does 2 flops per weight and reads every weight once, so its time is the bytes
it reads. Count them per OUTPUT (one row of W, K weights), for the reference's
dequantize-then-matmul:

    dequantize:  read K * bits/8 (the integers) + (K/G) * 8 (scale, zero)   write K * 4 (fp32 row)
    matmul:      read K * 4 (the fp32 row back)

With K = 4096, G = 128, int4: 2048 + 256 + 16384 + 16384 = 35 072 bytes per output, MORE than the
16 384 of a plain fp32 GEMV: quantized, yet about 2x slower (one answer to chapter 07's question 5).
The fused kernel never writes the fp32 row: it loads the packed integers, turns them into floats in
registers and multiplies at once, 2048 + 256 = 2 304 bytes per output, 7.1x fewer than fp32.
``gemv_bytes_per_output`` does this count for any shape.

The kernel: one program per (BLOCK_N outputs, one row of x). It walks K in BLOCK_K steps:

    acc[BLOCK_N] = 0
    for k0 in range(0, K, BLOCK_K):
        q  = load the integers W[n, k0:k0+BLOCK_K]        int8, or packed nibbles split by
                                                          & 0xF, >> 4
        s  = scales[n, k // G], z = zeros[n, k // G]      one gather per weight: L1-resident
        acc += sum_k x[k] * (q - z) * s                   fp32
    y[n] = acc

int4 keeps even k in a byte's low nibble and odd k in its high one, so the kernel loads BLOCK_K/2
bytes and the matching even and odd slices of x. A per-tensor weight passes scale strides of 0.
On a CPU without a GPU, set TRITON_INTERPRET=1 before Triton is imported (tests/conftest.py does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import QuantizedWeight, check_activations, check_quantized_weight

SCALE_AND_ZERO_BYTES = 8  # one fp32 scale + one fp32 zero point per group (int8: 4, no zero)
FP32_BYTES, BF16_BYTES = 4, 2
BLOCK_N = 16  # outputs per program
BLOCK_K = 64  # inputs per step (even, so int4 bytes never straddle a step)


def gemv_bytes_per_output(K: int, bits: int, group_size: int) -> dict[str, int]:
    """Bytes read (and written) per output of a GEMV with K inputs: fp32, bf16, naive and fused."""
    meta = (K // group_size) * (SCALE_AND_ZERO_BYTES if bits == 4 else FP32_BYTES)
    integers = K * bits // 8
    return {"fp32": K * FP32_BYTES, "bf16": K * BF16_BYTES,
            # dequantize (write fp32) + matmul (read it)
            "naive": integers + meta + 2 * K * FP32_BYTES,
            "fused": integers + meta}


@triton.jit
def _dequant_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, y_ptr,
    N, K, GROUP,
    stride_xm, stride_qn, stride_sn, stride_sg, stride_ym,
    BITS: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n, m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    if BITS == 8:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            mask = n_mask[:, None] & k_mask[None, :]
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask,
                        other=0.0).to(tl.float32)  # [BK]
            q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask,
                        other=0).to(tl.float32)
            s_off = offs_n[:, None] * stride_sn + (offs_k // GROUP)[None, :] * stride_sg
            s = tl.load(s_ptr + s_off, mask=mask, other=0.0)  # [BN, BK]
            acc += tl.sum(q * s * x[None, :], axis=1)
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        for k0 in range(0, K, BLOCK_K):
            offs_b = k0 // 2 + tl.arange(0, HALF)  # byte j holds inputs 2j (low) and 2j + 1 (high)
            b_mask = offs_b < K // 2
            mask = n_mask[:, None] & b_mask[None, :]
            byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :], mask=mask,
                           other=0).to(tl.int32)
            # [BN, BK/2] each
            q_even, q_odd = (byte & 0xF).to(tl.float32), (byte >> 4).to(tl.float32)
            x_even = tl.load(x_ptr + m * stride_xm + 2 * offs_b, mask=b_mask,
                             other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + m * stride_xm + 2 * offs_b + 1, mask=b_mask,
                            other=0.0).to(tl.float32)
            # a group holds an even number of inputs, so 2j and 2j + 1 share one (scale, zero)
            g_off = offs_n[:, None] * stride_sn + (2 * offs_b // GROUP)[None, :] * stride_sg
            s = tl.load(s_ptr + g_off, mask=mask, other=0.0)
            z = tl.load(z_ptr + g_off, mask=mask, other=0.0)
            acc += tl.sum(((q_even - z) * x_even[None, :] + (q_odd - z) * x_odd[None, :]) * s,
                          axis=1)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def quant_matmul_triton(x: torch.Tensor, qw: QuantizedWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``quant_matmul_ref``: x [..., K] -> [..., N] (fp32 accumulation)."""
    check_quantized_weight(qw)
    check_activations(x, qw)
    if qw.bits == 4 and qw.group_size % 2:
        raise ValueError("group_size: int4 groups must hold an even number of inputs, "
                         f"got {qw.group_size}")
    n, k = qw.shape
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return y.reshape(*x.shape[:-1], n)
    per_tensor = qw.per_tensor
    scales = qw.scales.contiguous()
    zeros = scales if qw.zeros is None else qw.zeros.contiguous()  # unused for int8
    _dequant_gemv_kernel[(triton.cdiv(n, BLOCK_N), x2.shape[0])](
        x2, qw.qweight.contiguous(), scales, zeros, y,
        n, k, qw.group_size,
        x2.stride(0), qw.qweight.stride(0), 0 if per_tensor else scales.stride(0),
        0 if per_tensor else 1,
        y.stride(0),
        BITS=qw.bits, HAS_ZERO=qw.zeros is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    y = y.reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


def runs_on_cpu() -> bool:
    """True when Triton was imported in interpreter mode, so CPU tensors can be launched on."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_dequant_gemv_kernel, InterpretedFunction)

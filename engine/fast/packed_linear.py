"""Packed weights: each linear layer's matrix stored the way this CPU's matmul reads it fastest.

`nn.Linear` keeps its weight as W [N, K] (N outputs, K inputs) and computes y = x W^T. That is the
layout checkpoints ship, and it is what the model file and every oracle test read. But the layout a
weight sits in decides how fast a CPU matmul can read it, and reading the weights is most of a step:
at decode time every token of the batch multiplies by every matrix of the model (chapter 02).

What we measured (fp32, torch 2.13's CPU build, a 2-core AMD EPYC with AVX2 and no AVX-512; 20 distinct
576 x 3072 matrices, SmolLM2-135M's MLP shape, so that they stream from memory, not from cache), in
GFLOP/s of useful work, two threads:

    rows M (tokens in the step)     1      2      8     16     33     64    256   1024
    F.linear on W [N, K]            3      3     14     27     39     58     78     79
    column blocks [P, K, N/P]       7      9     21     32     54     66     73     67
    oneDNN's blocked layout         5     10     28     47     67     71    117    126

(one row: 2 FLOPs per 4-byte weight, so 7 GFLOP/s is 14 GB/s, this machine's whole read bandwidth on
two cores; one thread showed the same order.) No single layout wins everywhere, so we keep two:

- M <= 2 (a decode step of one or two sequences: a matrix-VECTOR product, bound by memory):
  W^T cut into P column blocks, one per thread, all multiplied by ONE batched matmul

      W^T [K, N]  ──cut the N output columns into P blocks──►  blocks [P, K, N/P]
      x [M, K] broadcast to every block (a view) ─► bmm ─► [P, M, N/P] ─► block p = columns p*N/P ..

  torch runs a bmm's batch entries on separate threads, so each core streams its own block, start to
  finish; MKL's own GEMV on [N, K] left half the bandwidth unused.
- larger M (batched decode, prefill: matrix-MATRIX products, bound by arithmetic): oneDNN's blocked
  layout, made once by `torch.ops.mkldnn._reorder_linear_weight` (what torch's compiler uses when it
  freezes a CPU model), so its GEMM kernel reads the weight in the order its registers want.

The numbers are the model's: `PackedLinear(x)` equals `nn.Linear(x)` up to float rounding (the sums
happen in a different order), and the engine's greedy tokens equal the naive loop's (the tests check
both). Where it pays is a property of the machine, not of the model:
- fp32 on a CPU: packed (the table above; `weight_layout="auto"` picks it);
- bf16 on a CPU: decode rows read the bf16 weight as it is ([N, K], half the bytes of fp32:
  torch's bf16 GEMV streamed 10 GB/s here against 7 for fp32 F.linear); more rows run oneDNN's GEMM, in
  bf16 where the CPU has bf16 instructions (avx512_bf16, AMX) and otherwise in fp32 from an fp32 copy of
  the bf16 weights: on this AVX2 EPYC a bf16 GEMM is emulated at 13-16 GFLOP/s, the fp32 one runs at
  50-117 (16-1024 rows). fp16: "auto" leaves it as nn.Linear;
- a GPU: cuBLAS reads either layout at full speed; "auto" leaves it alone.

Since then a C matrix-vector kernel (kernels/gemv) took over the decode rows where it builds, fp32 and bf16
(on one thread too, where the column blocks had been a little faster, because the C decoder layers of
engine/fast/native_layers.py read W as [N, K]): it reads W where nn.Linear keeps it, at 29 GB/s on two cores of an
AMD EPYC with AVX-512 where the column blocks reached 25, and bf16 at 1.5x torch's bf16 GEMV (so bf16 finally
pays at batch 1).

The cost is memory. In fp32: one oneDNN copy of every linear weight (and the column blocks where the C
kernel cannot be built); in bf16: one oneDNN copy (in fp32 where the CPU lacks bf16 instructions, so twice
the bf16 bytes).
The engine packs a shallow copy of the model, so the model you passed in is untouched (it is still
`engine.model`, the one the oracle tests and notebooks read), and while you hold it, it lives too
(SmolLM2-135M in fp32: 0.54 GB for each copy).
Fine for the models this project runs on a laptop; a bigger model would keep one layout only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.fast.probes import (
    COLUMN_BLOCK_MAX_ROWS,
    ONEDNN_ROWS_HINT,
    bf16_instructions,
    gemv_max_rows,
    onednn_available,
)
from engine.surgery import replaced
from kernels.gemv import gemv_native, why_gemv_cannot_run


class PackedLinear(nn.Module):
    """y = x W^T + b with W held twice, in the layouts of the module docstring, picked by the number of rows M:

        M <= gemv_rows       where our C kernel builds (kernels/gemv), fp32 and bf16 weights: W itself, [N, K],
                             shared with the original, streamed by the C matrix-vector kernel in fp32 arithmetic
                             (bf16 widened in registers: half the bytes of fp32, the whole point at batch 1; fp32
                             on 2 threads: 29 GB/s against the bmm's 25);
                             else fp32: `packed` [P, K, N/P], P column blocks of W^T (P = `blocks` if it divides
                             N, else 1: then packed[0] is simply W^T [K, N]); bf16: W through F.linear
        M > gemv_rows        `onednn`: oneDNN's blocked copy, in bf16 where the CPU has bf16 instructions,
                             else in fp32 (the rows are cast up and the result back: the GEMM then runs at fp32
                             speed instead of an emulated bf16 one); None where oneDNN is missing
    """

    def __init__(self, linear: nn.Linear, blocks: int):
        super().__init__()
        if blocks < 1:
            raise ValueError(f"blocks must be >= 1 (one per thread), got {blocks}")
        weight = linear.weight.detach()
        N, K = weight.shape  # nn.Linear: [out, in]
        P = blocks if N % blocks == 0 else 1
        self.in_features, self.out_features, self.blocks = K, N, P
        self.bias = None if linear.bias is None else linear.bias.detach()  # [N]
        # (fp32 on ONE thread, the column-block bmm streamed a little faster on an AMD EPYC Zen 4, 16 vs 15 GB/s;
        # the C kernel is used all the same: the C decoder layers, engine/fast/native_layers.py, need W as [N, K])
        self.gemv_weight = weight if why_gemv_cannot_run(weight) is None else None  # [N, K], no copy
        self.gemv_bias = None if self.bias is None else self.bias.float()
        # decode steps of up to this many rows: the C kernel (or, where it cannot run, the column blocks)
        self.gemv_rows = gemv_max_rows(weight.dtype) if self.gemv_weight is not None else COLUMN_BLOCK_MAX_ROWS
        if self.gemv_weight is not None or weight.dtype == torch.bfloat16:
            self.packed, self.weight = None, weight  # [N, K], no copy (read by the C kernel or F.linear)
        else:
            self.packed = weight.t().reshape(K, P, N // P).permute(1, 0, 2).contiguous()  # [P, K, N/P]
        keep_bf16 = weight.dtype == torch.bfloat16 and bf16_instructions()
        self.gemm_dtype = torch.bfloat16 if keep_bf16 else torch.float32
        use_onednn = (onednn_available() and weight.device.type == "cpu"
                      and weight.dtype in (torch.float32, torch.bfloat16))
        self.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight.to(self.gemm_dtype), ONEDNN_ROWS_HINT)
                       if use_onednn else None)
        self.gemm_bias = None if self.bias is None else self.bias.to(self.gemm_dtype)

    def forward(self, x: Tensor) -> Tensor:  # x [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if 0 < rows.shape[0] <= self.gemv_rows and self.gemv_weight is not None:  # (no rows: F.linear below)
            y = gemv_native(rows.float().contiguous(), self.gemv_weight, self.gemv_bias).to(x.dtype)  # [M, N]
        elif rows.shape[0] > self.gemv_rows and self.onednn is not None:
            y = torch.ops.mkldnn._linear_pointwise(rows.to(self.gemm_dtype), self.onednn, self.gemm_bias,
                                                   "none", [], "").to(x.dtype)  # [M, N]
        elif self.packed is None:
            y = F.linear(rows, self.weight, self.bias)  # bf16 GEMV on [N, K]
        else:
            y = self._blocks_matmul(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def _blocks_matmul(self, rows: Tensor) -> Tensor:
        """[M, K] @ the column blocks -> [M, N], one bmm over the P blocks (one per thread)."""
        (M, K), P, N = rows.shape, self.blocks, self.out_features
        if P == 1:
            w = self.packed[0]  # [K, N]
            return rows @ w if self.bias is None else torch.addmm(self.bias, rows, w)
        out = torch.bmm(rows.expand(P, M, K), self.packed)  # [P, M, N/P]: every block reads the same rows
        # [P, M, N/P] -> [M, P, N/P] -> [M, N]: block p holds output columns p*N/P .. (p+1)*N/P - 1
        y = out.view(M, N) if M == 1 else out.transpose(0, 1).reshape(M, N)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.blocks}, "
                f"onednn={self.onednn is not None}, gemm_dtype={self.gemm_dtype}")


def pack_linears(model: nn.Module, blocks: int) -> nn.Module:
    """A copy of `model` whose plain nn.Linear layers are PackedLinear; the original is left as it was.

    Only exact `nn.Linear` modules are packed: quantized layers (chapter 07) have their own kernels and
    stay as they are. Everything else is shared, not copied (engine/surgery.py).
    """
    return replaced(model, lambda name, m: PackedLinear(m, blocks) if type(m) is nn.Linear else None)

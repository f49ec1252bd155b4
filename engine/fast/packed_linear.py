"""Packed weights: each linear layer's matrix stored the way this CPU's matmul reads it fastest.

`nn.Linear` keeps its weight as W [N, K] (N outputs, K inputs) and computes y = x W^T. That is the
layout checkpoints ship, and it is what the model file and every oracle test read. But the layout a
weight sits in decides how fast a CPU matmul can read it, and reading the weights is most of a step:
at decode time every token of the batch multiplies by every matrix of the model (chapter 02).

No single layout wins at every row count M (the tokens of a step), so a `PackedLinear` keeps W twice
and picks by M (the measurements behind this, with their machines, are in
benchmarks/results/packed_linear_layouts.md):

- small M (a decode step of a few sequences: a matrix-VECTOR product, bound by memory): our C kernel
  (kernels/gemv) reads W where nn.Linear keeps it, [N, K], in fp32 arithmetic (a bf16 weight widened
  in registers: half the bytes). Where it cannot be built, fp32 weights use W^T cut into P column
  blocks, one per thread, all multiplied by ONE batched matmul, so each core streams its own block
  start to finish:

      W^T [K, N]  ──cut the N output columns into P blocks──►  blocks [P, K, N/P]
      x [M, K] broadcast to every block (a view) ─► bmm ─► [P, M, N/P] ─► block p = columns p*N/P ..

- larger M (batched decode, prefill: matrix-MATRIX products, bound by arithmetic): oneDNN's blocked
  layout, made once by `torch.ops.mkldnn._reorder_linear_weight` (what torch's compiler uses when it
  freezes a CPU model), so its GEMM kernel reads the weight in the order its registers want. In bf16
  it computes in bf16 where the CPU has bf16 instructions (avx512_bf16, AMX), and otherwise in fp32
  from an fp32 copy (an emulated bf16 GEMM is several times slower than an fp32 one).

Where each row count goes is measured once per machine and shape class (engine/fast/tuning.py),
with engine/fast/probes.py's constants (`gemv_max_rows`, `COLUMN_BLOCK_MAX_ROWS`) as the
unmeasured default. The numbers are the model's: `PackedLinear(x)` equals `nn.Linear(x)` up to
float rounding (the sums happen in a different order), and the engine's greedy tokens equal the
naive loop's (the tests check both). fp16 and GPUs are left as nn.Linear ("auto"): cuBLAS reads
either layout at full speed.

The cost is memory: one oneDNN copy of every linear weight (in fp32 where a bf16 model runs on a CPU
without bf16 instructions: twice the bf16 bytes), and the column blocks where the C kernel cannot be
built. The fast wing packs a COPY of the model, so the model you passed in is untouched (it is still
`engine.model`), and while you hold it, it lives too: fine for the models this project runs on a
laptop; a bigger model would keep one layout only.
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
from engine.fast.tuning import LinearPlan, Tuning
from engine.surgery import replaced
from kernels.gemv import gemv_native, why_gemv_cannot_run


class PackedLinear(nn.Module):
    """y = x W^T + b with W held twice, in the layouts of the module docstring, picked by the
    number of rows M:

        M <= gemv_rows  where our C kernel builds (kernels/gemv), fp32 and bf16 weights: W itself,
                        [N, K], shared with the original, streamed by the C matrix-vector kernel
                        in fp32 arithmetic (bf16 widened in registers: half the bytes of fp32, the
                        whole point at batch 1);
                        else fp32: `packed` [P, K, N/P], P column blocks of W^T (P = `blocks` if
                        it divides N, else 1: then packed[0] is simply W^T [K, N]);
        M > gemv_rows   the GEMM `plan` picks for M's row bucket: `onednn`, oneDNN's blocked
                        copy, in bf16 where the CPU has bf16 instructions, else in fp32 (the rows
                        are cast up and the result back: the GEMM then runs at fp32 speed instead
                        of an emulated bf16 one; None where oneDNN is missing), or F.linear on W
                        (MKL)

    `plan` (gemv_rows and the GEMM per bucket) is measured on this machine for the layer's shape
    class when a `tuning` is given (engine/fast/tuning.py), else probes.py's constants.
    """

    def __init__(self, linear: nn.Linear, blocks: int, tuning: Tuning | None = None):
        super().__init__()
        if blocks < 1:
            raise ValueError(f"blocks must be >= 1 (one per thread), got {blocks}")
        weight = linear.weight.detach()
        N, K = weight.shape  # nn.Linear: [out, in]
        P = blocks if N % blocks == 0 else 1
        self.in_features, self.out_features, self.blocks = K, N, P
        self.bias = None if linear.bias is None else linear.bias.detach()  # [N]
        self.weight = weight  # [N, K], no copy: F.linear's
        # (the C kernel even where the column blocks stream as fast: the C layers need W as [N, K])
        self.gemv_weight = (weight if why_gemv_cannot_run(weight) is None
                            else None)  # [N, K], no copy
        self.gemv_bias = None if self.bias is None else self.bias.float()
        # where the C kernel cannot run, fp32 decode rows use the column blocks [P, K, N/P]
        self.packed = (weight.t().reshape(K, P, N // P).permute(1, 0, 2).contiguous()
                       if self.gemv_weight is None and weight.dtype == torch.float32 else None)
        keep_bf16 = weight.dtype == torch.bfloat16 and bf16_instructions()
        self.gemm_dtype = torch.bfloat16 if keep_bf16 else torch.float32
        use_onednn = (onednn_available() and weight.device.type == "cpu"
                      and weight.dtype in (torch.float32, torch.bfloat16))
        self.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight.to(self.gemm_dtype),
                                                               ONEDNN_ROWS_HINT)
                       if use_onednn else None)
        self.gemm_bias = None if self.bias is None else self.bias.to(self.gemm_dtype)
        self.plan = self._default_plan()
        if tuning is not None and weight.device.type == "cpu":
            self.plan = tuning.linear(weight.dtype, N, K, self._paths(), self.plan)
        # decode steps of up to this many rows: the C kernel (or, where it cannot run, the blocks)
        self.gemv_rows = (self.plan.gemv_rows if self.gemv_weight is not None
                          else COLUMN_BLOCK_MAX_ROWS if self.packed is not None else 0)

    def _default_plan(self) -> LinearPlan:
        """engine/fast/probes.py's constants: what runs unmeasured (SERVELAB_TUNING=defaults)."""
        rows = gemv_max_rows(self.weight.dtype) if self.gemv_weight is not None else 0
        gemm = "onednn" if self.onednn is not None else "linear"
        return LinearPlan(rows, ((None, gemm),), "engine/fast/probes.py's constants", "defaults")

    def _paths(self) -> dict:
        """The products a measurement races (engine/fast/tuning.py): x [M, K] -> [M, N] each."""
        paths = {"linear": lambda x: F.linear(x, self.weight, self.bias)}
        if self.gemv_weight is not None:
            paths["gemv"] = self._gemv
        if self.onednn is not None:
            paths["onednn"] = self._onednn
        return paths

    def _gemv(self, rows: Tensor) -> Tensor:
        return gemv_native(rows.float().contiguous(), self.gemv_weight, self.gemv_bias)

    def _onednn(self, rows: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows.to(self.gemm_dtype), self.onednn,
                                                  self.gemm_bias, "none", [], "")

    def forward(self, x: Tensor) -> Tensor:  # x [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features)  # [M, K]
        M = rows.shape[0]
        if 0 < M <= self.gemv_rows and self.gemv_weight is not None:
            y = self._gemv(rows).to(x.dtype)  # [M, N]
        elif 0 < M <= self.gemv_rows:
            y = self._blocks_matmul(rows)  # fp32 without the C kernel
        elif M > 0 and self.onednn is not None and self.plan.gemm_path(M) == "onednn":
            y = self._onednn(rows).to(x.dtype)  # [M, N]
        else:
            y = F.linear(rows, self.weight, self.bias)  # MKL (or bf16's own GEMM)
        return y.view(*x.shape[:-1], self.out_features)

    def _blocks_matmul(self, rows: Tensor) -> Tensor:
        """[M, K] @ the column blocks -> [M, N], one bmm over the P blocks (one per thread)."""
        (M, K), P, N = rows.shape, self.blocks, self.out_features
        if P == 1:
            w = self.packed[0]  # [K, N]
            return rows @ w if self.bias is None else torch.addmm(self.bias, rows, w)
        # [P, M, N/P]: every block reads the same rows
        out = torch.bmm(rows.expand(P, M, K), self.packed)
        # [P, M, N/P] -> [M, P, N/P] -> [M, N]: block p holds output columns p*N/P .. (p+1)*N/P - 1
        y = out.view(M, N) if M == 1 else out.transpose(0, 1).reshape(M, N)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"blocks={self.blocks}, onednn={self.onednn is not None}, "
                f"gemm_dtype={self.gemm_dtype}")


def pack_linears(model: nn.Module, blocks: int, tuning: Tuning | None = None) -> nn.Module:
    """A copy of `model` whose plain nn.Linear layers are PackedLinear; the original is left as it
    was.

    Only exact `nn.Linear` modules are packed: quantized layers (chapter 07) have their own kernels
    and stay as they are. Everything else is shared, not copied (engine/surgery.py). `tuning`:
    each shape's paths measured on this machine (engine/fast/tuning.py); None: probes.py's
    constants.
    """
    return replaced(model, lambda name, m: (PackedLinear(m, blocks, tuning)
                                            if type(m) is nn.Linear else None))

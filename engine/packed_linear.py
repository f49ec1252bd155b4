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

- M <= GEMV_MAX_ROWS (a decode step of one or two sequences: a matrix-VECTOR product, bound by memory):
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
- bf16/fp16 on a CPU: not measured here with packing (this CPU has no bf16 instructions); "auto"
  leaves those as nn.Linear;
- a GPU: cuBLAS reads either layout at full speed; "auto" leaves it alone.

The cost is memory: two packed copies of every linear weight. The engine packs a shallow copy of the
model, so the model you passed in is untouched (it is still `engine.model`, the one the oracle tests
and notebooks read), and while you hold it, it lives too: three copies of the linear weights in all
(SmolLM2-135M in fp32: 0.54 GB each). Fine for the models this project runs on a laptop; a bigger
model would keep one layout only.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from engine.config import WEIGHT_LAYOUTS

# Dtypes whose CPU matmuls are faster from the packed layout (the table in the module docstring).
PACKED_IS_FASTER = {torch.float32: True, torch.bfloat16: False, torch.float16: False}


# Up to this many rows a matmul is a GEMV (memory-bound) and the column blocks win; above it oneDNN (table above).
GEMV_MAX_ROWS = 2
# oneDNN picks its blocked layout for a typical row count; 16 served 2..1024 rows well here (a hint of 1 did
# not, 128 lost at 256 rows). It is a hint only: any M runs.
ONEDNN_ROWS_HINT = 16


def onednn_available() -> bool:
    """Whether this torch build can pack a weight for oneDNN's CPU matmul."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """y = x W^T + b with W held twice, in the layouts of the module docstring:

        blocks  [P, K, N/P]   P column blocks of W^T, for M <= GEMV_MAX_ROWS rows (P = `blocks` if it divides
                              N, else 1: then blocks[0] is simply W^T [K, N])
        onednn  opaque        oneDNN's blocked copy of W [N, K], for more rows (None where oneDNN is missing
                              or W is not fp32 on a CPU: then the blocks serve every M)
    """

    def __init__(self, linear: nn.Linear, blocks: int):
        super().__init__()
        if blocks < 1:
            raise ValueError(f"blocks must be >= 1 (one per thread), got {blocks}")
        weight = linear.weight.detach()
        N, K = weight.shape  # nn.Linear: [out, in]
        P = blocks if N % blocks == 0 else 1
        self.in_features, self.out_features, self.blocks = K, N, P
        self.register_buffer("packed", weight.t().reshape(K, P, N // P).permute(1, 0, 2).contiguous())  # [P,K,N/P]
        self.bias = None if linear.bias is None else linear.bias.detach()  # [N]
        use_onednn = onednn_available() and weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT) if use_onednn else None

    def forward(self, x: Tensor) -> Tensor:  # x [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if rows.shape[0] > GEMV_MAX_ROWS and self.onednn is not None:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.onednn, self.bias, "none", [], "")  # [M, N]
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
                f"onednn={self.onednn is not None}")


def use_packed(layout: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `weight_layout` = `layout` packs a model of this dtype on this device."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    if layout == "auto":
        return device.type == "cpu" and PACKED_IS_FASTER.get(dtype, False)
    return layout == "packed"


def pack_linears(model: nn.Module, blocks: int) -> nn.Module:
    """A copy of `model` whose plain nn.Linear layers are PackedLinear; the original is left as it was.

    Only exact `nn.Linear` modules are packed: quantized layers (chapter 07) have their own kernels and
    stay as they are. Modules with no nn.Linear inside (norms, embeddings) are shared, not copied, and so
    is every other tensor (the RoPE tables).
    """
    if type(model) is nn.Linear:
        return PackedLinear(model, blocks)
    if not any(type(m) is nn.Linear for m in model.modules()):
        return model  # nothing to pack below: share it as it is
    twin = copy.copy(model)
    twin._modules = {name: None if child is None else pack_linears(child, blocks)
                     for name, child in model._modules.items()}
    return twin

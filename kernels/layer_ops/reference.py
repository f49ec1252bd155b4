"""The small ops of a decoder layer in plain PyTorch: the oracles of the fused C ops (cpu_native.c).

Four functions, each the same arithmetic as the PyTorch the engine's model runs (engine/model.py's
RMSNorm, MLP, apply_rope; the sampler's greedy torch.argmax), written again here because the
kernels sit below the engine and never import it:

    rms_norm_ref(x, w, eps)         x [..., E]  -> w * (x / rms(x))                     [..., E]
    silu_mul_ref(gu)                gu [..., 2F] = [gate | up] -> silu(gate) * up        [..., F]
    rope_ref(x, cos, sin)           x [T, h, D] -> each head's pairs (i, i + D/2) rotated [T, h, D]
    rope_ref_(x, cos, sin, heads)   the C op's form: the first ``heads`` heads of x [T, W], in place
    argmax_rows_ref(logits)         logits [R, V] -> [R] int64: the first of equal maxima

Rounding. x is fp32 or bf16. In a bf16 model torch computes every op in fp32 and rounds its
result to bf16 (round to nearest, ties to even) before the next op reads it; the C ops round at
the same points, and so do these functions: each ``.to(dtype)`` below is one of torch's roundings.
So the C ops equal these bit for bit (RoPE, argmax), or up to the order of the additions in
RMSNorm's sum of squares, or up to the last bits of SiLU's e^-g (the C file's vectorized exp is a
polynomial, not libm's). In fp32 nothing is rounded but by fp32 arithmetic itself.

The one place the C contract differs from the model's: cos and sin are fp32 [T, D] (the model
keeps them in its own dtype; the engine widens them, exactly, before the C call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)  # the dtypes the C ops compute


def _fail(field: str, message: str):
    raise ValueError(f"{field}: {message}")


def _check_float(x: torch.Tensor, name: str) -> None:
    if x.dtype not in DTYPES:
        _fail(name, f"expected an fp32 or bf16 tensor, got {x.dtype}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim: x [..., E], weight [E] in x's dtype.

    As engine/model.py's RMSNorm: the mean of squares and the scaling in fp32, the normalized x
    rounded to x's dtype, then the product with the weight (rounded again in bf16)."""
    _check_float(x, "x")
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],):
        _fail("weight", f"expected {x.dtype} [{x.shape[-1]}], got {weight.dtype} "
                        f"{tuple(weight.shape)}")
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)  # [..., 1] fp32
    return weight * (x32 * inv_rms).to(x.dtype)  # [..., E]


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with gu [..., 2F] = [gate (F) | up (F)]: the stacked gate/up projection's
    output, as engine/model.py's MLP splits it. SiLU rounded, then the product rounded."""
    _check_float(gu, "gu")
    if gu.shape[-1] % 2:
        _fail("gu", f"the last dim holds [gate | up], so it must be even, got {gu.shape[-1]}")
    gate, up = gu.chunk(2, dim=-1)  # [..., F] each
    return F.silu(gate) * up  # silu(g) = g / (1 + e^-g); two ops, each rounded to gu's dtype


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (x1, x2: its two halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for every head: x [T, h, D] fp32 or bf16, cos and sin fp32
    [T, D] (one row of angles per token, shared by its heads) -> a new [T, h, D] in x's dtype.

    Three ops, each rounded to x's dtype as torch rounds them in engine/model.py's apply_rope (the
    two products, then their sum)."""
    _check_float(x, "x")
    if x.dim() != 3 or x.shape[-1] % 2:
        _fail("x", f"expected [T, h, D] with D even, got {tuple(x.shape)}")
    T, _, D = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.shape != (T, D):
            _fail(name, f"expected fp32 [T = {T}, D = {D}], got {t.dtype} {tuple(t.shape)}")

    def rounded(t):  # an fp32 result, rounded to x's dtype (kept in fp32 for the next op)
        return t.to(x.dtype).float()

    x32, c, s = x.float(), cos[:, None], sin[:, None]  # c, s [T, 1, D]: broadcast over the heads
    return rounded(rounded(x32 * c) + rounded(_rotate_half(x32) * s)).to(x.dtype)  # [T, h, D]


def rope_ref_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """What ``rope_native_`` does: rotate the first ``heads`` heads (D = cos.shape[1] values each,
    side by side) of every row of x [T, W], in place, and return x. The columns past
    ``heads * D`` are not touched; the engine calls it on the fused QKV rows, once for the q heads
    and once for the k heads (starting at column H * D), leaving v alone."""
    if cos.dim() != 2:
        _fail("cos", f"expected fp32 [T, D], got {tuple(cos.shape)}")
    T, D = cos.shape
    if x.dim() != 2 or x.shape[0] != T or x.shape[1] < heads * D:
        _fail("x", f"expected [T = {T}, >= {heads} * {D}], got {tuple(x.shape)}")
    head_cols = x[:, : heads * D]  # [T, heads * D], a view
    head_cols.copy_(rope_ref(head_cols.reshape(T, heads, D), cos, sin).reshape(T, heads * D))
    return x


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value: logits [R, V] fp32 or bf16 -> [R] int64, by
    torch.argmax's rules: the first of equal maxima (bf16 logits tie often), and a NaN counts as
    larger than anything. Written as the C op works, in two passes: the row's maximum, then the
    first position that holds it."""
    _check_float(logits, "logits")
    if logits.dim() != 2 or logits.shape[1] == 0:
        _fail("logits", f"expected [R, V] with V >= 1, got {tuple(logits.shape)}")
    R, V = logits.shape
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]; NaN where the row holds one (amax keeps it)
    holds_top = (logits == top) | (logits.isnan() & top.isnan())  # [R, V]
    positions = torch.arange(V, device=logits.device).expand(R, V)  # [R, V]
    return torch.where(holds_top, positions, V).amin(dim=-1)  # [R]: the first position holding it

"""Every decoder layer of a decode step in plain PyTorch: the oracle of the one-call C layers.

The C file (cpu_native.c) runs all L layers of a small decode step in one call, reading its
weights and pools through raw addresses (``ModelDims``, ``Layer``: cpu_native.py). Here the same
step is written over plain tensors, one ``LayerTensors`` per layer, and built from the other
folders' references, so that each piece is an oracle already tested on its own:

    for each layer:   h   = rms_norm_ref(x, input_norm)              kernels/layer_ops
                      qkv = gemv_ref(h, W_qkv) (+ b)                 kernels/gemv
                      q, k = rope_ref(q), rope_ref(k)                kernels/layer_ops
                      write_kv_ref(k, v, pools, slots)               kernels/paged_attention
                      a   = paged_decode_attention_ref(q, pools)     kernels/paged_attention
                      x   = x + gemv_ref(a, W_o) (+ b)               (the first residual)
                      h   = rms_norm_ref(x, post_norm)
                      x   = x + gemv_ref(silu_mul_ref(gemv_ref(h, W_gate_up)), W_down)

M rows, one new token per sequence, each row its own sequence (a decode step). Shapes:

    x            [M, E]           fp32 or bf16: the model's dtype, which every layer tensor shares
    cos, sin     [M, D]  fp32     each row's RoPE angles (its position: seq_lens - 1)
    slots        [M]     int64    where each new token's K/V go (write_kv_ref's slot_mapping)
    block_tables [M, W]  int32    seq_lens [M] int32, the new token included (the attention's)

Rounding: in a bf16 model torch rounds every op's result to bf16; the C layers do (their `act`),
and so does this function: each piece rounds where torch would, and each matmul is computed in
fp32 (a bf16 weight widened) and rounded once, as the C gemv kernel is. The two agree up to the
order of the float additions inside a sum (tests/test_decoder_layers_reference.py).

Float weights only: a quantized linear's oracle is kernels/quant_matmul's ``quant_matmul_ref``
(the C layers call the native quantized kernel for it; tests/test_native_layers.py covers those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gemv.reference import gemv_ref
from kernels.layer_ops.reference import rms_norm_ref, rope_ref, silu_mul_ref
from kernels.paged_attention.reference import paged_decode_attention_ref, write_kv_ref

DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes the C layers compute


@dataclass
class LayerTensors:
    """One decoder layer, as the tensors a C ``Layer`` descriptor points at (same order).

    Every tensor is in the model's dtype (fp32 or bf16) but the biases, which may be any float
    dtype (they are added in fp32). The pools are this layer's KV cache; the step writes into them.
    """

    input_norm: torch.Tensor  # [E]
    post_norm: torch.Tensor  # [E]
    qkv: torch.Tensor  # [(H + 2 Hkv) D, E]: the q, k and v projections stacked, in that order
    o: torch.Tensor  # [E, H D]
    gate_up: torch.Tensor  # [2F, E]: gate and up stacked
    down: torch.Tensor  # [E, F]
    k_pool: torch.Tensor  # [NB, BS, Hkv, D]
    v_pool: torch.Tensor  # [NB, BS, Hkv, D]
    qkv_bias: torch.Tensor | None = None  # [(H + 2 Hkv) D] (Qwen2 has one)
    o_bias: torch.Tensor | None = None  # [E]
    gate_up_bias: torch.Tensor | None = None  # [2F]
    down_bias: torch.Tensor | None = None  # [E]


def _fail(field: str, message: str):
    raise ValueError(f"{field}: {message}")


def check_layer(layer: LayerTensors, index: int, E: int, dtype: torch.dtype) -> tuple[int, ...]:
    """Shapes and dtypes of one layer against x's E and dtype; returns its (H, Hkv, D)."""
    name = f"layers[{index}]"
    if layer.k_pool.dim() != 4:
        _fail(f"{name}.k_pool", f"expected [NB, BS, Hkv, D], got {tuple(layer.k_pool.shape)}")
    Hkv, D = layer.k_pool.shape[2:]
    rows = layer.qkv.shape[0]
    if rows % D or rows // D <= 2 * Hkv or (rows // D - 2 * Hkv) % Hkv:
        _fail(f"{name}.qkv", f"expected [(H + 2 Hkv) D, E] with H a multiple of Hkv = {Hkv} and "
                             f"D = {D} (the pools'), got {tuple(layer.qkv.shape)}")
    H = rows // D - 2 * Hkv
    F = layer.gate_up.shape[0] // 2
    shapes = {"input_norm": (E,), "post_norm": (E,), "qkv": ((H + 2 * Hkv) * D, E),
              "o": (E, H * D), "gate_up": (2 * F, E), "down": (E, F)}
    for field, shape in shapes.items():
        t = getattr(layer, field)
        if tuple(t.shape) != shape or t.dtype != dtype:
            _fail(f"{name}.{field}", f"expected {dtype} {list(shape)}, got {t.dtype} "
                                     f"{list(t.shape)}")
    return H, Hkv, D


def _linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """h [M, K] @ weight^T (+ bias) in fp32 (kernels/gemv's promise), rounded once to h's dtype."""
    b = None if bias is None else bias.float()
    return gemv_ref(h.float(), weight, b).to(h.dtype)  # [M, N]


def decoder_layer_ref(layer: LayerTensors, x, cos, sin, slots, block_tables, seq_lens, *,
                      eps: float, scale: float, window: int | None = None) -> torch.Tensor:
    """One layer of a decode step: x [M, E] -> x [M, E] (a new tensor); writes the step's K/V
    into the layer's pools. The caller has checked the layer (``check_layer``)."""
    M, _ = x.shape
    Hkv, D = layer.k_pool.shape[2:]
    H = layer.qkv.shape[0] // D - 2 * Hkv  # qkv rows: q [H D] | k [Hkv D] | v [Hkv D]
    h = rms_norm_ref(x, layer.input_norm, eps)  # [M, E]
    qkv = _linear(h, layer.qkv, layer.qkv_bias)  # [M, (H + 2 Hkv) D]
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = rope_ref(q.reshape(M, H, D), cos, sin)  # [M, H, D]
    k = rope_ref(k.reshape(M, Hkv, D), cos, sin)  # [M, Hkv, D]
    write_kv_ref(k, v.reshape(M, Hkv, D), layer.k_pool, layer.v_pool, slots)
    a = paged_decode_attention_ref(q, layer.k_pool, layer.v_pool, block_tables, seq_lens, scale,
                                   window)  # [M, H, D]: fp32 inside, rounded to x's dtype
    x = x + _linear(a.reshape(M, H * D), layer.o, layer.o_bias)  # the attention's residual
    h = rms_norm_ref(x, layer.post_norm, eps)  # [M, E]
    gu = _linear(h, layer.gate_up, layer.gate_up_bias)  # [M, 2F]
    return x + _linear(silu_mul_ref(gu), layer.down, layer.down_bias)  # the MLP's residual


def decoder_layers_ref(layers: list[LayerTensors], x, cos, sin, slots, block_tables, seq_lens, *,
                       eps: float, scale: float, window: int | None = None) -> torch.Tensor:
    """Every layer in turn over x [M, E] fp32 or bf16 -> x after the last layer [M, E] (x itself is
    not changed; the pools are written). ``eps``: RMSNorm's epsilon; ``scale``: the attention's
    (usually 1 / sqrt(D)); ``window``: the sliding window, or None (the C layers' 0)."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        _fail("x", f"expected fp32 or bf16 [M, E], got {x.dtype} {tuple(x.shape)}")
    M, E = x.shape
    if slots.shape != (M,):  # the tables and lengths are checked by the attention's contract
        _fail("slots", f"expected one slot per row, [{M}], got {tuple(slots.shape)}")
    for i, layer in enumerate(layers):
        check_layer(layer, i, E, x.dtype)
    for layer in layers:
        x = decoder_layer_ref(layer, x, cos, sin, slots, block_tables, seq_lens, eps=eps,
                              scale=scale, window=window)
    return x

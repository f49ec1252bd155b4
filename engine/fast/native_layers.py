"""The decoder layers of a small decode step in ONE C call (kernels/decoder_layers), instead of ~540
torch ops.

At batch 1 a decode step is 30 layers of tiny work: a matrix-vector product per projection (the real
cost: reading the weights) and, around each, a dozen small ops on one row of 576 floats: RMSNorm,
RoPE, casts to and from bf16, residual adds, views and splits, the KV write. Each torch op costs a
few microseconds of dispatch whatever its size, and on a 2-core CPU they added up to about half of
SmolLM2-135M's decode step (benchmarks/vs_vllm.py has the before and after). vLLM answers this on a
GPU with CUDA graphs; llama.cpp never has the problem, since its graph runs in C. Here the loop over
layers moves into C, and the matmuls and the attention are the very C kernels the Python path calls,
so the two paths compute the same numbers:

    decodes only, rows <= max_rows   everything else (prefill, bigger batches)
    embed, RoPE tables (torch)       embed, RoPE tables (torch)
    all L layers: ONE C call         for layer in model.layers: layer(x, ...)   (engine/model.py)
    final norm, lm_head (torch)      final norm, lm_head (torch)

It runs on the engine's packed copy of the model (engine/fast/packed_linear.py,
engine/fast/fused_projections.py), where q/k/v and gate/up are already stacked, and only when every
piece has a C twin: fp32 or bf16 weights read by the gemv kernel, or int4/int8 weights on the native
quantized kernel; fp32 or bf16 KV pools read by the native attention kernel. Anything else (int8 KV,
fp16, SmoothQuant or W8A8 layers, a GPU) keeps the Python layers, and `why_native_layers_cannot_run`
says why. `layer_backend="python"` (a fast-wing override) turns it off.

The C file rounds to bf16 after every op where torch does, so greedy outputs equal the Python
layers' (and the naive loop's) in fp32, and agree up to float summation order in bf16
(tests/test_native_layers.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.fast.packed_linear import PackedLinear
from engine.fast.probes import gemv_max_rows
from engine.loading.quantization import QuantLinear
from kernels.decoder_layers import (
    LINEAR_KINDS,
    Layer,
    Linear,
    ModelDims,
    decoder_layers_native,
    kernel_pointers,
)
from kernels.decoder_layers import why_library_cannot_load as why_c_cannot_load
from kernels.quant_matmul.cpu_native import FUSED_MAX_ROWS

ACTIVATION_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # -> ModelDims.bf16
LINEAR_NAMES = ("qkv", "o", "gate_up", "down")


def _linears(layer) -> dict:
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": getattr(attn, "qkv_proj", None), "o": attn.o_proj,
            "gate_up": getattr(mlp, "gate_up_proj", None), "down": mlp.down_proj}


def why_linear_cannot_run(module) -> str | None:
    """None if the C layers can run this linear layer, else why not."""
    if module is None:
        return "q/k/v or gate/up are not fused into one matrix (engine/fast/fused_projections.py)"
    if isinstance(module, PackedLinear):
        return (None if module.gemv_weight is not None
                else "its weight is not one the C gemv kernel reads")
    if isinstance(module, QuantLinear):
        if module.backend != "native" or module._prepared is None:
            return (f"a quantized layer on the {module.backend!r} backend "
                    "(the C layers call the native kernel)")
        if module.smooth is not None or module.act_quant:
            return "a SmoothQuant or W8A8 layer"
        return None
    return f"a {type(module).__name__} (not packed: weight_layout='packed' packs linears)"


def why_native_layers_cannot_run(model, attention) -> str | None:
    """None if `NativeLayers(model, attention)` can run this model's decode steps, else the reason
    in words."""
    dtype, pool = model.embed_tokens.weight.dtype, attention.kv_pool
    if dtype not in ACTIVATION_DTYPES:
        return f"the model is {dtype}; the C layers compute fp32 and bf16 models"
    if pool.device.type != "cpu":
        return f"the KV pools are on {pool.device}"
    if attention.backend != "native":
        return (f"attention runs on {attention.backend!r}; "
                "the C layers call the native attention kernel")
    if pool.dtype != dtype:
        return (f"the KV pools are {pool.dtype} and the model {dtype} "
                "(int8 KV keeps the Python layers)")
    for i, layer in enumerate(model.layers):
        for name, module in _linears(layer).items():
            if (why := why_linear_cannot_run(module)) is not None:
                return f"layer {i} {name}: {why}"
    return why_c_cannot_load()


class NativeLayers:
    """The C descriptors of a model's layers (built once: addresses of weights and pools), and the
    per-step call.

    It keeps a reference to every tensor whose address it hands to C (`self._keep`), so that none is
    freed while the descriptors point at it. Build a new one when the model changes (ModelRunner
    does)."""

    def __init__(self, model, attention):
        if (why := why_native_layers_cannot_run(model, attention)) is not None:
            raise ValueError(f"the native decoder layers cannot run this model: {why}")
        cfg, pool = model.config, attention.kv_pool
        self.attention, self.dtype, self._keep = attention, model.embed_tokens.weight.dtype, []
        # decode steps of up to this many sequences: the matrix-vector products' regime
        # (engine/fast/packed_linear.py); with quantized layers, no more rows than the fused
        # quantized kernel takes in Python (FUSED_MAX_ROWS). probes.py's limit, not the packed
        # layers' measured gemv_rows (engine/fast/tuning.py): a matmul race misses what the C
        # layers save, the step's ~500 torch ops
        quantized = any(isinstance(m, QuantLinear)
                        for layer in model.layers for m in _linears(layer).values())
        self.max_rows = (min(gemv_max_rows(self.dtype), FUSED_MAX_ROWS) if quantized
                         else gemv_max_rows(self.dtype))
        gemv, quant, attend = kernel_pointers()
        self.dims = ModelDims(E=cfg.hidden_size, H=cfg.num_attention_heads,
                              Hkv=cfg.num_key_value_heads, D=cfg.head_dim,
                              F=cfg.intermediate_size, BS=pool.block_size,
                              window=attention.sliding_window or 0, eps=cfg.rms_norm_eps,
                              scale=attention.scale, bf16=ACTIVATION_DTYPES[self.dtype],
                              gemv=gemv, quant=quant, attend=attend)
        self.layers = (Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            mods = _linears(layer)
            norms = (self._ptr(layer.input_layernorm.weight),
                     self._ptr(layer.post_attention_layernorm.weight))
            self.layers[i] = Layer(*norms, *(self._linear(mods[name]) for name in LINEAR_NAMES),
                                   self._ptr(pool.k[i]), self._ptr(pool.v[i]))

    def _ptr(self, t: Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, module) -> Linear:
        if isinstance(module, PackedLinear):
            w = module.gemv_weight  # [N, K] fp32 or bf16
            return Linear(LINEAR_KINDS[w.dtype], module.out_features, module.in_features,
                          self._ptr(w), self._ptr(module.gemv_bias))
        nw = module._prepared  # QuantLinear, native backend: the arguments its kernel takes
        qweight, scales, zeros, stride, group, n = nw.weight_args
        self._keep.append(nw)
        bias = None if module.bias is None else module.bias.float()
        return Linear(LINEAR_KINDS[nw.qw.bits], n, nw.k, qweight, self._ptr(bias), scales, zeros,
                      stride, group)

    def covers(self, meta) -> bool:
        """Whether this step is the C layers' work: decodes only, at most `max_rows` of them."""
        rows = meta.slot_mapping.shape[0]
        return not meta.prefills and 0 < rows <= self.max_rows and meta.decode_rows.shape[0] == rows

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta) -> Tensor:
        """x [1, M, E] (the embedded decode tokens), cos/sin [1, M, 1, D] -> x after every layer,
        [1, M, E]."""
        if meta.plans is None:
            # checks every slot and table against the pools
            meta.plans = self.attention.plan(meta, None)
        plan = meta.plans.decode
        x32 = x[0].to(torch.float32, copy=True)  # [M, E]: the C call updates it in place
        cos32 = cos[0, :, 0].float().contiguous()  # [M, D]
        sin32 = sin[0, :, 0].float().contiguous()
        decoder_layers_native(self.dims, self.layers, x32, cos32, sin32,
                              meta.slot_mapping.contiguous(), plan.block_tables, plan.seq_lens)
        return x32.to(self.dtype)[None]  # [1, M, E]


def native_layers_or_none(model, attention, layer_backend: str) -> NativeLayers | None:
    """The engine's choice: C layers where `layer_backend` is "auto" and they can run, else None
    (Python)."""
    if layer_backend != "auto" or why_native_layers_cannot_run(model, attention) is not None:
        return None
    return NativeLayers(model, attention)


__all__ = ["NativeLayers", "native_layers_or_none", "why_native_layers_cannot_run"]

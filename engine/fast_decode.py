"""A fast batch-1 decode path: the same model, re-laid out for speed, as a separate backend.

`engine/model.py` is written to be read: one `nn.Module` per idea, RoPE as the paper writes it,
attention through a pluggable backend, `nn.Linear` everywhere. At batch 1, decode speed is about
one thing: streaming every weight from memory once per token (chapter 02's roofline;
`engine.roofline.decode_roofline_tokens_per_s` is the ceiling), and everything else (small ops,
Python, a slow matmul kernel) is time the memory bus sits idle. So we keep that file readable and
put the speed here, in a second implementation of the *same function*: tests/test_fast_decode.py
checks its greedy tokens against `generate_naive` and its logits against the reference model at
every step, in fp32, bf16 and fp16.

What each trick buys. One decode step of a SmolLM2-135M-shaped model (30 layers, 540 MB of fp32
weights), context ~100, on a 2-core AMD EPYC (Zen 5) with torch 2.13; median of 35 steps (runs on
a quiet machine vary by ~10%):

                                            fp32 ms   bf16 ms
    readable model + KVCache backend          41.6      21.4
    FastDecoder, all tricks                   17.0      10.8
      ... with weights as (N, K) views        37.5        -     (trick 1; bf16's default)
      ... (K, N) but in 1 column block        30.5     178.6    (trick 1)
      ... with oneDNN on while decoding       20.2      16.1    (trick 2)

1. The weight layout that streams fastest, per dtype (table at KN_LAYOUT_IS_FASTER). In fp32,
   MKL's one-row GEMV over nn.Linear's (N, K) weight read only ~16 GB/s; a (K, N) copy read ~25;
   and since that GEMV runs on one core, which cannot pull the whole memory bandwidth, we cut the
   (K, N) copy into one column block per core and multiply all blocks with one `torch.bmm`, each
   core streaming its own block: ~34-39 GB/s. In bf16/fp16 the opposite holds: torch's own GEMV
   wants the (N, K) layout (36-43 GB/s) and already uses both cores; a (K, N) bf16 copy falls to
   1-3 GB/s. (A (K, N) copy of a tied LM head costs V x E more weight memory.)
2. oneDNN off while decoding (`onednn`): its one-row bf16 matmuls streamed 12-23 GB/s against
   28-43 for torch's own GEMV; it is switched back on for prefill, where its GEMM is 6x faster.
3. Fused projections: one [E, (H + 2 Hkv) D] matrix for q, k, v and one [E, 2F] for gate|up.
   Over 30 layers these five matmuls took 4.4 -> 3.7 ms in bf16, 9.6 -> 9.3 ms in fp32.
4. Residual adds and biases fused into the matmul (`addmm`/`baddbmm`: x + a @ W in one call).
5. RoPE as one matrix: rotating pairs (i, i + D/2) by angle θ_i is a linear map, so once per
   step we build R [D, D] = diag(cos) + S diag(sin) from cos/sin tables precomputed for every
   position, and rotate q and k of all heads with one matmul per layer (6 µs, against 9 µs for
   the element-wise `apply_rope`).
6. Attention for one query as matmul -> softmax -> matmul in fp32, GQA by viewing the H query
   heads as [Hkv, group] (no `repeat_interleave` copy of K and V): ~20 µs per layer, where bf16
   `scaled_dot_product_attention` with one query took 50-65 µs. fp32 attention (and RoPE) is
   also more accurate: on tinylab in bf16, against the fp32 model, the logit error is mean 0.014,
   worst 0.21 on this path and 0.020 / 0.28 on the readable one (see ATTENTION_DTYPE for the cost).
7. A preallocated KV cache [L, 2, Hkv, capacity, D] written in place, so each KV head's keys are
   contiguous rows; `F.rms_norm` (8 µs, against 11 µs for RMSNorm's ops written out); about 20
   torch calls per layer, no modules, hooks or backend objects; `torch.inference_mode`.

Why a separate backend and not an edit of model.py: every trick above makes a model harder to
read (fused matrices hide which weight is which, column blocks hide the matrix, a rotation matrix
hides what RoPE does), and the reference is what the chapters teach and what the oracle tests
compare with `transformers`. A fast path earns its place only by being *checked against* the
readable one. The tricks that win depend on the machine and the torch build (the tables here are
from one CPU); on a GPU the weights stay as (N, K) views.

Layout of the fast cache (one tensor for all layers; slot t holds position t):

    kv[l, 0] : keys   [Hkv, capacity, D]     head h: rows 0 .. length-1 filled | free ...
    kv[l, 1] : values [Hkv, capacity, D]

Works in fp32, bf16 and fp16 (whatever dtype the model was loaded in), on CPU or a GPU.
benchmarks/decode_vs_hf.py compares it with the readable path and `transformers.generate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model import LlamaModel, causal_mask
from engine.naive import GenerationResult, run_loop
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer, encode_prompt, eos_ids

# Attention (scores, softmax, weighted sum) runs in fp32 whatever the model dtype, as the reference's
# SDPA kernel does inside. Rounding the scores to bf16 (8 bits of mantissa) moved a score of ~50 by
# 0.25, e^0.25 = 1.28x on its probability: on tinylab that flipped a logit by 1.7 at one step.
# So the fast cache stores K and V in fp32: they are bf16/fp16 values (outputs of the projections),
# held exactly, and each step converts only the one query instead of the whole cached K and V.
# Cost: twice the KV bytes of a bf16 cache, about 1% of the weight bytes read per token at batch 1
# and a few hundred tokens of context on SmolLM2-135M.
ATTENTION_DTYPE = torch.float32

# How to store a weight for `x @ W` with one row x (trick 1), per dtype. Measured on a 2-core AMD
# EPYC (Zen 5; torch 2.13 CPU build: MKL for fp32, oneDNN or torch's own BLAS for bf16/fp16),
# 30 distinct SmolLM2-135M-sized weights so they stream from DRAM; GB/s of weight read:
#                            (N,K) view   (K,N) copy   (K,N) in 2 column blocks
#   fp32  qkv 576x960            16           25             34
#         gate|up 576x3072       16           23             34
#         LM head 576x49152      16           26             39
#   bf16  qkv                    28-36*       3* / 17        - / 17
#         LM head                32-43*       1* / 12        - / 14     (* oneDNN off, see `onednn`)
# On a GPU we keep (N, K) views: cuBLAS streams both layouts at full speed.
KN_LAYOUT_IS_FASTER = {torch.float32: True, torch.bfloat16: False, torch.float16: False}


def onednn(enabled: bool):
    """Switch torch's oneDNN (mkldnn) CPU kernels on or off for a `with` block, restoring them after.

    For one-row bf16 matmuls oneDNN streamed the weights at 12-23 GB/s here, while torch's own BLAS
    GEMV (what runs with oneDNN off) reached 28-43 GB/s: a SmolLM2-135M decode step took 16.1 ms with
    it and 10.8 ms without in bf16 (20.2 and 17.0 ms in fp32, where it routes the column-block bmm).
    For a 64-token bf16 prefill it is the other way round (53 ms with it, 302 ms without: oneDNN's
    GEMM uses the CPU's bf16 dot-product instructions), so decode steps run with it off and
    prefills with it on. A process-wide torch flag, so it is restored as soon as the step ends.
    """
    return torch.backends.mkldnn.flags(enabled=enabled, deterministic=None, allow_tf32=None, fp32_precision=None)


def matmul_operand(weight_nk: Tensor, kn_blocks: int | None) -> Tensor:
    """The right operand of `x @ W` for an nn.Linear weight [N, K] (trick 1).

    kn_blocks=None: a transposed *view* [K, N] of the (N, K) weight, no copy (torch passes the
    BLAS a "transposed" flag). kn_blocks=P: a contiguous (K, N) copy cut into P column blocks,
    [P, K, N/P], block p holding output columns p*N/P .. (p+1)*N/P - 1 (one block if P does not
    divide N). `matmul` below multiplies either kind.
    """
    w = weight_nk.detach()
    if kn_blocks is None:
        return w.t()  # [K, N]
    N, K = w.shape
    P = kn_blocks if N % kn_blocks == 0 else 1
    return w.reshape(P, N // P, K).transpose(1, 2).contiguous()  # [P, K, N/P]


def matmul(x: Tensor, w: Tensor, add: Tensor | None = None) -> Tensor:
    """x [T, K] @ W (+ add, a bias [N] or a residual [T, N]) -> [T, N], W from `matmul_operand`.

    With W in P column blocks [P, K, N/P], x is broadcast to every block (no copy) and one
    `bmm` computes the P slices of the output [P, T, N/P], each on its own core (trick 1).
    """
    if w.dim() == 2:  # [K, N]
        return x @ w if add is None else torch.addmm(add, x, w)
    P, T, n = w.shape[0], x.shape[0], w.shape[2]
    xs = x.expand(P, T, x.shape[1])  # [P, T, K], a view
    if add is None:
        out = torch.bmm(xs, w)  # [P, T, n]
    else:  # the add's columns cut the same way: [T or 1, N] -> [P, T or 1, n]
        out = torch.baddbmm(add.view(-1, P, n).transpose(0, 1), xs, w)
    return out.view(T, P * n) if T == 1 else out.transpose(0, 1).reshape(T, P * n)  # [T, N]


def _bias(*linears: torch.nn.Linear) -> Tensor | None:
    """The concatenated biases of fused linears, or None if they have none."""
    if linears[0].bias is None:
        return None
    return torch.cat([lin.bias.detach() for lin in linears]).contiguous()


@dataclass
class FastLayer:
    """One decoder layer's weights, fused, as `matmul` operands (shapes shown as [K, N])."""

    ln1: Tensor  # [E] input RMSNorm weight
    wqkv: Tensor  # [E, (H + 2 Hkv) D]: q | k | v columns
    bqkv: Tensor | None  # [(H + 2 Hkv) D] (Qwen2) or None
    wo: Tensor  # [H D, E]
    bo: Tensor | None  # [E] or None
    ln2: Tensor  # [E] post-attention RMSNorm weight
    wgu: Tensor  # [E, 2F]: gate | up columns
    bgu: Tensor | None  # [2F] or None
    wd: Tensor  # [F, E]
    bd: Tensor | None  # [E] or None

    @classmethod
    def from_reference(cls, layer, kn_blocks: int | None) -> FastLayer:
        att, mlp = layer.self_attn, layer.mlp

        def fuse(*lins: torch.nn.Linear) -> Tensor:  # stack the (N, K) weights, then lay out once
            return matmul_operand(torch.cat([lin.weight for lin in lins], dim=0), kn_blocks)

        return cls(
            ln1=layer.input_layernorm.weight.detach(),
            wqkv=fuse(att.q_proj, att.k_proj, att.v_proj), bqkv=_bias(att.q_proj, att.k_proj, att.v_proj),
            wo=fuse(att.o_proj), bo=_bias(att.o_proj),
            ln2=layer.post_attention_layernorm.weight.detach(),
            wgu=fuse(mlp.gate_proj, mlp.up_proj), bgu=_bias(mlp.gate_proj, mlp.up_proj),
            wd=fuse(mlp.down_proj), bd=_bias(mlp.down_proj))


class FastKVCache:
    """Preallocated K and V of one sequence, all layers: kv [L, 2, Hkv, capacity, D], in fp32
    (ATTENTION_DTYPE) whatever the model dtype.

    Unlike `engine.kv_cache.KVCache` it never grows: `FastDecoder.generate` knows the final length
    up front, and a step that would overflow raises instead of writing past the end.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.kv = torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0  # positions 0 .. length-1 are filled

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise ValueError(f"FastKVCache full: {self.length} cached + {new_tokens} new tokens > "
                             f"capacity={self.capacity}; make the cache with a larger capacity")


class FastDecoder:
    """Batch-1 prefill and decode of a loaded `LlamaModel`, with the tricks of the module docstring.

        fast = FastDecoder(model)                       # copies the weights into the fast layout
        result = fast.generate(prompt_ids, params)      # same loop, sampler and stops as generate_naive

    or step by step:

        cache = fast.new_cache(capacity=64)
        logits = fast.prefill(cache, prompt_ids)       # [V], the next token's logits
        logits = fast.decode(cache, token)             # [V], one token at a time
    """

    def __init__(self, model: LlamaModel, kn_layout: bool | None = None, kn_blocks: int | None = None):
        """kn_layout: store weights (K, N) (default: where KN_LAYOUT_IS_FASTER says so, on CPU);
        kn_blocks: into how many column blocks to cut them then (default: one per torch thread)."""
        cfg, w = model.config, model.embed_tokens.weight
        if kn_layout is None:
            kn_layout = KN_LAYOUT_IS_FASTER.get(w.dtype, True) and w.device.type == "cpu"
        if kn_blocks is not None and kn_blocks < 1:
            raise ValueError(f"kn_blocks={kn_blocks} must be >= 1 (or None: one block per torch thread)")
        self.kn_blocks = (kn_blocks or torch.get_num_threads()) if kn_layout else None
        kn_blocks = self.kn_blocks
        self.config, self.dtype, self.device = cfg, w.dtype, w.device
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.Fi, self.eps, self.window = cfg.intermediate_size, cfg.rms_norm_eps, cfg.sliding_window
        self.scale = 1.0 / math.sqrt(self.D)
        with torch.no_grad():
            self.layers = [FastLayer.from_reference(layer, kn_blocks) for layer in model.layers]
            self.embed = w.detach()  # [V, E], looked up by row
            self.norm = model.norm.weight.detach()  # [E]
            self.lm_head = matmul_operand(model.lm_head.weight, kn_blocks)  # [E, V]: a copy if (K, N)
            self.cos, self.sin = self._rope_tables(model.inv_freq, cfg.max_position_embeddings)
            self.swap = self._rotate_half_matrix()  # [D, D]
            self.eye = torch.eye(self.D, dtype=ATTENTION_DTYPE, device=self.device)  # [D, D]

    def _rope_tables(self, inv_freq: Tensor, positions: int) -> tuple[Tensor, Tensor]:
        """cos, sin [max_positions, D] in fp32 (ATTENTION_DTYPE), the angles as `LlamaModel.rope` has them."""
        angles = torch.arange(positions, device=self.device).float()[:, None] * inv_freq.to(self.device)
        angles = torch.cat((angles, angles), dim=-1)  # [P, D]
        return angles.cos().to(ATTENTION_DTYPE), angles.sin().to(ATTENTION_DTYPE)

    def _rotate_half_matrix(self) -> Tensor:
        """S [D, D] with x @ S == rotate_half(x) == cat(-x[D/2:], x[:D/2])."""
        half, eye = self.D // 2, torch.eye(self.D // 2, dtype=ATTENTION_DTYPE, device=self.device)
        s = torch.zeros(self.D, self.D, dtype=ATTENTION_DTYPE, device=self.device)
        s[half:, :half] = -eye  # output i < D/2 takes -x[i + D/2]
        s[:half, half:] = eye  # output i >= D/2 takes x[i - D/2]
        return s

    def rope_matrices(self, start: int, T: int) -> Tensor:
        """R [T, D, D] with x @ R[t] == apply_rope(x) at position start + t (trick 5).

        apply_rope(x) = x * cos + rotate_half(x) * sin = x @ (diag(cos) + S diag(sin)).
        """
        cos, sin = self.cos[start:start + T, None, :], self.sin[start:start + T, None, :]  # [T, 1, D]
        return self.eye * cos + self.swap * sin  # [T, D, D]

    def new_cache(self, capacity: int | None = None) -> FastKVCache:
        """An empty cache for one sequence of up to `capacity` tokens (default: the model's context)."""
        max_len = self.config.max_position_embeddings
        capacity = max_len if capacity is None else capacity
        if not 1 <= capacity <= max_len:
            raise ValueError(f"capacity={capacity} must be in [1, max_position_embeddings={max_len}]")
        return FastKVCache(len(self.layers), self.Hkv, self.D, capacity, ATTENTION_DTYPE, self.device)

    @torch.inference_mode()
    def prefill(self, cache: FastKVCache, token_ids: list[int] | Tensor) -> Tensor:
        """Run T new tokens (a prompt, or a chunk of one) after what `cache` holds; logits [V] of the last."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)  # [T]
        return self._forward(cache, ids)

    @torch.inference_mode()
    def decode(self, cache: FastKVCache, token_id: int) -> Tensor:
        """One decode step: feed one token, return the next position's logits [V]."""
        return self._forward(cache, torch.tensor([token_id], device=self.device))

    def _forward(self, cache: FastKVCache, ids: Tensor) -> Tensor:
        T, start = ids.shape[0], cache.length
        if T == 0:
            raise ValueError("token_ids is empty; feed at least one token")
        cache.check_room(T)
        rot = self.rope_matrices(start, T)  # [T, D, D], shared by every layer
        mask = self._mask(T, start + T)  # None for a plain decode step
        x = self.embed[ids]  # [T, E]
        with onednn(enabled=T > 1):  # one-row matmuls are faster without it (see `onednn`)
            for layer, kv in zip(self.layers, cache.kv, strict=True):
                x = self._attention(x, layer, kv, start, rot, mask)
                x = self._mlp(x, layer)
            h = F.rms_norm(x[-1:], self.norm.shape, self.norm, self.eps)  # [1, E]: only the last position
            logits = matmul(h, self.lm_head)[0]  # [V]
        cache.length += T
        return logits

    def _mask(self, T: int, S: int) -> Tensor | None:
        """[T, S] True = may attend; None for one query (decode), which sees every key we hand it."""
        if T == 1:
            return None
        return causal_mask(T, S, self.window, self.device)

    def _attention(self, x: Tensor, w: FastLayer, kv: Tensor, start: int, rot: Tensor,
                   mask: Tensor | None) -> Tensor:
        """x [T, E] -> x + attention(rmsnorm(x)) [T, E], writing this layer's k, v into kv[:, :, start:]."""
        T, H, Hkv, D = x.shape[0], self.H, self.Hkv, self.D
        h = F.rms_norm(x, w.ln1.shape, w.ln1, self.eps)  # [T, E]
        qkv = matmul(h, w.wqkv, w.bqkv)  # [T, (H+2Hkv) D]
        qk = qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D).to(ATTENTION_DTYPE)  # [T, H+Hkv, D]
        qk = torch.bmm(qk, rot)  # RoPE'd, in fp32 like the rest of attention
        kv[0, :, start:start + T] = qk[:, H:].transpose(0, 1)  # keys   [Hkv, T, D], in place
        kv[1, :, start:start + T] = qkv[:, (H + Hkv) * D:].view(T, Hkv, D).transpose(0, 1)  # values
        S = start + T
        lo = 0 if mask is not None or self.window is None else max(0, S - self.window)  # window: last W keys
        out = self._attend(qk[:, :H], kv[0, :, lo:S], kv[1, :, lo:S], mask)  # [T, H D]
        x = matmul(out, w.wo, add=x)  # x + out @ Wo in one call (trick 4)
        return x if w.bo is None else x + w.bo

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(q k^T / sqrt(D) + mask) v in fp32, GQA without copies (trick 6).

        q [T, H, D], keys/values [Hkv, S, D] (all fp32), mask [T, S] or None -> [T, H D] (model dtype).
        The H query heads are Hkv groups of G = H / Hkv heads that share one KV head, so we view
        q as [Hkv, G T, D]: one batched matmul per KV head covers its whole group.
        """
        T, H, D = q.shape
        Hkv, S = keys.shape[0], keys.shape[1]
        q = q.transpose(0, 1).reshape(Hkv, (H // Hkv) * T, D)  # [Hkv, G T, D] (a view when T == 1)
        scores = torch.bmm(q, keys.transpose(1, 2)) * self.scale  # [Hkv, G T, S]
        if mask is not None:
            scores = scores.view(Hkv, H // Hkv, T, S).masked_fill(~mask, float("-inf")).view(Hkv, -1, S)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, values)  # [Hkv, G T, D]
        return out.view(H, T, D).transpose(0, 1).reshape(T, H * D).to(self.dtype)  # [T, H D]

    def _mlp(self, x: Tensor, w: FastLayer) -> Tensor:
        """x [T, E] -> x + down(silu(gate) * up) [T, E], gate and up from one fused matmul (trick 3)."""
        h = F.rms_norm(x, w.ln2.shape, w.ln2, self.eps)  # [T, E]
        gu = matmul(h, w.wgu, w.bgu)  # [T, 2F]
        a = F.silu(gu[:, :self.Fi]) * gu[:, self.Fi:]  # [T, F]
        x = matmul(a, w.wd, add=x)  # x + a @ Wd
        return x if w.bd is None else x + w.bd

    def step(self, cache: FastKVCache, new_ids: list[int]) -> Tensor:
        """`run_loop`'s step function: prefill for several new tokens, decode for one."""
        return self.decode(cache, new_ids[0]) if len(new_ids) == 1 else self.prefill(cache, new_ids)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 tokenizer: Tokenizer | None = None, on_text=None) -> GenerationResult:
        """`generate_naive`'s loop (same sampler, same stops) with this decoder as the step function."""
        params = params or SamplingParams()
        max_len = self.config.max_position_embeddings
        prompt_ids = encode_prompt(prompt, tokenizer, max_len)
        cache = self.new_cache(min(max_len, len(prompt_ids) + params.max_tokens))
        eos = eos_ids(self, tokenizer)  # reads only `.config`, which we share with the model
        return run_loop(lambda new: self.step(cache, new), prompt_ids, params, tokenizer, eos, max_len, on_text)

"""Chapter 03: the KV cache, contiguous per sequence, and its sliding-window variant.

A past token's key and value never change (its inputs never change), so we compute them once,
keep them, and at each new step project only the new token:

    step t, no cache:   q,k,v for tokens 0..t      attention over 0..t     -> O(t) projections
    step t, KV cache:   q,k,v for token t only     attention over cache    -> O(1) projections
                        write k_t, v_t into slot t

Memory, per sequence: 2 (K and V) x L layers x T tokens x Hkv heads x D dims x bytes per element
(`engine.companions.memory.kv_cache_bytes`). Storing only the Hkv KV heads is what makes GQA/MQA
cheaper.

Layout of `KVCache` (one tensor for K and one for V, all layers):

    k: [L, B, capacity, Hkv, D]     slot t of sequence b holds the key of position t
       └─ 0 1 2 ... length-1 | free ... capacity-1

It is preallocated and written in place (never `torch.cat` per step); when a sequence outgrows
`capacity` we reallocate by a whole chunk, so the copy happens rarely. A sliding window instead
keeps only the last W positions in a ring buffer: slot = position % W.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engine.companions.naive import GenerationResult, run_loop
from engine.model import LlamaModel, causal_mask, repeat_kv
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer, encode_prompt, eos_ids

GROW_CHUNK_TOKENS = 256  # grow the cache by whole chunks, so reallocation is rare


class KVCache:
    """A contiguous cache for B sequences that advance together (same length)."""

    def __init__(self, model: LlamaModel, batch: int = 1, capacity: int | None = None,
                 max_tokens: int | None = None):
        cfg, w = model.config, model.embed_tokens.weight
        self.max_tokens = max_tokens or cfg.max_position_embeddings
        capacity = capacity or min(GROW_CHUNK_TOKENS, self.max_tokens)
        if not 1 <= capacity <= self.max_tokens:
            raise ValueError(f"capacity={capacity} must be in [1, max_tokens={self.max_tokens}]")
        self.shape_tail = (cfg.num_key_value_heads, cfg.head_dim)
        self.L, self.B = cfg.num_hidden_layers, batch
        # Mistral-style models mask beyond it even when all is cached
        self.model_window = cfg.sliding_window
        self.k = w.new_zeros(self.L, batch, capacity, *self.shape_tail)  # [L, B, cap, Hkv, D]
        self.v = torch.zeros_like(self.k)
        self.length = 0  # tokens cached per sequence

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's tensors
        (what `kv_cache_bytes` predicts for `capacity` tokens)."""
        return self.k.nbytes + self.v.nbytes

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more tokens, growing by whole chunks;
        refuse past max_tokens."""
        needed = self.length + new_tokens
        if needed > self.max_tokens:
            raise ValueError(f"KV cache full: {self.length} cached + {new_tokens} new tokens > "
                             f"max_tokens={self.max_tokens}; shorten the request or use a sliding "
                             "window")
        if needed <= self.capacity:
            return
        new_cap = min(self.max_tokens, math.ceil(needed / GROW_CHUNK_TOKENS) * GROW_CHUNK_TOKENS)
        grown = self.k.new_zeros(self.L, self.B, new_cap, *self.shape_tail)
        grown_v = torch.zeros_like(grown)
        grown[:, :, :self.length] = self.k[:, :, :self.length]
        grown_v[:, :, :self.length] = self.v[:, :, :self.length]
        self.k, self.v = grown, grown_v

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta=None) -> Tensor:
        """Attention backend: write the new k, v [B, T, Hkv, D] after the cached ones,
        attend over all."""
        T, start = q.shape[1], self.length
        self.k[layer, :, start:start + T] = k  # in place: no torch.cat
        self.v[layer, :, start:start + T] = v
        # [B, start+T, Hkv, D]
        keys, values = self.k[layer, :, :start + T], self.v[layer, :, :start + T]
        return attend(q, keys, values, causal_mask(T, start + T, self.model_window, q.device))

    def advance(self, tokens: int) -> None:
        """Called once per forward, after all layers wrote: the new tokens are now cached."""
        self.length += tokens


class SlidingWindowKVCache:
    """Keeps only the last `window` positions per sequence, in a ring buffer (slot = position % W).

    Memory stays constant however long the sequence grows; tokens older than the window are
    forgotten, which is exactly what a `recall` question about an early fact will expose.
    """

    def __init__(self, model: LlamaModel, window: int, batch: int = 1):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        cfg, w = model.config, model.embed_tokens.weight
        self.window, self.L, self.B = window, cfg.num_hidden_layers, batch
        # [L,B,W,Hkv,D]
        self.k = w.new_zeros(self.L, batch, window, cfg.num_key_value_heads, cfg.head_dim)
        self.v = torch.zeros_like(self.k)
        # position held by slot
        self.slot_pos = torch.full((window,), -1, dtype=torch.long, device=w.device)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, new_tokens: int) -> None:
        """Never full: old positions are overwritten (documented behaviour of a window)."""

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta=None) -> Tensor:
        T, start, W = q.shape[1], self.length, self.window
        new_pos = torch.arange(start, start + T, device=q.device)
        # [B, W+T, Hkv, D]: the ring, then the new tokens
        keys = torch.cat([self.k[layer], k], dim=1)
        values = torch.cat([self.v[layer], v], dim=1)
        k_pos = torch.cat([self.slot_pos, new_pos])  # [W+T]
        q_pos = new_pos[:, None]
        mask = (k_pos[None] >= 0) & (k_pos[None] <= q_pos) & (q_pos - k_pos[None] < W)  # [T, W+T]
        out = attend(q, keys, values, mask)
        keep = slice(max(0, T - W), T)  # only the last W new tokens survive in the ring
        slots = new_pos[keep] % W
        self.k[layer][:, slots], self.v[layer][:, slots] = k[:, keep], v[:, keep]
        if layer == self.L - 1:
            self.slot_pos[slots] = new_pos[keep]
        return out

    def advance(self, tokens: int) -> None:
        self.length += tokens


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with GQA.
    q [B,Tq,H,D], keys/values [B,Tk,Hkv,D], mask [Tq,Tk]."""
    group = q.shape[2] // keys.shape[2]
    keys, values = repeat_kv(keys, group), repeat_kv(values, group)  # [B, Tk, H, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask)  # [B, H, Tq, D]
    return out.transpose(1, 2)  # [B, Tq, H, D]


@torch.inference_mode()
def forward_with_cache(model: LlamaModel, cache: KVCache | SlidingWindowKVCache, input_ids: Tensor,
                       last_only: bool = True) -> Tensor:
    """Run only the new tokens input_ids [B, T] through the model, reading the past from `cache`."""
    B, T = input_ids.shape
    cache.reserve(T)
    positions = torch.arange(cache.length, cache.length + T, device=input_ids.device).expand(B, T)
    logits = model(input_ids, positions, backend=cache, last_only=last_only)
    cache.advance(T)
    return logits


def generate_cached(model: LlamaModel, tokenizer: Tokenizer | None, prompt: str | list[int],
                    params: SamplingParams | None = None, window: int | None = None,
                    on_text=None) -> GenerationResult:
    """The same loop as `generate_naive`, but each step feeds only the new token
    (the cache has the rest)."""
    params = params or SamplingParams()
    max_len = model.config.max_position_embeddings
    prompt_ids = encode_prompt(prompt, tokenizer, max_len)
    device = model.embed_tokens.weight.device
    if window is not None:
        cache = SlidingWindowKVCache(model, window)
    else:
        capacity = min(max_len, len(prompt_ids) + params.max_tokens)
        cache = KVCache(model, capacity=capacity)

    def step_fn(new_ids: list[int]) -> Tensor:
        return forward_with_cache(model, cache, torch.tensor([new_ids], device=device))[0]  # [V]

    return run_loop(step_fn, prompt_ids, params, tokenizer, eos_ids(model, tokenizer), max_len,
                    on_text)

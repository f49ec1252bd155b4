"""The paged KV cache's tensors: one object owns every pool and does every block copy.

The block manager (``engine/kv/block_manager.py``) decides which block holds which tokens; this
file holds the bytes. Per layer there is one K pool and one V pool on the device, and, when
preemption is by swap, a CPU pool of the same layout for each::

    layer l:  k[l], v[l]            [NB, BS, Hkv, D]   on the model's device
              k_swap[l], v_swap[l]  [NSB, BS, Hkv, D]  on the CPU (NSB = 0: no swap pool)
              k_host[l], v_host[l]  [NHB, BS, Hkv, D]  on the CPU: the host tier of the prefix cache
                                                        (NHB = 0: none; engine/kv/block_manager.py)

    slot s of the device pool  =  k[l][s // BS, s % BS]      (one token's K for every KV head)

Sizing: how many blocks is decided by ``plan_num_blocks`` from the ``CacheConfig``, in bytes, as
vLLM does: an explicit ``num_blocks``, an explicit ``kv_cache_memory_bytes``, or by default
the smaller of what ``max_num_seqs`` full-length requests need and a default budget
(``DEFAULT_KV_CACHE_MEMORY_BYTES``, or ``$SERVELAB_KVCACHE_SPACE`` GiB). ``log_kv_cache`` then
tells the user what they got, in vLLM's words.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.companions.memory import kv_block_bytes, num_kv_blocks
from engine.config import DEFAULT_KV_CACHE_MEMORY_BYTES, KVCACHE_SPACE_ENV, CacheConfig, ModelConfig
from engine.kv.block_manager import BlockMove

logger = logging.getLogger("engine")
GiB = 2**30


@dataclass
class PoolShape:
    """How many blocks of what a pool holds: what every rank of a parallel engine needs to build its
    share (the same block ids everywhere; engine/parallel/executor.py)."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype
    num_swap_blocks: int = 0
    num_host_blocks: int = 0


class PagedKVPool:
    """Per-layer K and V pools [NB, BS, Hkv, D] on the device, their CPU swap twins, and the copies.

    Attention reads and writes ``k[layer]`` / ``v[layer]`` in place; ``apply_moves`` does the
    copies a scheduler step asks for (swap out, swap in, copy-on-write, offload, reload).

    ``dtype=torch.int8`` (KV int8, chapter 07): the pools hold int8 values, and ``k_scale[layer]`` /
    ``v_scale[layer]`` [NB, BS, Hkv] fp32 one scale per token and KV head (and so do the CPU twins);
    ``scales(layer)`` gives them to the kernels, and every block move copies them with the values.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", num_swap_blocks: int = 0,
                 num_host_blocks: int = 0):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVPool: {name} must be an integer >= 1, got {value!r}")
        for name, value in (("num_swap_blocks", num_swap_blocks),
                            ("num_host_blocks", num_host_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PagedKVPool: {name} must be an integer >= 0, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_swap_blocks = num_swap_blocks
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)  # [NB, BS, Hkv, D]
        swap_shape = (num_swap_blocks, *shape[1:])  # [NSB, BS, Hkv, D]
        pin = self.device.type == "cuda"  # page-locked CPU memory: faster device <-> CPU copies
        host_shape = (num_host_blocks, *shape[1:])  # [NHB, BS, Hkv, D]
        self.num_host_blocks = num_host_blocks
        self.k, self.v, self.k_scale, self.v_scale = _layers(num_layers, shape, dtype,
                                                             device=self.device)
        self.k_swap, self.v_swap, self.k_scale_swap, self.v_scale_swap = _layers(num_layers,
                                                                                 swap_shape, dtype,
                                                                                 pin_memory=pin)
        self.k_host, self.v_host, self.k_scale_host, self.v_scale_host = _layers(num_layers,
                                                                                 host_shape, dtype,
                                                                                 pin_memory=pin)

    def scales(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """(k_scale, v_scale) [NB, BS, Hkv] of an int8 pool, or None for float pools."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.k_scale else None

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str, num_swap_blocks: int = 0,
                  num_host_blocks: int = 0) -> PagedKVPool:
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                   config.head_dim, dtype, device, num_swap_blocks, num_host_blocks)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes of the device pools: K and V of every layer (the KV cache formula, T = NB * BS),
        and the scales of int8 pools."""
        return sum(t.nbytes for t in self._pools("device"))

    @property
    def swap_nbytes(self) -> int:
        """Bytes of the CPU swap pools."""
        return sum(t.nbytes for t in self._pools("swap"))

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host tier."""
        return sum(t.nbytes for t in self._pools("host"))

    @property
    def block_nbytes(self) -> int:
        """Bytes one block holds over every layer, K and V: what one block move copies."""
        return self.nbytes // self.num_blocks

    @torch.inference_mode()
    def apply_moves(self, moves: list[BlockMove]) -> dict[str, int]:
        """Do the block copies the block manager decided, IN ORDER (``BlockManager.take_moves``);
        returns the number of blocks moved per kind. Consecutive moves of one kind are one indexed
        copy per pool: within such a run no block is both written and read (the manager hands out
        fresh destinations)."""
        counts: dict[str, int] = {}
        for kind, run in itertools.groupby(moves, key=lambda m: m.kind):
            run = list(run)
            src, dst = _columns([(m.src, m.dst) for m in run])
            src_pools, dst_pools = self._pools(_SOURCE[kind]), self._pools(_DESTINATION[kind])
            src, dst = src.to(src_pools[0].device), dst.to(dst_pools[0].device)
            for s_pool, d_pool in zip(src_pools, dst_pools, strict=True):
                d_pool[dst] = s_pool[src].to(d_pool.device)
            counts[kind] = counts.get(kind, 0) + len(run)
        return counts

    def _pools(self, tier: str) -> list[Tensor]:
        """Every layer's K, V (and scale) pools of one tier: "device", "swap" or "host"; all
        [N?, BS, ...], indexed by block id in their first dimension."""
        if tier == "device":
            return self.k + self.v + self.k_scale + self.v_scale
        if tier == "swap":
            return self.k_swap + self.v_swap + self.k_scale_swap + self.v_scale_swap
        return self.k_host + self.v_host + self.k_scale_host + self.v_scale_host

    @torch.inference_mode()
    def move_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                    copies: list[tuple[int, int]]) -> None:
        """Do one step's copies, in a safe order: GPU->CPU, CPU->GPU, then GPU->GPU (copy-on-write).

        swap_out: (GPU block, CPU block) pairs; swap_in: (CPU block, GPU block); copies: (src, dst).
        Within one list no block is both a source and a destination (the block manager hands out
        fresh blocks as destinations), so each list is done as one indexed copy per pool.
        """
        out_gpu, out_cpu = _columns(swap_out)  # index tensors on the CPU, built once for all layers
        in_cpu, in_gpu = _columns(swap_in)
        src, dst = _columns(copies)
        out_gpu, in_gpu, src, dst = (t.to(self.device) for t in (out_gpu, in_gpu, src, dst))
        for pool, swap in zip(self._pools("device"), self._pools("swap"), strict=True):
            if swap_out:
                swap[out_cpu] = pool[out_gpu].cpu()
            if swap_in:
                pool[in_gpu] = swap[in_cpu].to(self.device)
            if copies:
                pool[dst] = pool[src]


def _layers(num_layers: int, shape: tuple, dtype: torch.dtype,
            **where) -> tuple[list, list, list, list]:
    """Per-layer K and V pools of ``shape`` [N, BS, Hkv, D], and, for int8, their fp32 scales
    [N, BS, Hkv] (empty lists otherwise)."""
    k = [torch.zeros(shape, dtype=dtype, **where) for _ in range(num_layers)]
    v = [torch.zeros(shape, dtype=dtype, **where) for _ in range(num_layers)]
    if dtype != torch.int8:
        return k, v, [], []
    k_scale = [torch.zeros(shape[:3], dtype=torch.float32, **where) for _ in range(num_layers)]
    v_scale = [torch.zeros(shape[:3], dtype=torch.float32, **where) for _ in range(num_layers)]
    return k, v, k_scale, v_scale


_SOURCE = {"swap_out": "device", "swap_in": "swap", "copy": "device", "offload": "device",
           "reload": "host"}
_DESTINATION = {"swap_out": "swap", "swap_in": "device", "copy": "device", "offload": "host",
                "reload": "device"}


def _columns(pairs: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """[(a, b), ...] -> (tensor of the a's, tensor of the b's), int64 on the CPU."""
    both = torch.tensor(pairs, dtype=torch.int64).reshape(len(pairs), 2)  # [P, 2]
    return both[:, 0], both[:, 1]


# ---- sizing ----------------------------------------------------------------------------------
def default_kv_cache_memory_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The default KV budget: ``$SERVELAB_KVCACHE_SPACE`` GiB when set (like vLLM's
    ``VLLM_CPU_KVCACHE_SPACE``), else ``DEFAULT_KV_CACHE_MEMORY_BYTES`` (1 GiB)."""
    environ = os.environ if environ is None else environ
    text = environ.get(KVCACHE_SPACE_ENV, "").strip()
    if not text:
        return DEFAULT_KV_CACHE_MEMORY_BYTES
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"{KVCACHE_SPACE_ENV}={text!r} must be a positive number of GiB "
                         "(e.g. 4 or 0.5); unset it for the default of "
                         f"{DEFAULT_KV_CACHE_MEMORY_BYTES / GiB:g} GiB")
    return int(gib * GiB)


def plan_num_blocks(model_config: ModelConfig, cache: CacheConfig, max_num_seqs: int, dtype,
                    environ: Mapping[str, str] | None = None) -> int:
    """How many device KV blocks to allocate, from the CacheConfig (in this order):

    1. ``num_blocks``, when given: exactly that many;
    2. ``kv_cache_memory_bytes``, when given: as many whole blocks as fit in that many bytes;
    3. otherwise the smaller of what ``max_num_seqs`` requests of ``max_position_embeddings``
       tokens need and what fits in the default budget (``$SERVELAB_KVCACHE_SPACE`` GiB, or
       ``DEFAULT_KV_CACHE_MEMORY_BYTES``). So a model with an 8k context does not reserve
       16 x 8k tokens of KV, and a small model does not reserve more than it could ever use.
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_memory_bytes is not None:
        return _blocks_in_budget(model_config, cache.block_size, dtype, cache.kv_cache_memory_bytes,
                                 "kv_cache_memory_bytes")
    needed = max_num_seqs * math.ceil(model_config.max_position_embeddings / cache.block_size)
    environ = os.environ if environ is None else environ
    budget = default_kv_cache_memory_bytes(environ)
    source = (KVCACHE_SPACE_ENV if environ.get(KVCACHE_SPACE_ENV, "").strip()
              else "DEFAULT_KV_CACHE_MEMORY_BYTES")
    return min(needed, _blocks_in_budget(model_config, cache.block_size, dtype, budget, source))


def _blocks_in_budget(model_config: ModelConfig, block_size: int, dtype, budget: int,
                      source: str) -> int:
    blocks = num_kv_blocks(model_config, block_size, dtype, budget)
    if blocks < 1:
        per_block = kv_block_bytes(model_config, block_size, dtype)
        raise ValueError(f"{source} = {budget} bytes holds no KV block: one block of "
                         f"{block_size} tokens takes {per_block} bytes for this model; "
                         f"give at least {per_block} bytes, or set num_blocks")
    return blocks


def log_kv_cache(pool: PagedKVPool, max_model_len: int, cache: CacheConfig | None = None) -> None:
    """Tell the user, at INFO on the "engine" logger, what the KV cache holds (as vLLM logs it).

    A pool that holds fewer tokens than one request of ``max_model_len`` is a WARNING when the size
    was ours to choose (the default budget, or ``$SERVELAB_KVCACHE_SPACE``, came out too small: a
    misconfiguration to fix), and a plain INFO line when the caller set it (``cache.num_blocks`` or
    ``cache.kv_cache_memory_bytes``): the chapters make tiny pools on purpose, to watch them fill.
    """
    tokens = pool.num_blocks * pool.block_size
    concurrency = pool.num_blocks / math.ceil(max_model_len / pool.block_size)
    logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.3f GiB (%s); "
                "CPU swap space: %d blocks, %.3f GiB", pool.num_blocks, pool.block_size, tokens,
                pool.nbytes / GiB, str(pool.dtype).removeprefix("torch."), pool.num_swap_blocks,
                pool.swap_nbytes / GiB)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len, concurrency)
    if concurrency >= 1:
        return
    chosen = _explicit_size(cache)
    if chosen:
        logger.info("the KV cache holds %d tokens (%s), fewer than one request of "
                    "max_model_len=%d: longer requests will be rejected", tokens, chosen,
                    max_model_len)
        return
    logger.warning("the KV cache holds %d tokens, fewer than one request of "
                   "max_model_len=%d: longer requests will be rejected; raise "
                   "kv_cache_memory_bytes or num_blocks", tokens, max_model_len)


def _explicit_size(cache: CacheConfig | None) -> str:
    """"num_blocks=24" (or kv_cache_memory_bytes=...) when the caller chose the size, else ""."""
    if cache is not None and cache.num_blocks is not None:
        return f"num_blocks={cache.num_blocks}"
    if cache is not None and cache.kv_cache_memory_bytes is not None:
        return f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    return ""

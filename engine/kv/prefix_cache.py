"""Chapter 06: the prefix cache. Requests that share a prefix share its KV blocks instead of
prefilling it again.

A system prompt, a RAG document, a few-shot block, the earlier turns of a chat: many requests start
with the same tokens, and the K/V of a token depends only on the tokens before it (and the model).
So once one request has computed the K/V of a FULL block, every later request whose tokens up to
the end of that block are the same can point its block table at that block, and prefill only the
rest.

We name a full block by a *chained hash* (vLLM's "block hash"): the hash of its parent block's
hash, its own BS token ids, and the *extra keys*, everything else that changes the K/V or who may
read it::

    extra = (model id, template version, scope)    e.g. ("tiny:3f9a..", "v2", "tenant:acme")
    h0 = sha256(None, tokens[0:4],  extra)          BS = 4
    h1 = sha256(h0,   tokens[4:8],  extra)          h1 names the whole prefix tokens[0:8], not
    h2 = sha256(h1,   tokens[8:12], extra)          just tokens[4:8]: the same 4 tokens after a
                                                    different start get another hash
    tokens[12:14] (a partial last block): never hashed, never shared. Its slots are still
    being written.

The cache itself is two maps and a queue (`PrefixCache`):

    hash -> block     which physical block holds the prefix a hash names
    block -> hash     so that when a block is reused for other tokens, we drop its hash FIRST
    evictor           the "free but cached" blocks: no table holds them (refcount 0), their K/V
                      is still valid. They are reused only when the free list is empty, in the
                      order of the eviction policy (least recently used first by default;
                      engine/kv/evictor.py).

What the key must contain, and what goes wrong without it:
- the model's identity (`model_id`: its name and a hash of a sample of its weights): without it,
  new weights would read K/V computed by the old ones;
- the template version (a chat template turns messages into tokens; the caller names its
  version): without it, a request under a new template could reuse blocks made under the old one;
- the scope: a tenant's name (private, the default when a tenant is given) or "public" (opt-in,
  e.g. a system prompt every tenant shares; requests without a tenant are public too). Without
  it, tenant B's request that merely GUESSES tenant A's prompt would be served A's K/V, and a hit
  is visible in the time to first token: a side channel.

We use sha256, never Python's `hash()`: that one is salted per process (`PYTHONHASHSEED`), so
hashes could not be saved in a trace or compared across runs, and a 64-bit hash makes a deliberate
collision (another tenant's block under your hash) cheap. The scope's isolation argument rests on
collision resistance, so we keep a cryptographic hash and make it cheap instead: one digest per
block over a fixed binary layout (no JSON, no Python objects)::

    root = sha256(JSON of the extra keys)                  once per request, not per block
    h0   = sha256(root bytes   || tokens[0:BS] as int64 little-endian)
    h1   = sha256(h0 bytes     || tokens[BS:2BS] ...)

Every hash descends from the root, so the extra keys still name every block. About 1 us a block on
a 2-core EPYC (the JSON version took 4), which is why prefix caching can be on by default: at 0 %
hits its bookkeeping stays under 1 % of a step (benchmarks/prefix_cache.py measures it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence

from engine.kv.evictor import Evictor, LRUEvictor

# The scope every tenant shares (opt-in per request, or a request with no tenant).
PUBLIC_SCOPE = "public"
CACHE_SCOPES = (None, "private", PUBLIC_SCOPE)  # what add_request's cache_scope accepts
# Values read from each weight tensor for the model id: a few KB for the whole model.
WEIGHT_SAMPLE = 64


def root_hash(extra_keys: Sequence) -> str:
    """The chain's starting point: sha256 of the extra keys (model id, template version, scope)."""
    plain = json.dumps(list(extra_keys), separators=(",", ":"), default=str)
    return hashlib.sha256(plain.encode()).hexdigest()


def block_hash(parent: str | None, token_ids: Sequence[int], extra_keys: Sequence) -> str:
    """The hash of one full block, in hex: sha256 of the parent block's hash (the root of the
    extra keys for block 0) and the block's token ids as little-endian int64.

    `extra_keys` is read only for block 0 (parent None): later blocks inherit it through the chain.
    """
    digest = hashlib.sha256(bytes.fromhex(parent if parent is not None else root_hash(extra_keys)))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.hexdigest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Sequence, start: int = 0,
                 parent: str | None = None) -> list[str]:
    """Hashes of the full blocks start, start + 1, ... of `token_ids` (the partial last block has
    none).

    `parent` is the hash of block start - 1 (None for block 0), so a caller that hashed a prefix
    before only hashes the new blocks: the chain continues where it stopped.
    """
    out = []
    if parent is None and len(token_ids) >= (start + 1) * block_size:
        parent = root_hash(extra_keys)  # hashed once here, not once per block
    for i in range(start, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        out.append(parent)
    return out


def cache_scope(tenant: str | None, requested: str | None = None) -> str:
    """The scope part of the key: "tenant:<name>" (private) or "public".

    requested None: private when there is a tenant, public without one; "private" needs a tenant;
    "public" shares the blocks with every tenant that also asks for "public".
    """
    if requested not in CACHE_SCOPES:
        raise ValueError(f"cache_scope={requested!r} must be one of {CACHE_SCOPES} (None: private "
                         "when a tenant is given, else public)")
    if requested == "private" and tenant is None:
        raise ValueError("cache_scope='private' needs a tenant: pass tenant=..., or leave "
                         "cache_scope None")
    if requested == PUBLIC_SCOPE or tenant is None:
        return PUBLIC_SCOPE
    return f"tenant:{tenant}"


def cache_key(model_id: str, template_version: str | None = None, tenant: str | None = None,
              scope: str | None = None) -> tuple:
    """The extra keys of every block hash of a request: (model id, template version, scope)."""
    if template_version is not None and not isinstance(template_version, str):
        raise TypeError("template_version must be a str or None, got "
                        f"{type(template_version).__name__} {template_version!r}")
    return (model_id, template_version, cache_scope(tenant, scope))


def model_id(name: str, config: Mapping | object, tensors: Iterable) -> str:
    """A short identity of a model's weights: "<name>:<16 hex digits>", computed once, cheaply.

    We hash the config and, for each (name, tensor) in `tensors` (e.g.
    `model.state_dict().items()`), its name, shape, dtype and WEIGHT_SAMPLE values spread evenly
    over it. Reading every byte of a 7B model would take seconds; the sample catches a new
    checkpoint, a fine-tune, a quantization or a weight update in place (all change values
    everywhere). It would miss an edit of one value between the samples: for that, pass your own
    id (`LLMEngine(..., model_id="my-model@v2")`).
    """
    plain = json.dumps([name, _plain(config)], sort_keys=True, default=str)
    digest = hashlib.sha256(plain.encode())
    for tensor_name, t in sorted(tensors, key=lambda item: item[0]):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // WEIGHT_SAMPLE)
        sample = flat[::step][:WEIGHT_SAMPLE].float().cpu().numpy()
        digest.update(f"{tensor_name}:{tuple(t.shape)}:{t.dtype}:".encode())
        digest.update(sample.tobytes())
    return f"{name}:{digest.hexdigest()[:16]}"


def _plain(config) -> dict:
    return dict(config) if isinstance(config, Mapping) else dict(vars(config))


class PrefixCache:
    """hash -> block, block -> hash, and the evictor of free-but-cached blocks (see the module doc).

    The BlockManager owns one and the BlockAllocator asks it, so this class is bookkeeping only:
    it never decides when a block is free. A block is in one of three states::

        used             refcount >= 1, in some block table (with a hash, it can be shared)
        free but cached  refcount 0, has a hash, in the evictor (policy order): reusable on a hit
        free             refcount 0, no hash, on the allocator's free list

    `evict` removes the block's hash BEFORE handing the block out: a block is reused for other
    tokens only once no hash leads to it any more (the stale-hash bug, otherwise).

    `evictor` is the policy (engine/kv/evictor.py), fresh and empty; None: least recently used.
    """

    def __init__(self, evictor: Evictor | None = None):
        if evictor is not None and len(evictor):
            raise ValueError(f"the evictor must be new and empty, it holds {evictor.blocks()}: "
                             "pass make_evictor(policy)")
        self._block_of: dict[str, int] = {}
        self._hash_of: dict[int, str] = {}
        self._evictor: Evictor = evictor if evictor is not None else LRUEvictor()

    @property
    def evictor(self) -> Evictor:
        """The eviction policy's object (to read: the cache alone calls its methods)."""
        return self._evictor

    @property
    def num_evictable(self) -> int:
        return len(self._evictor)

    @property
    def num_hashes(self) -> int:
        return len(self._block_of)

    def evictable(self) -> list[int]:
        """The free-but-cached blocks in eviction order, the next victim first."""
        return self._evictor.blocks()

    def entries(self) -> dict[str, int]:
        """A copy of the hash -> block map."""
        return dict(self._block_of)

    def lookup(self, h: str) -> int | None:
        return self._block_of.get(h)

    def hash_of(self, block: int) -> str | None:
        return self._hash_of.get(block)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictor

    def register(self, block: int, h: str) -> bool:
        """`block` (full, its K/V written) holds the prefix `h`. Returns False, changing nothing,
        when another block already holds `h` (two requests computed the same prefix at once: we
        keep the first) or this block already has its hash."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h], self._hash_of[block] = block, h
        return True

    def unregister(self, block: int) -> str | None:
        """Drop the hash of `block`, which a table still holds, because its K/V is about to stop
        matching it (a rollback took back tokens it was hashed over). Returns the hash, or None
        when it had none. A free-but-cached block is evicted instead, never unregistered: no free
        list would take it back."""
        if block in self._evictor:
            raise ValueError(f"block {block} is free but cached: evict it, do not unregister it")
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            self._evictor.forget(block)  # the policy may remember it (FIFO's place in the queue)
        return h

    def park(self, block: int) -> None:
        """Its last holder let go of a hashed block: it becomes free but cached (evictor `add`)."""
        self._evictor.add(block)

    def unpark(self, block: int) -> None:
        """A hit on a free-but-cached block: it leaves the evictor (a table holds it again)."""
        self._evictor.remove(block)

    def evict(self) -> int:
        """Take the evictor's next victim, its hash removed first (for reuse)."""
        return self.evict_with_hash()[0]

    def evict_with_hash(self) -> tuple[int, str]:
        """`evict`, also returning the hash the block held (a host tier may keep its K/V under
        it)."""
        block = self._evictor.pop()
        h = self._hash_of.pop(block)
        del self._block_of[h]
        return block, h

    def clear(self) -> list[int]:
        """Forget every hash; returns the blocks that were free but cached (now simply free)."""
        freed = self._evictor.blocks()
        for block in self._hash_of:
            self._evictor.forget(block)
        self._block_of.clear()
        self._hash_of.clear()
        return freed

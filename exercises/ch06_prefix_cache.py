"""Chapter 06 exercises: block hashes, the longest cached prefix, how much a hit saves,
and a bug zoo.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch06

Part 1 builds the prefix cache's lookup by hand.
A full block of BS tokens is named by a chained hash:

    h0 = block_hash(None, tokens[0:4],  extra)   BS = 4, extra = (model id, template version, scope)
    h1 = block_hash(h0,   tokens[4:8],  extra)   h1 names the whole prefix tokens[0:8]
    tokens[8:10]: a partial block, never hashed

`block_hash` and `block_hashes` have the engine's names and signatures (engine/kv/prefix_cache.py),
and the checks demand the engine's exact hashes; `find_cached_prefix` is
`BlockManager.find_cached_prefix` with the cache passed in as a plain dict.

Part 2 is a BUG ZOO: three small functions of a prefix cache, each with one classic bug planted.
Each starts with a `raise NotImplementedError(BUG_ZOO)` line: delete that line, run the checks to
see the bug bite, then find it and fix it. Try not to peek at engine/kv/block_manager.py until the
checks pass.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

from engine.kv.prefix_cache import PUBLIC_SCOPE, root_hash  # noqa: F401 (root_hash: given, yours to use)
from engine.kv.prefix_cache import block_hashes as engine_block_hashes

BUG_ZOO = ("a planted bug lives below this line: delete this raise, run the checks, then find and "
           "fix the bug")


# ---- part 1: hashes and lookups ------------------------------------------------------------------


def block_hash(parent: str | None, token_ids: Sequence[int], extra_keys: Sequence) -> str:
    """The hash of one full block, exactly as the engine computes it, as a hex digest (64
    characters): sha256 over a fixed binary layout,

        the parent's hash as 32 raw bytes (for block 0, parent None: the raw bytes of
        root_hash(extra_keys), given above: sha256 of the extra keys' JSON text)
        then the block's token ids, each as a little-endian signed 64-bit integer.

    The extra keys are read only for block 0: every later hash inherits them through the chain.
    """
    raise NotImplementedError(
        "the docstring names every ingredient: which standard module turns a hex string back into "
        "bytes, which one packs integers into a fixed binary layout, and which one hashes bytes?")


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Sequence, start: int = 0,
                 parent: str | None = None) -> list[str]:
    """Hashes of the FULL blocks start, start + 1, ... of token_ids, each chained on the one before
    (`parent` is the hash of block start - 1; None for block 0).
    The partial last block gets none."""
    raise NotImplementedError(
        "which blocks are full, and what does each one's hash chain on? Where does the chain "
        "start when start > 0?")


def find_cached_prefix(token_ids: Sequence[int], extra_keys: Sequence, max_tokens: int,
                       block_size: int, cached: Mapping[str, int]) -> list[int]:
    """The physical blocks of the longest cached prefix of token_ids, in whole blocks, covering at
    most `max_tokens` tokens. `cached` maps a block hash to the physical block that holds it. The
    first block whose hash is not cached ends the prefix (later blocks cannot be used even if
    cached: their K/V attended to the missing block). [] when nothing is cached."""
    raise NotImplementedError(
        "how many tokens may the prefix cover at most, and why can no block after the first "
        "uncached one be used?")


def cached_prefix_tokens(prompt_len: int, shared_len: int, block_size: int) -> int:
    """A prompt of prompt_len tokens whose first shared_len tokens some earlier request computed
    (and are still cached): how many of its tokens does the engine find in the cache? Whole blocks
    only, and never the prompt's last token (its logits are needed). ValueError unless
    1 <= prompt_len, 0 <= shared_len <= prompt_len and block_size >= 1."""
    raise NotImplementedError(
        "which two limits cap the cached tokens (what was shared, and the token whose logits the "
        "engine needs), and in what units does the cache count? Which inputs make no sense?")


# ---- part 2: the bug zoo -------------------------------------------------------------------------


def plan_prefill(token_ids: Sequence[int], block_size: int, extra_keys: Sequence,
                 cached: Mapping[str, int]) -> tuple[list[int], int]:
    """A new request arrives: which cached blocks does it share, and from which position must it
    prefill? Returns (the cached physical blocks, in order; the first position to compute). The
    engine samples the next token from the logits of the prompt's LAST token, so that token must be
    computed."""
    raise NotImplementedError(BUG_ZOO)
    blocks = []
    for h in engine_block_hashes(token_ids, block_size, extra_keys):
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks, len(blocks) * block_size


def allocate_block(free: deque, block_of: dict[str, int], hash_of: dict[int, str],
                   evictor: OrderedDict) -> int:
    """Take one block for new tokens. `free`: blocks holding nothing; `evictor`: the free-but-cached
    blocks (refcount 0, K/V still valid), least recently used first; `block_of` / `hash_of`: the
    cache's two maps (hash -> block, block -> hash). A free block is taken first; else the least
    recently used cached block is evicted. The caller will write OTHER tokens into the block it
    gets. RuntimeError when both are empty."""
    raise NotImplementedError(BUG_ZOO)
    if free:
        return free.popleft()
    if not evictor:
        raise RuntimeError("no free block and no cached block to evict: free a sequence first")
    block, _ = evictor.popitem(last=False)
    return block


def request_cache_key(model_id: str, template_version: str | None = None, tenant: str | None = None,
                      scope: str | None = None) -> tuple:
    """The extra keys of every block hash of a request (the engine's `cache_key`):
    (model_id, template_version, s) where s is "public" when scope == "public" or there is no
    tenant, else "tenant:<tenant>" (private: scope None or "private"). ValueError for scope
    "private" without a tenant, or a scope other than None, "private", "public"."""
    raise NotImplementedError(BUG_ZOO)
    if scope not in (None, "private", PUBLIC_SCOPE):
        raise ValueError(f"scope={scope!r} must be None, 'private' or 'public'")
    if scope == "private" and tenant is None:
        raise ValueError("scope='private' needs a tenant")
    if scope == PUBLIC_SCOPE or tenant is None:
        return (model_id, template_version, PUBLIC_SCOPE)
    return (model_id, template_version, "private")

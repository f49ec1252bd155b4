"""Chapter 06, reference answers: block hashes, the longest cached prefix, the tokens a hit saves,
and the bug zoo fixed (the last token recomputed, the hash dropped before a block is reused, the
tenant in the key)."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

from engine.kv.prefix_cache import PUBLIC_SCOPE, root_hash
from engine.kv.prefix_cache import block_hashes as engine_block_hashes


def block_hash(parent: str | None, token_ids: Sequence[int], extra_keys: Sequence) -> str:
    start = bytes.fromhex(parent if parent is not None else root_hash(extra_keys))
    return hashlib.sha256(start + struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Sequence, start: int = 0,
                 parent: str | None = None) -> list[str]:
    out = []
    for i in range(start, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        out.append(parent)
    return out


def find_cached_prefix(token_ids: Sequence[int], extra_keys: Sequence, max_tokens: int,
                       block_size: int, cached: Mapping[str, int]) -> list[int]:
    blocks = []
    for h in block_hashes(token_ids[:max_tokens], block_size, extra_keys):
        if h not in cached:
            break  # the chain is broken: later blocks attended to this missing one
        blocks.append(cached[h])
    return blocks


def cached_prefix_tokens(prompt_len: int, shared_len: int, block_size: int) -> int:
    if prompt_len < 1 or not 0 <= shared_len <= prompt_len or block_size < 1:
        raise ValueError("need 1 <= prompt_len, 0 <= shared_len <= prompt_len, block_size >= 1; "
                         f"got prompt_len={prompt_len}, shared_len={shared_len}, "
                         f"block_size={block_size}")
    return min(shared_len, prompt_len - 1) // block_size * block_size


def plan_prefill(token_ids: Sequence[int], block_size: int, extra_keys: Sequence,
                 cached: Mapping[str, int]) -> tuple[list[int], int]:
    blocks = []
    # never the last token
    for h in engine_block_hashes(token_ids[:len(token_ids) - 1], block_size, extra_keys):
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks, len(blocks) * block_size


def allocate_block(free: deque, block_of: dict[str, int], hash_of: dict[int, str],
                   evictor: OrderedDict) -> int:
    if free:
        return free.popleft()
    if not evictor:
        raise RuntimeError("no free block and no cached block to evict: free a sequence first")
    block, _ = evictor.popitem(last=False)
    del block_of[hash_of.pop(block)]  # nobody may find the old contents once new tokens go in
    return block


def request_cache_key(model_id: str, template_version: str | None = None, tenant: str | None = None,
                      scope: str | None = None) -> tuple:
    if scope not in (None, "private", PUBLIC_SCOPE):
        raise ValueError(f"scope={scope!r} must be None, 'private' or 'public'")
    if scope == "private" and tenant is None:
        raise ValueError("scope='private' needs a tenant")
    if scope == PUBLIC_SCOPE or tenant is None:
        return (model_id, template_version, PUBLIC_SCOPE)
    return (model_id, template_version, f"tenant:{tenant}")

"""Checks for chapter 06: block hashes, the longest cached prefix, the tokens a hit saves,
and the bug zoo.

Each `check_<claim>(mod)` runs against the student's `exercises/ch06_prefix_cache.py` or the
reference in `exercises/solutions/`. The answers come from small cases worked out by hand in the
comments, and from the engine itself: `engine.kv.prefix_cache` (block_hash, block_hashes, cache_key)
and a real `BlockManager` with prefix caching on (find_cached_prefix, and eviction through its
allocator).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import numpy as np
import torch

from engine.kv.block_manager import BlockManager
from engine.kv.prefix_cache import PUBLIC_SCOPE, block_hash, block_hashes, cache_key
from exercises.checks import raises

SEED = 6  # chapter 06: any fixed seed makes a failure reproducible
BS = 4
KEY = ("tinylab:0123456789abcdef", "v1", "tenant:acme")
TRIALS = 40  # random prompts in the comparisons with the engine


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def _cache_of(prompts: list[list[int]], key=KEY) -> dict[str, int]:
    """hash -> physical block, as the engine would hold it after computing these prompts
    (block ids made up)."""
    out: dict[str, int] = {}
    for ids in prompts:
        for h in block_hashes(ids, BS, key):
            out.setdefault(h, 100 + len(out))
    return out


# ---- part 1: hashes ------------------------------------------------------------------------------


def check_block_hash_matches_the_engine(mod) -> None:
    for parent, tokens, extra in ((None, [1, 2, 3, 4], KEY),
                                  ("ab" * 32, [7, 7, 7, 7], ("m", None, "public")),
                                  (None, [5], ())):
        got, want = mod.block_hash(parent, tokens, extra), block_hash(parent, tokens, extra)
        assert got == want, (
            f"block_hash({parent!r}, {tokens}, {extra}) = {got!r}, the engine's is {want!r}")
    # The same tokens with another parent, or other extra keys, must give another hash.
    assert mod.block_hash(None, [1, 2], KEY) != mod.block_hash("0" * 64, [1, 2], KEY)


def check_block_hash_takes_any_integer_ids(mod) -> None:
    """Token ids do not always arrive as Python ints: a tokenizer may hand over numpy int64s, the
    engine keeps torch tensors. The same ids must give the same hash, whatever holds them."""
    ids = [5, 17, 2, 900]
    want = mod.block_hash(None, ids, KEY)
    for what, same in (("a tuple", tuple(ids)), ("numpy int64s", np.array(ids, dtype=np.int64)),
                       ("a list of numpy ints", [np.int64(t) for t in ids]),
                       ("a torch tensor", torch.tensor(ids))):
        try:
            got = mod.block_hash(None, same, KEY)
        except Exception as err:  # noqa: BLE001 - say which input broke it, and how
            raise AssertionError(
                f"block_hash(None, {ids} as {what}, key) raised {type(err).__name__}: {err} "
                "(a numpy or torch integer is not a Python int: pack int(t), or let struct take "
                "any integer)") from err
        assert got == want, (
            f"block_hash(None, {ids} as {what}, key) = {got!r}, but {want!r} for the same ids as "
            "a list of ints: the hash must depend on the ids, not on what holds them")
    ids = _ids(10, SEED)
    assert mod.block_hashes(torch.tensor(ids), BS, KEY) == mod.block_hashes(ids, BS, KEY), (
        "block_hashes of 10 ids given as a torch tensor differ from the same ids as a list")


def check_block_hashes_chain_and_skip_the_partial_block(mod) -> None:
    ids = _ids(10, SEED)  # BS 4: blocks [0:4], [4:8] are full; [8:10] is partial and gets no hash
    got = mod.block_hashes(ids, BS, KEY)
    assert isinstance(got, list) and len(got) == 2, (
        f"10 tokens in blocks of 4 have 2 full blocks, got {got!r}")
    assert got == block_hashes(ids, BS, KEY), (
        "block_hashes differ from the engine's (is block 1 chained on h0?)")
    assert mod.block_hashes(ids[:3], BS, KEY) == [], "3 tokens make no full block of 4: no hash"
    for trial in range(TRIALS):
        ids = _ids(random.Random(trial).randint(1, 40), trial)
        assert mod.block_hashes(ids, BS, KEY) == block_hashes(ids, BS, KEY), (
            f"{len(ids)} tokens: differs")


def check_block_hashes_continue_from_a_parent(mod) -> None:
    ids = _ids(17, SEED + 1)
    full = block_hashes(ids, BS, KEY)
    got = mod.block_hashes(ids, BS, KEY, start=2, parent=full[1])
    assert got == full[2:], (
        "block_hashes(ids, BS, key, start=2, parent=h1) must give h2, h3 (the chain goes on)")


# ---- part 1: the lookup --------------------------------------------------------------------------


def check_find_cached_prefix_stops_at_the_first_miss(mod) -> None:
    ids = _ids(14, SEED + 2)  # 3 full blocks
    h = block_hashes(ids, BS, KEY)
    cached = {h[0]: 7, h[2]: 9}  # block 1 is missing: block 2, although cached, cannot be used
    got = mod.find_cached_prefix(ids, KEY, len(ids) - 1, BS, cached)
    assert got == [7], f"blocks 0 and 2 cached, block 1 not: expected [7], got {got!r}"
    cached[h[1]] = 8
    got = mod.find_cached_prefix(ids, KEY, len(ids) - 1, BS, cached)
    assert got == [7, 8, 9], f"all three cached: expected [7, 8, 9], got {got!r}"
    got = mod.find_cached_prefix(ids, ("another model", "v1", "tenant:acme"), len(ids) - 1, BS,
                                 cached)
    assert got == [], f"another key: nothing may be found, got {got!r}"


def check_find_cached_prefix_finds_physical_block_0(mod) -> None:
    # The pool's first block is block 0, and it is as good a block as any: not a miss.
    ids = _ids(10, SEED + 10)  # 2 full blocks
    h = block_hashes(ids, BS, KEY)
    got = mod.find_cached_prefix(ids, KEY, len(ids) - 1, BS, {h[0]: 0, h[1]: 5})
    assert got == [0, 5], (
        f"block 0 holds the prompt's first block and block 5 its second: expected [0, 5], got "
        f"{got!r} (is block 0 taken for a miss?)")


def check_find_cached_prefix_respects_max_tokens(mod) -> None:
    ids = _ids(12, SEED + 3)
    cached = _cache_of([ids])
    for max_tokens, blocks in ((12, 3), (11, 2), (8, 2), (7, 1), (3, 0)):
        got = mod.find_cached_prefix(ids, KEY, max_tokens, BS, cached)
        assert len(got) == blocks, (
            f"12 tokens all cached, max_tokens={max_tokens}: expected {blocks} blocks "
            f"(whole blocks within max_tokens), got {got!r}")


def check_find_cached_prefix_matches_the_engine(mod) -> None:
    """A real BlockManager computes a few prompts with shared beginnings; then every new prompt's
    lookup (capped at its length - 1, as the scheduler asks) must return the engine's blocks."""
    rng = random.Random(SEED)
    bm = BlockManager(200, BS, enable_prefix_caching=True)
    systems = [_ids(n, 50 + n) for n in (5, 9, 12)]
    for seq in range(TRIALS):
        ids = list(rng.choice(systems)) + _ids(rng.randint(0, 9), 1000 + seq)
        want = bm.find_cached_prefix(ids, KEY, len(ids) - 1)
        cached = bm.prefix_cache.entries()
        got = mod.find_cached_prefix(ids, KEY, len(ids) - 1, BS, cached)
        assert got == want, f"prompt {seq} ({len(ids)} tokens): got {got}, the engine finds {want}"
        bm.allocate(seq, len(ids), want)
        bm.cache_blocks(seq, ids, KEY, len(ids))
        bm.free(seq)


# ---- part 1: how much a hit saves ----------------------------------------------------------------


def check_cached_prefix_tokens_by_hand(mod) -> None:
    # Question 1: a 1000-token system prompt + a 50-token turn, BS 16:
    # 1000 // 16 = 62 blocks = 992 tokens.
    # A 1008-token system prompt is exactly 63 blocks: all 1008.
    # A 1024-token prompt that is ALL shared: the last token is fed again,
    # so 1023 -> 63 blocks = 1008 (the last block is recomputed).
    for args, want in (((1050, 1000, 16), 992), ((1058, 1008, 16), 1008), ((1024, 1024, 16), 1008),
                       ((10, 0, 4), 0), ((1, 1, 1), 0)):
        got = mod.cached_prefix_tokens(*args)
        assert got == want, f"cached_prefix_tokens{args} = {got!r}, expected {want}"
    for bad in ((0, 0, 16), (10, 11, 16), (10, -1, 16), (10, 5, 0)):
        assert raises(lambda b=bad: mod.cached_prefix_tokens(*b), ValueError), (
            f"cached_prefix_tokens{bad} must raise ValueError")


def check_cached_prefix_tokens_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 4)
    for trial in range(TRIALS):
        n = rng.randint(1, 30)
        shared = rng.randint(0, n)
        ids = _ids(n, trial)
        bm = BlockManager(40, BS, enable_prefix_caching=True)
        bm.allocate(0, shared)
        # an earlier request computed the first `shared` tokens
        bm.cache_blocks(0, ids[:shared], KEY, shared)
        want = len(bm.find_cached_prefix(ids, KEY, n - 1)) * BS
        got = mod.cached_prefix_tokens(n, shared, BS)
        assert got == want, (
            f"prompt {n}, shared {shared}, BS {BS}: got {got}, the engine finds {want}")


# ---- part 2: the bug zoo -------------------------------------------------------------------------


def check_plan_prefill_recomputes_the_last_token_of_a_fully_cached_prompt(mod) -> None:
    for n in (BS, 2 * BS, 3 * BS, 3 * BS + 1):
        ids = _ids(n, SEED + n)
        blocks, start = mod.plan_prefill(ids, BS, KEY, _cache_of([ids]))
        want = (n - 1) // BS * BS
        assert start == want and len(blocks) == want // BS, (
            f"a {n}-token prompt that is fully cached: got start {start} ({len(blocks)} blocks), "
            f"expected start {want}: the last token must be computed, or there are no logits "
            "to sample from")


def check_plan_prefill_shares_the_longest_cached_prefix(mod) -> None:
    system = _ids(9, SEED + 5)
    cached = _cache_of([system + [1, 2, 3]])
    blocks, start = mod.plan_prefill(system + [9, 9, 9, 9], BS, KEY, cached)
    want = [cached[h] for h in block_hashes(system, BS, KEY)]
    assert (blocks, start) == (want, 8), (
        f"9 shared tokens: expected ({want}, 8), got ({blocks}, {start})")
    assert mod.plan_prefill([5, 5], BS, KEY, cached) == ([], 0), "nothing cached: ([], 0)"
    ids = _ids(13, SEED + 9)
    h = block_hashes(ids, BS, KEY)
    # block 1 missing: block 2 is of no use
    got = mod.plan_prefill(ids, BS, KEY, {h[0]: 4, h[2]: 6})
    assert got == ([4], 4), f"blocks 0 and 2 cached, block 1 not: expected ([4], 4), got {got}"


def check_plan_prefill_shares_physical_block_0(mod) -> None:
    ids = _ids(10, SEED + 11)  # 2 full blocks + 2 tokens
    h = block_hashes(ids, BS, KEY)
    got = mod.plan_prefill(ids, BS, KEY, {h[0]: 0, h[1]: 3})
    assert got == ([0, 3], 8), (
        f"blocks 0 and 3 hold the prompt's two full blocks: expected ([0, 3], 8), got {got!r} "
        "(physical block 0 is a block like any other, not a miss)")


def _zoo_cache(blocks_and_prompts):
    """free list empty; each (block, hash) registered and parked in the evictor in the given order
    (LRU first)."""
    block_of, hash_of, evictor = {}, {}, OrderedDict()
    for block, h in blocks_and_prompts:
        block_of[h], hash_of[block] = block, h
        evictor[block] = None
    return deque(), block_of, hash_of, evictor


def check_allocate_block_drops_the_hash_before_reuse(mod) -> None:
    a, b = block_hashes(_ids(8, SEED + 6), BS, KEY)
    free, block_of, hash_of, evictor = _zoo_cache([(3, a), (5, b)])
    got = mod.allocate_block(free, block_of, hash_of, evictor)
    assert got == 3, f"the least recently used cached block is 3, got {got}"
    assert a not in block_of, (
        "block 3 will hold other tokens, but its old hash still leads to it: the next "
        "request with that prefix would read the wrong K/V (a stale hash)")
    assert 3 not in hash_of, "block 3 has no hash any more: remove it from hash_of too"
    assert block_of == {b: 5} and hash_of == {5: b} and list(evictor) == [5], (
        "block 5 must stay cached")


def check_allocate_block_takes_free_blocks_first_then_the_least_recently_used(mod) -> None:
    """The same story in a real BlockManager: free blocks first, then the evictor in LRU order."""
    hashes = block_hashes(_ids(12, SEED + 7), BS, KEY)
    free, block_of, hash_of, evictor = _zoo_cache([(4, hashes[0]), (1, hashes[1]), (6, hashes[2])])
    free.extend([0, 2])
    got = [mod.allocate_block(free, block_of, hash_of, evictor) for _ in range(5)]
    assert got == [0, 2, 4, 1, 6], (
        f"expected the free blocks 0, 2, then the cached 4, 1, 6 (LRU first), got {got}")
    assert block_of == {} and hash_of == {}, "every evicted block's hash must be gone"
    assert raises(lambda: mod.allocate_block(free, block_of, hash_of, evictor), RuntimeError), (
        "no free and no cached block: RuntimeError")
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    ids = _ids(8, SEED + 8)
    bm.allocate(0, 8)
    bm.cache_blocks(0, ids, KEY, 8)
    bm.free(0)  # both blocks cached; block 2 free
    engine_order = bm.allocate(1, 12)
    assert engine_order[0] == 2 and bm.find_cached_prefix(ids, KEY, 8) == [], "the engine agrees"


def check_request_cache_key_keeps_tenants_apart(mod) -> None:
    a = mod.request_cache_key("m", "v1", "acme")
    b = mod.request_cache_key("m", "v1", "globex")
    assert a != b, (
        f"two tenants' private keys are equal ({a}): tenant globex would hit acme's private "
        "blocks, and could time a guess of acme's prompt")
    assert a == mod.request_cache_key("m", "v1", "acme", "private"), (
        "scope None with a tenant is private")
    assert (mod.request_cache_key("m", "v1", "acme", "public")
            == mod.request_cache_key("m", "v1", "globex", "public"))


def check_request_cache_key_matches_the_engine(mod) -> None:
    for model_id in ("m:1", "m:2"):
        for template in (None, "v1", "v2"):
            for tenant in (None, "acme", "globex"):
                for scope in (None, "private", PUBLIC_SCOPE):
                    if scope == "private" and tenant is None:
                        assert raises(lambda m=model_id, t=template:
                                      mod.request_cache_key(m, t, None, "private"), ValueError), (
                            "scope='private' without a tenant must raise ValueError")
                        continue
                    got = mod.request_cache_key(model_id, template, tenant, scope)
                    want = cache_key(model_id, template, tenant, scope)
                    assert tuple(got) == want, (
                        f"request_cache_key({model_id!r}, {template!r}, {tenant!r}, "
                        f"{scope!r}) = {got}, the engine's key is {want}")
    assert raises(lambda: mod.request_cache_key("m", None, "acme", "shared"), ValueError), (
        "scope='shared' is not a scope: ValueError")

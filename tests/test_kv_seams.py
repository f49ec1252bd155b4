"""Chapter 06's seams in the KV bookkeeping: the eviction policy and the rollback of guessed tokens.

The evictor (engine/kv/evictor.py): LRU and FIFO pick different victims once a block is hit while
it waits, the block manager hands its policy to the device's and the host tier's prefix caches,
and LRU orders blocks exactly like the OrderedDict it replaced.

Rollback (BlockManager.rollback, for speculative decoding): it frees exactly the blocks it empties,
keeps a shared block for its other holder, leaves no hash naming tokens it took back, and is all
or nothing. The stateful test writes a stand-in for each slot's K/V (the tokens up to and
including that position, which is what K/V depends on) and checks after every step that each
sequence reads its own K/V and that every hash leads to a block holding the tokens it names.
"""

from collections import Counter, OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import EVICTION_POLICIES
from engine.kv.block_manager import BlockManager, HostBlock, NoFreeBlocksError
from engine.kv.evictor import FIFOEvictor, LRUEvictor, make_evictor
from engine.kv.prefix_cache import PrefixCache, block_hashes

KEY = ("m:1", None, "public")
MAX_BLOCKS = 10  # small pools, so that eviction and running out happen often
MAX_NEW_TOKENS = 7
MAX_GUESSES = 4  # tokens a speculative step guesses
MAX_LIVE = 3  # sequences at once: few, so that the same ones share, roll back and leave


def snapshot(bm: BlockManager):
    """Everything a failed call must leave as it was."""
    tables = {s: (bm.block_table(s), bm.num_tokens(s)) for s in bm.seq_ids()}
    refcounts = [bm.allocator.refcount(b) for b in range(bm.allocator.num_blocks)]
    cache = bm.prefix_cache.entries() if bm.prefix_cache else {}
    return tables, refcounts, bm.allocator.num_free, bm.cached_block_ids(), cache, bm.usage()


def manager(num_blocks: int, policy: str = "lru", block_size: int = 2, **options) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=True, eviction_policy=policy,
                        **options)


def cached_sequence(bm: BlockManager, seq_id: int, ids: list[int]) -> list[int]:
    """What the engine does for one prompt: find its cached prefix, allocate, run (its full blocks
    get their hashes), finish. Returns its block table."""
    hit = bm.find_cached_prefix(ids, KEY, len(ids) - 1)
    table = bm.allocate(seq_id, len(ids), hit)
    bm.cache_blocks(seq_id, ids, KEY, len(ids))
    bm.free(seq_id)
    return table


# ---- the evictor ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, order, victim", [("lru", [2, 1], 2), ("fifo", [1, 2], 1)])
def test_a_hit_moves_a_block_to_the_back_under_lru_and_not_under_fifo(policy, order, victim):
    evictor = make_evictor(policy)
    evictor.add(1)
    evictor.add(2)
    evictor.remove(1)  # a hit revives block 1 ...
    assert 1 not in evictor and len(evictor) == 1
    evictor.add(1)  # ... and its holder lets go again
    assert evictor.blocks() == order
    assert evictor.pop() == victim and len(evictor) == 1


@pytest.mark.parametrize("policy, victim", [("lru", "second"), ("fifo", "first")])
def test_fifo_evicts_the_block_cached_first_even_after_a_hit(policy, victim):
    """Two one-block prompts are cached, the first is hit again; then a new prompt needs a block
    and the free list is empty. LRU gives up the second prompt's block (used longer ago), FIFO
    the first one's (cached first)."""
    bm = manager(3, policy)
    blocks = {"first": cached_sequence(bm, 0, [5, 6])[0],
              "second": cached_sequence(bm, 1, [7, 8])[0]}
    assert cached_sequence(bm, 2, [5, 6, 1])[0] == blocks["first"]  # a hit (one new block for "1")
    assert bm.allocator.num_free == 1
    bm.allocate(3, 4)  # two blocks: the free one and one evicted
    assert blocks[victim] in bm.block_table(3)
    survivor = "first" if victim == "second" else "second"
    prompts = {"first": [5, 6, 0], "second": [7, 8, 0]}
    assert bm.find_cached_prefix(prompts[victim], KEY, 2) == []  # its hash went with it
    assert bm.find_cached_prefix(prompts[survivor], KEY, 2) == [blocks[survivor]]


def test_fifo_forgets_a_blocks_place_once_its_hash_is_gone():
    evictor = FIFOEvictor()
    evictor.add(1)
    evictor.add(2)
    assert evictor.pop() == 1  # evicted: hash gone
    evictor.add(1)  # cached again, under a new hash: the back of the queue
    assert evictor.blocks() == [2, 1]
    evictor.remove(2)  # revived ...
    evictor.forget(2)  # ... and its hash dropped while it was held (a rollback)
    evictor.add(2)
    assert evictor.blocks() == [1, 2]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_block_that_lost_its_hash_in_a_rollback_queues_at_the_back_when_cached_again(policy):
    """Block a is cached first, b second; a request hits a, rolls back into it (its hash goes),
    writes other tokens there and leaves: under either policy a is now the newest in the queue."""
    bm = manager(4, policy)
    a, b = cached_sequence(bm, 0, [1, 2])[0], cached_sequence(bm, 1, [3, 4])[0]
    bm.allocate(2, 4, bm.find_cached_prefix([1, 2, 5, 6], KEY, 3))
    bm.cache_blocks(2, [1, 2, 5, 6], KEY, 4)
    bm.rollback(2, 3)  # 1 token left, in block a
    bm.append_slots(2, 1)
    bm.cache_blocks(2, [1, 7], KEY, 2)
    bm.free(2)
    assert bm.cached_block_ids() == [b, a]
    assert bm.find_cached_prefix([1, 7, 0], KEY, 2) == [a]
    assert bm.find_cached_prefix([1, 2, 0], KEY, 2) == []


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_reset_prefix_cache_forgets_every_blocks_place_in_the_queue(policy):
    bm = manager(2, policy)
    first, second = cached_sequence(bm, 0, [1, 2])[0], cached_sequence(bm, 1, [3, 4])[0]
    assert bm.cached_block_ids() == [first, second] and bm.reset_prefix_cache()
    assert cached_sequence(bm, 2, [5, 6, 7, 8]) == [first, second]  # freed tail first
    assert bm.cached_block_ids() == [second, first]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_an_evictor_refuses_to_pop_when_empty_and_to_hold_a_block_twice(policy):
    evictor = make_evictor(policy)
    with pytest.raises(LookupError, match="evictor is empty"):
        evictor.pop()
    evictor.add(3)
    with pytest.raises(ValueError, match="already in the evictor"):
        evictor.add(3)
    with pytest.raises(ValueError, match="not in the evictor"):
        evictor.remove(4)
    assert evictor.blocks() == [3]


def test_an_unknown_eviction_policy_is_rejected_naming_the_allowed_values():
    with pytest.raises(ValueError, match=r"eviction_policy must be one of \('lru', 'fifo'\)"):
        make_evictor("mru")
    with pytest.raises(ValueError, match="eviction_policy"):  # checked even with the cache off
        BlockManager(num_blocks=4, block_size=2, eviction_policy="LRU")


def test_every_configured_policy_has_its_class():
    kinds = {policy: type(make_evictor(policy)) for policy in EVICTION_POLICIES}
    assert kinds == {"lru": LRUEvictor, "fifo": FIFOEvictor}
    assert make_evictor("fifo") is not make_evictor("fifo")  # a fresh one each time


def test_a_prefix_cache_takes_only_a_fresh_evictor_and_defaults_to_lru():
    assert isinstance(PrefixCache().evictor, LRUEvictor)
    used = FIFOEvictor()
    used.add(0)
    with pytest.raises(ValueError, match="new and empty"):
        PrefixCache(used)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_the_block_manager_gives_its_policy_to_the_device_and_the_host_cache(policy):
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True, num_host_blocks=2,
                      eviction_policy=policy)
    assert type(bm.prefix_cache.evictor) is type(make_evictor(policy))
    assert type(bm.host_cache.evictor) is type(make_evictor(policy))
    assert bm.prefix_cache.evictor is not bm.host_cache.evictor


@pytest.mark.parametrize("policy, order", [("lru", ["d4", "d5", "d3"]),
                                           ("fifo", ["d3", "d4", "d5"])])
def test_a_host_hit_refreshes_its_block_under_lru_and_not_under_fifo(policy, order):
    """The device holds 2 blocks, the host 3. Three one-full-block documents in turn leave d3 and
    d4 on the host and d5 cached on the device; then d3 hits on the host (a reload), which evicts
    d5 to the host. The host's queue, victim first, shows whether the reload refreshed d3."""
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True, num_host_blocks=3,
                      eviction_policy=policy)
    docs = {f"d{d}": [d] * 5 for d in (3, 4, 5)}
    for i, doc in enumerate(docs.values()):
        cached_sequence(bm, i, doc)
    assert isinstance(bm.find_cached_prefix(docs["d3"], KEY, 4)[0], HostBlock)
    cached_sequence(bm, 3, docs["d3"])
    name_of = {block_hashes(doc, 4, KEY)[0]: name for name, doc in docs.items()}
    assert [name_of[bm.host_cache.hash_of(b)] for b in bm.host_cache.evictable()] == order


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "pop"]), st.integers(0, 5)),
                max_size=40))
def test_lru_evictor_orders_blocks_exactly_like_the_ordered_dict_it_replaced(ops):
    """The PrefixCache's evictor used to be an OrderedDict: park appended, unpark deleted, evict
    popped the oldest. LRUEvictor must agree with it after every call."""
    evictor, old = LRUEvictor(), OrderedDict()
    for op, block in ops:
        if op == "add" and block not in old:
            evictor.add(block)
            old[block] = None
        elif op == "remove" and block in old:
            evictor.remove(block)
            del old[block]
        elif op == "pop" and old:
            assert evictor.pop() == old.popitem(last=False)[0]
        assert evictor.blocks() == list(old) and len(evictor) == len(old)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "pop", "forget"]), st.integers(0, 5)),
                max_size=40))
def test_fifo_evictor_orders_blocks_by_their_first_add_under_the_current_hash(ops):
    evictor, first_add, waiting, clock = FIFOEvictor(), {}, set(), 0
    for op, block in ops:
        if op == "add" and block not in waiting:
            first_add.setdefault(block, clock)
            clock += 1
            evictor.add(block)
            waiting.add(block)
        elif op == "remove" and block in waiting:
            evictor.remove(block)
            waiting.discard(block)
        elif op == "pop" and waiting:
            victim = min(waiting, key=first_add.get)
            assert evictor.pop() == victim
            waiting.discard(victim)
            del first_add[victim]
        elif op == "forget":
            evictor.forget(block)
            waiting.discard(block)
            first_add.pop(block, None)
        assert evictor.blocks() == sorted(waiting, key=first_add.get)
        assert all((b in evictor) == (b in waiting) for b in range(6))


# ---- rollback ------------------------------------------------------------------------------------


def test_rollback_frees_exactly_the_blocks_it_leaves_without_a_token():
    bm = BlockManager(num_blocks=6, block_size=4)
    table = bm.allocate(0, 10)  # 3 blocks: 4 + 4 + 2 tokens
    assert bm.rollback(0, 0) == [] and bm.block_table(0) == table
    assert bm.rollback(0, 5) == [table[2]]  # 5 tokens stay: block 1 holds one of them
    assert bm.block_table(0) == table[:2] and bm.num_tokens(0) == 5
    assert bm.allocator.refcount(table[2]) == 0 and bm.allocator.num_free == 4
    assert bm.rollback(0, 5) == table[:2]  # to 0 tokens: every block, in table order
    assert bm.block_table(0) == [] and bm.allocator.num_free == 6


def test_appending_after_a_rollback_refills_the_partly_filled_last_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    table = bm.allocate(0, 10)
    bm.rollback(0, 5)
    again = bm.append_slots(0, 3)  # positions 5, 6, 7: the rest of block 1, no new block
    assert again.slots == [table[1] * 4 + off for off in (1, 2, 3)] and not again.copies
    assert bm.block_table(0) == table[:2]
    assert len(bm.block_table(0) + bm.append_slots(0, 1).slots) == 3  # position 8: a new block


def test_rollback_keeps_a_shared_block_alive_for_its_other_holder():
    bm = BlockManager(num_blocks=6, block_size=4)
    table = bm.allocate(0, 8)
    bm.fork(0, 1)
    assert bm.rollback(1, 5) == []  # block 1 leaves 1's table but 0 still holds it
    assert bm.block_table(1) == table[:1] and bm.block_table(0) == table
    assert [bm.allocator.refcount(b) for b in table] == [2, 1]
    bm.rollback(1, 1)  # 2 tokens: block 0 is partial for 1 and full for 0
    cow = bm.append_slots(1, 1)  # the write must not land in 0's block: copy-on-write
    assert cow.copies == [(table[0], bm.block_table(1)[0])] and bm.block_table(1)[0] != table[0]
    assert bm.block_table(0) == table


def test_rollback_drops_the_hashes_of_the_blocks_whose_tokens_it_took_back():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    ids = list(range(12))
    table = bm.allocate(0, 12)
    bm.cache_blocks(0, ids, KEY, 12)
    assert bm.find_cached_prefix(ids + [0], KEY, 12) == table
    assert bm.rollback(0, 6) == [table[2]]  # 6 tokens stay: block 0 full, block 1 partial
    assert bm.prefix_cache.hash_of(table[1]) is None and bm.prefix_cache.hash_of(table[2]) is None
    assert bm.find_cached_prefix(ids + [0], KEY, 12) == table[:1]
    assert bm.cached_block_ids() == [] and bm.allocator.num_free == 4  # block 2 is simply free
    bm.free(0)
    assert bm.cached_block_ids() == table[:1]


def test_a_shared_block_keeps_its_hash_for_the_holder_that_still_has_its_tokens():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    ids = list(range(8))
    table = bm.allocate(0, 8)
    bm.cache_blocks(0, ids, KEY, 8)
    hit = bm.find_cached_prefix(ids + [9], KEY, 8)
    bm.allocate(1, 9, hit)  # shares both blocks, one new block for token 9
    bm.rollback(1, 5)  # 4 tokens: block 1 leaves 1's table, 0 still holds it full
    assert bm.find_cached_prefix(ids + [9], KEY, 8) == table


def test_a_partial_block_kept_for_another_holder_loses_its_hash_before_we_write_into_it():
    """1 rolls back into block 1, which 0 holds full: the hash stays (true for 0). When 0 leaves,
    1 holds block 1 alone, still hashed; its next write drops the hash first (no copy needed)."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    ids = list(range(8))
    table = bm.allocate(0, 8)
    bm.cache_blocks(0, ids, KEY, 8)
    bm.fork(0, 1)
    bm.rollback(1, 2)  # 6 tokens: block 1 is partial for 1
    bm.free(0)
    assert bm.find_cached_prefix(ids + [9], KEY, 8) == table  # its K/V is still intact
    assert not bm.append_slots(1, 1).copies  # ours alone: written in place ...
    assert bm.find_cached_prefix(ids + [9], KEY, 8) == table[:1]  # ... after its hash went


@pytest.mark.parametrize("seq_id, num_tokens, match", [
    (7, 1, "unknown seq_id 7"),
    (0, -1, "num_tokens must be an integer in 0..10"),
    (0, 11, "num_tokens must be an integer in 0..10"),
    (0, 1.0, "num_tokens must be an integer"),
    (0, True, "num_tokens must be an integer"),
])
def test_rollback_errors_name_the_argument_and_change_nothing(seq_id, num_tokens, match):
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    bm.allocate(0, 10)
    bm.cache_blocks(0, list(range(10)), KEY, 10)
    before = snapshot(bm)
    with pytest.raises(ValueError, match=match):
        bm.rollback(seq_id, num_tokens)
    assert snapshot(bm) == before


def test_a_swapped_out_sequence_cannot_be_rolled_back():
    bm = BlockManager(num_blocks=6, block_size=4, num_swap_blocks=4)
    bm.allocate(0, 6)
    bm.swap_out(0)
    with pytest.raises(ValueError, match="seq_id 0 is swapped out: swap_in first"):
        bm.rollback(0, 1)
    assert bm.is_swapped(0) and bm.swap_table(0) == [0, 1]


def test_rollback_refuses_to_go_back_past_a_block_the_sliding_window_freed():
    bm = BlockManager(num_blocks=6, block_size=4, sliding_window=6)
    bm.allocate(0, 14)
    freed = bm.free_out_of_window(0, next_query_position=14)  # reads 9..14: blocks 0, 1 go
    assert len(freed) == 2
    before = snapshot(bm)
    for num_tokens in (3, 2):  # the next query, at 11 or 12, reads position 7 (in freed block 1)
        with pytest.raises(ValueError, match="num_tokens=.* the sliding window already freed"):
            bm.rollback(0, num_tokens)
        assert snapshot(bm) == before
    assert bm.rollback(0, 1) == []  # a query at 13 reads 8..13: blocks 2 and 3, both held
    assert bm.num_tokens(0) == 13


# ---- the property test ---------------------------------------------------------------------------


class RollbackMachine(RuleBasedStateMachine):
    """Sequences over a two-token alphabet (so prefixes repeat and hit) with allocate / append /
    fork / rollback / speculate (append, then roll some back) / free, under either eviction
    policy. The fake pool maps a slot to the tokens 0..p of whoever wrote position p there: K/V's
    stand-in."""

    @initialize(num_blocks=st.integers(2, MAX_BLOCKS), block_size=st.sampled_from([1, 2, 3, 4]),
                policy=st.sampled_from(EVICTION_POLICIES))
    def setup(self, num_blocks, block_size, policy):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True,
                               eviction_policy=policy)
        self.pool: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[int, list[int]] = {}  # seq -> its tokens
        self.next_seq = 0

    def _write(self, seq_id, start):
        ids = self.tokens[seq_id]
        positions = range(start, len(ids))
        for pos, slot in zip(positions, self.bm.slot_mapping(seq_id, positions), strict=True):
            self.pool[slot] = tuple(ids[:pos + 1])
        self.bm.cache_blocks(seq_id, ids, KEY, len(ids))  # the forward ran

    def _live(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)))

    @precondition(lambda self: len(self.tokens) < MAX_LIVE)
    @rule(ids=st.lists(st.integers(0, 1), min_size=1, max_size=2 * MAX_NEW_TOKENS))
    def new_sequence(self, ids):
        bs, bm = self.bm.block_size, self.bm
        hit = bm.find_cached_prefix(ids, KEY, len(ids) - 1)
        before, seq_id = snapshot(bm), self.next_seq
        try:
            bm.allocate(seq_id, len(ids), hit)
        except NoFreeBlocksError:
            assert snapshot(bm) == before
            return
        self.next_seq += 1
        self.tokens[seq_id] = list(ids)
        for pos, slot in enumerate(bm.slot_mapping(seq_id, range(len(hit) * bs))):
            assert self.pool[slot] == tuple(ids[:pos + 1]), "a hit read K/V of other tokens"
        self._write(seq_id, len(hit) * bs)

    def _append(self, seq_id, new) -> bool:
        """append_slots, copy-on-write, write; False (nothing changed) when there is no room."""
        bs, before = self.bm.block_size, snapshot(self.bm)
        try:
            result = self.bm.append_slots(seq_id, len(new))
        except NoFreeBlocksError:
            assert snapshot(self.bm) == before
            return False
        for src, dst in result.copies:  # copy-on-write, before writing
            for off in range(bs):
                if src * bs + off in self.pool:
                    self.pool[dst * bs + off] = self.pool[src * bs + off]
        start = len(self.tokens[seq_id])
        self.tokens[seq_id] += new
        self._write(seq_id, start)
        return True

    def _rollback(self, seq_id, n):
        """rollback, checking which blocks it frees and which hashes it drops."""
        old_table, bs, alloc = self.bm.block_table(seq_id), self.bm.block_size, self.bm.allocator
        cache, keep = self.bm.prefix_cache, len(self.tokens[seq_id]) - n
        touched = old_table[keep // bs:]  # from the block of the first rolled-back position on
        shared = {b: cache.hash_of(b) for b in touched if alloc.refcount(b) > 1}
        before = snapshot(self.bm)
        with pytest.raises(ValueError, match="num_tokens"):  # one too many: refused, no change
            self.bm.rollback(seq_id, len(self.tokens[seq_id]) + 1)
        assert snapshot(self.bm) == before
        freed = self.bm.rollback(seq_id, n)
        assert all(cache.hash_of(b) is None for b in touched if b not in shared)  # ours: hash gone
        assert {b: cache.hash_of(b) for b in shared} == shared  # shared: true for its other holder
        del self.tokens[seq_id][keep:]
        kept_blocks = -(-keep // bs)
        assert self.bm.block_table(seq_id) == old_table[:kept_blocks]
        assert freed == [b for b in old_table[kept_blocks:] if alloc.refcount(b) == 0]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=MAX_NEW_TOKENS))
    def append(self, data, new):
        self._append(self._live(data), new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rollback(self, data):
        seq_id, bs = self._live(data), self.bm.block_size
        length = len(self.tokens[seq_id])  # mostly into the last blocks, sometimes anywhere
        n = data.draw(st.one_of(st.integers(0, min(length, 2 * bs)), st.integers(0, length)))
        self._rollback(seq_id, n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), guesses=st.lists(st.integers(0, 1), min_size=1, max_size=MAX_GUESSES))
    def speculate(self, data, guesses):
        """A speculative step: write K/V for a few guessed tokens, then take back the rejected."""
        seq_id = self._live(data)
        if self._append(seq_id, guesses):
            self._rollback(seq_id, data.draw(st.integers(0, len(guesses))))

    @precondition(lambda self: 0 < len(self.tokens) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._live(data)
        self.bm.fork(parent, self.next_seq)
        self.tokens[self.next_seq] = list(self.tokens[parent])
        self.next_seq += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = self._live(data)
        self.bm.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: len(self.tokens) > 1)
    @rule(data=st.data())
    def all_but_one_finish(self, data):  # e.g. forked samples: one left holds shared blocks alone
        keep = self._live(data)
        for seq_id in [s for s in self.tokens if s != keep]:
            self.bm.free(seq_id)
            del self.tokens[seq_id]

    @invariant()
    def no_block_leaks_or_is_in_two_states(self):
        if not hasattr(self, "bm"):
            return
        alloc, cache = self.bm.allocator, self.bm.prefix_cache
        holders = Counter(b for s in self.bm.seq_ids() for b in self.bm.block_table(s))
        assert [alloc.refcount(b) for b in range(alloc.num_blocks)] == \
            [holders[b] for b in range(alloc.num_blocks)]
        cached, free = self.bm.cached_block_ids(), list(alloc._free)
        assert len(set(free)) == len(free) and len(set(cached)) == len(cached)
        assert not set(cached) & set(holders) and not set(free) & (set(cached) | set(holders))
        assert len(free) + len(cached) + len(holders) == alloc.num_blocks
        assert all(cache.hash_of(b) is not None for b in cached)  # an evictable block is findable
        assert not any(cache.hash_of(b) for b in free)

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        if not hasattr(self, "bm"):
            return
        for s, ids in self.tokens.items():
            assert self.bm.num_tokens(s) == len(ids)
            slots = self.bm.slot_mapping(s, range(len(ids)))
            assert [self.pool[x] for x in slots] == [tuple(ids[:p + 1]) for p in range(len(ids))]

    @invariant()
    def every_hash_leads_to_a_block_holding_the_tokens_it_names(self):
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for h, block in self.bm.prefix_cache.entries().items():
            last = self.pool.get(block * bs + bs - 1)
            assert last is not None and len(last) % bs == 0, "a hash on a block never filled"
            assert block_hashes(last, bs, KEY)[-1] == h, "a stale hash: the block holds other K/V"
            assert [self.pool.get(block * bs + off) for off in range(bs)] == \
                [last[:len(last) - bs + off + 1] for off in range(bs)]

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for s in list(self.tokens):
            self.bm.free(s)
        assert self.bm.allocator.num_used == 0 and self.bm.reset_prefix_cache()
        assert self.bm.allocator.num_free == self.bm.allocator.num_blocks


RollbackMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                             deadline=None)
test_rollback_never_leaks_a_block_frees_one_twice_or_leaves_a_stale_hash = RollbackMachine.TestCase

"""Chapter 04: the block manager's bookkeeping, by property tests and by hand-worked cases.

The stateful test drives a ``BlockManager`` with random interleavings of allocate / append /
fork / write / swap out / swap in / free against fake KV pools (dicts slot -> token value, one
for the device and one for the CPU swap pool, copied block by block as the manager's pairs say).
After every step it checks the invariants, and that every sequence still reads back exactly the
tokens it wrote: the last check fails if copy-on-write were missing, a slot were handed out
twice, or a swap pair pointed at the wrong block.
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv.block_manager import AppendResult, BlockAllocator, BlockManager, NoFreeBlocksError, SwapUsage
from engine.kv.prefix_cache import block_hashes

# Small pools so that running out of blocks (the all-or-nothing path) happens often.
MAX_BLOCKS = 12
MAX_TOKENS_PER_CALL = 9


def snapshot(bm: BlockManager):
    tables = {s: (bm.block_table(s), bm.num_tokens(s)) for s in bm.seq_ids()}
    refcounts = [bm.allocator.refcount(b) for b in range(bm.allocator.num_blocks)]
    swap = bm.swap_allocator
    swap_refcounts = [swap.refcount(b) for b in range(swap.num_blocks)] if swap else []
    swap_tables = {s: bm.swap_table(s) for s in bm.swapped_seq_ids()}
    return tables, refcounts, bm.allocator.num_free, bm.usage(), swap_tables, swap_refcounts, bm.swap_usage()


def copy_blocks(src_pool: dict, dst_pool: dict, pairs, block_size: int) -> None:
    """What the KV pool does for each (src block, dst block) pair, on the fake dict pools."""
    for src, dst in pairs:
        for off in range(block_size):
            if src * block_size + off in src_pool:
                dst_pool[dst * block_size + off] = src_pool[src * block_size + off]


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, MAX_BLOCKS), block_size=st.sampled_from([1, 2, 3, 4]),
                num_swap_blocks=st.integers(0, MAX_BLOCKS))
    def setup(self, num_blocks, block_size, num_swap_blocks):
        self.bm = BlockManager(num_blocks, block_size, num_swap_blocks)
        self.pool: dict[int, int] = {}  # slot -> token value: a stand-in for the KV pools
        self.cpu_pool: dict[int, int] = {}  # the same for the CPU swap pools
        self.content: dict[int, list[int]] = {}  # seq -> the values it wrote, in order
        self.next_seq = 0
        self.next_value = 0

    def _write(self, seq_id, result):
        copy_blocks(self.pool, self.pool, result.copies, self.bm.block_size)  # copy before writing
        for slot in result.slots:
            self.pool[slot] = self.next_value
            self.content[seq_id].append(self.next_value)
            self.next_value += 1

    def _on_device(self):
        return sorted(s for s in self.content if s in self.bm)

    def _live(self, data):  # a sequence on the device: the only kind that can grow or fork
        return data.draw(st.sampled_from(self._on_device()))

    @rule(n=st.integers(0, 2 * MAX_TOKENS_PER_CALL))
    def allocate(self, n):
        before = snapshot(self.bm)
        seq_id, self.next_seq = self.next_seq, self.next_seq + 1
        self.bm.allocate(seq_id, 0)  # register (0 tokens need no block), then append the prompt
        self.content[seq_id] = []
        try:
            self._write(seq_id, self.bm.append_slots(seq_id, n))
        except NoFreeBlocksError:
            self.bm.free(seq_id)
            del self.content[seq_id]
            assert snapshot(self.bm) == before

    @rule(n=st.integers(0, 2 * MAX_TOKENS_PER_CALL))
    def allocate_in_one_call(self, n):
        before = snapshot(self.bm)
        can = self.bm.can_allocate(n)
        seq_id, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self.bm.allocate(seq_id, n)
        except NoFreeBlocksError as err:
            assert not can and err.needed > err.free
            assert snapshot(self.bm) == before
            return
        assert can
        self.content[seq_id] = []
        self._write(seq_id, AppendResult(slots=self.bm.slot_mapping(seq_id, range(n))))

    @precondition(lambda self: self._on_device())
    @rule(data=st.data(), n=st.integers(0, MAX_TOKENS_PER_CALL))
    def append(self, data, n):
        seq_id = self._live(data)
        before = snapshot(self.bm)
        can = self.bm.can_append_slots(seq_id, n)
        try:
            result = self.bm.append_slots(seq_id, n)
        except NoFreeBlocksError:
            assert not can
            assert snapshot(self.bm) == before
            return
        assert can
        self._write(seq_id, result)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def write_one_token(self, data):  # a decode step
        self.append(data, 1)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def fork(self, data):
        parent = self._live(data)
        child, self.next_seq = self.next_seq, self.next_seq + 1
        self.bm.fork(parent, child)
        self.content[child] = list(self.content[parent])

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def free(self, data):  # on the device or swapped out
        seq_id = data.draw(st.sampled_from(sorted(self.content)))
        self.bm.free(seq_id)
        del self.content[seq_id]
        with pytest.raises(ValueError, match="unknown sequence"):
            self.bm.free(seq_id)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = self._live(data)
        before = snapshot(self.bm)
        can = self.bm.can_swap_out(seq_id)
        try:
            pairs = self.bm.swap_out(seq_id)
        except NoFreeBlocksError:
            assert not can
            assert snapshot(self.bm) == before
            return
        assert can and self.bm.is_swapped(seq_id) and seq_id not in self.bm
        assert [gpu for gpu, _ in pairs] == before[0][seq_id][0]  # every block of its table, in order
        assert [cpu for _, cpu in pairs] == self.bm.swap_table(seq_id)
        copy_blocks(self.pool, self.cpu_pool, pairs, self.bm.block_size)

    @precondition(lambda self: self.bm.swapped_seq_ids())
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.bm.swapped_seq_ids())))
        before = snapshot(self.bm)
        can = self.bm.can_swap_in(seq_id)
        try:
            pairs = self.bm.swap_in(seq_id)
        except NoFreeBlocksError:
            assert not can
            assert snapshot(self.bm) == before
            return
        assert can and seq_id in self.bm and not self.bm.is_swapped(seq_id)
        assert [cpu for cpu, _ in pairs] == before[4][seq_id]
        assert [gpu for _, gpu in pairs] == self.bm.block_table(seq_id)
        copy_blocks(self.cpu_pool, self.pool, pairs, self.bm.block_size)

    @invariant()
    def free_plus_used_is_total(self):
        alloc = self.bm.allocator
        assert alloc.num_free + alloc.num_used == alloc.num_blocks

    @invariant()
    def refcount_equals_number_of_tables_holding_the_block(self):
        holders = Counter(b for s in self.bm.seq_ids() for b in self.bm.block_table(s))
        for block in range(self.bm.allocator.num_blocks):
            assert self.bm.allocator.refcount(block) == holders.get(block, 0)
        assert self.bm.allocator.num_used == len(holders)  # no leak: every used block has an owner

    @invariant()
    def tables_are_exactly_as_long_as_needed(self):
        for s in self.bm.seq_ids():
            table = self.bm.block_table(s)
            assert len(set(table)) == len(table)
            assert len(table) == -(-self.bm.num_tokens(s) // self.bm.block_size)

    @invariant()
    def every_sequence_reads_back_what_it_wrote(self):
        bs = self.bm.block_size
        for s, values in self.content.items():
            if self.bm.is_swapped(s):  # read through its CPU table
                table = self.bm.swap_table(s)
                assert [self.cpu_pool[table[p // bs] * bs + p % bs] for p in range(len(values))] == values
                continue
            slots = self.bm.slot_mapping(s, range(self.bm.num_tokens(s)))
            assert len(set(slots)) == len(slots)
            assert [self.pool[x] for x in slots] == values

    @invariant()
    def each_swapped_sequence_holds_its_own_cpu_blocks(self):
        bm, swapped = self.bm, self.bm.swapped_seq_ids()
        assert set(swapped) | set(bm.seq_ids()) == set(self.content)
        assert not set(swapped) & set(bm.seq_ids())  # in exactly one place
        held = [b for s in swapped for b in bm.swap_table(s)]
        assert len(set(held)) == len(held)  # no CPU block shared or handed out twice
        for s in swapped:
            assert len(bm.swap_table(s)) == -(-len(self.content[s]) // bm.block_size)
        u = bm.swap_usage()
        assert u.used_blocks == len(held) and u.used_blocks + u.free_blocks == u.total_blocks
        for b in range(u.total_blocks):
            assert bm.swap_allocator.refcount(b) == (b in held)

    @invariant()
    def slots_are_shared_only_inside_forked_unwritten_blocks(self):
        bs = self.bm.block_size
        owner: dict[int, tuple[int, int]] = {}  # slot -> (seq, tokens of that seq in the block)
        for s in self.bm.seq_ids():
            n = self.bm.num_tokens(s)
            for pos, slot in enumerate(self.bm.slot_mapping(s, range(n))):
                fill = min(bs, n - pos // bs * bs)
                if slot in owner:
                    other, other_fill = owner[slot]
                    assert self.bm.allocator.refcount(slot // bs) >= 2
                    assert fill == other_fill, "a shared block was written by one of its holders"
                owner[slot] = (s, fill)

    @invariant()
    def usage_counts_distinct_filled_slots(self):
        u = self.bm.usage()
        bm = self.bm
        distinct = {x for s in bm.seq_ids() for x in bm.slot_mapping(s, range(bm.num_tokens(s)))}
        assert u.used_blocks == self.bm.allocator.num_used
        assert u.free_blocks == self.bm.allocator.num_free
        assert u.reserved_slots == u.used_blocks * self.bm.block_size
        assert u.used_slots == len(distinct)
        assert u.wasted_slots == u.reserved_slots - len(distinct)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for s in self.bm.seq_ids() + self.bm.swapped_seq_ids():
            self.bm.free(s)
        assert self.bm.allocator.num_free == self.bm.allocator.num_blocks  # nothing leaked
        assert self.bm.swap_usage().used_blocks == 0


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)
test_block_manager_invariants_hold_under_random_interleavings = BlockManagerMachine.TestCase


# ---- hand-worked cases -------------------------------------------------------------------------


def test_append_across_a_block_boundary_takes_one_new_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 3)
    assert len(bm.block_table(0)) == 1
    result = bm.append_slots(0, 3)  # positions 3, 4, 5: the last slot of block 0, two of block 1
    t = bm.block_table(0)
    assert len(t) == 2 and t[0] != t[1]
    assert result.slots == [t[0] * 4 + 3, t[1] * 4 + 0, t[1] * 4 + 1]
    assert result.copies == []
    assert bm.num_tokens(0) == 6
    assert bm.slot_mapping(0, [0, 5]) == [t[0] * 4, t[1] * 4 + 1]


def test_append_that_fits_in_the_last_block_takes_no_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate(0, 1)
    free_before = bm.allocator.num_free
    assert len(bm.append_slots(0, 3).slots) == 3
    assert bm.allocator.num_free == free_before


def test_copy_on_write_is_reported_exactly_once_for_the_writer():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, 5)  # blocks [a, b]; b holds 1 token
    bm.fork(0, 1)
    a, b = bm.block_table(0)
    assert bm.allocator.refcount(a) == 2 and bm.allocator.refcount(b) == 2

    first = bm.append_slots(0, 1)  # the parent writes into the shared, partly filled block b
    new = bm.block_table(0)[1]
    assert first.copies == [(b, new)] and new not in (a, b)
    assert first.slots == [new * 4 + 1]
    assert bm.block_table(1) == [a, b]  # the child keeps the original
    assert bm.allocator.refcount(b) == 1 and bm.allocator.refcount(a) == 2

    assert bm.append_slots(0, 1).copies == []  # the parent's block is private now
    assert bm.append_slots(1, 1).copies == []  # so is the child's: b has a single holder left
    assert bm.append_slots(1, 1).slots == [b * 4 + 2]


def test_fork_at_a_full_block_needs_no_copy():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 4)
    bm.fork(0, 1)
    result = bm.append_slots(1, 1)
    assert result.copies == []
    assert bm.block_table(1)[0] == bm.block_table(0)[0]
    assert bm.block_table(1)[1] != bm.block_table(0)[0]


def test_copy_on_write_that_cannot_get_a_block_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate(0, 5)
    bm.fork(0, 1)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError) as err:
        bm.append_slots(0, 1)
    assert (err.value.needed, err.value.free) == (1, 0)
    assert snapshot(bm) == before
    assert not bm.can_append_slots(0, 1)


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate(0, 3)  # 2 blocks
    before = snapshot(bm)
    assert not bm.can_allocate(3)
    with pytest.raises(NoFreeBlocksError) as err:
        bm.allocate(1, 3)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert 1 not in bm
    assert snapshot(bm) == before
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(0, 4)  # 7 tokens need 4 blocks, we hold 2, 1 is free
    assert snapshot(bm) == before


def test_usage_counts_shared_blocks_once():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate(0, 5)  # 2 blocks, 3 empty slots
    bm.allocate(1, 4)  # 1 full block
    bm.fork(0, 2)  # shares both of sequence 0's blocks
    u = bm.usage()
    assert (u.total_blocks, u.used_blocks, u.free_blocks) == (10, 3, 7)
    assert (u.reserved_slots, u.used_slots, u.wasted_slots) == (12, 9, 3)
    assert u.waste_fraction == pytest.approx(3 / 12)


def test_free_returns_blocks_only_when_the_last_holder_lets_go():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(0, 3)
    bm.fork(0, 1)
    bm.free(0)
    assert bm.allocator.num_used == 2
    bm.free(1)
    assert bm.allocator.num_used == 0


def test_allocator_rejects_double_free_and_unknown_ids():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    assert alloc.free(b) is True
    with pytest.raises(ValueError, match="already free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="already free"):
        alloc.incref(b)
    for bad in (-1, 2, 99):
        with pytest.raises(ValueError, match=r"unknown: valid ids are 0\.\.1"):
            alloc.free(bad)
    alloc.allocate_many(2)
    with pytest.raises(NoFreeBlocksError) as err:
        alloc.allocate()
    assert (err.value.needed, err.value.free) == (1, 0)


def test_manager_rejects_unknown_and_duplicate_sequences():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(0, 2)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate(0, 1)
    with pytest.raises(ValueError, match="unknown sequence id 7"):
        bm.append_slots(7, 1)
    with pytest.raises(ValueError, match="unknown sequence id 7"):
        bm.fork(7, 8)
    with pytest.raises(ValueError, match="already exists"):
        bm.fork(0, 0)
    with pytest.raises(ValueError, match=r"position 2 .* outside 0\.\.1"):
        bm.slot_mapping(0, [2])
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.append_slots(0, -1)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)


# ---- swapping: the manager owns the CPU swap pool's tables too ---------------------------------


def test_swap_out_is_all_or_nothing_when_the_swap_pool_is_too_small():
    bm = BlockManager(num_blocks=8, block_size=4, num_swap_blocks=2)
    bm.allocate(0, 9)  # 3 blocks, the swap pool has 2
    before = snapshot(bm)
    assert not bm.can_swap_out(0)
    with pytest.raises(NoFreeBlocksError, match="CPU swap") as err:
        bm.swap_out(0)
    assert (err.value.needed, err.value.free) == (3, 2)
    assert snapshot(bm) == before and 0 in bm and not bm.is_swapped(0)
    no_pool = BlockManager(num_blocks=8, block_size=4)
    no_pool.allocate(0, 1)
    with pytest.raises(NoFreeBlocksError, match="swap_space_blocks"):
        no_pool.swap_out(0)


def test_swap_out_and_in_move_the_table_and_report_the_copies():
    bm = BlockManager(num_blocks=6, block_size=4, num_swap_blocks=4)
    bm.allocate(0, 2)  # a small neighbour, so the swapped sequence's blocks are not 0, 1, 2
    bm.allocate(1, 10)
    gpu = bm.block_table(1)
    pairs = bm.swap_out(1)
    assert [g for g, _ in pairs] == gpu and [c for _, c in pairs] == bm.swap_table(1)
    assert 1 not in bm and bm.is_swapped(1) and bm.swapped_seq_ids() == [1]
    assert bm.usage().used_blocks == 1 and bm.swap_usage().used_blocks == 3  # device blocks freed
    cpu = bm.swap_table(1)
    back = bm.swap_in(1)
    assert [c for c, _ in back] == cpu and [g for _, g in back] == bm.block_table(1)
    assert bm.num_tokens(1) == 10 and not bm.is_swapped(1)
    assert bm.usage().used_blocks == 4 and bm.swap_usage().used_blocks == 0  # CPU blocks freed
    with pytest.raises(ValueError, match="not swapped out"):
        bm.swap_in(1)


def test_swap_in_is_all_or_nothing_and_counts_room_for_the_next_tokens():
    bm = BlockManager(num_blocks=3, block_size=4, num_swap_blocks=4)
    bm.allocate(0, 8)  # 2 blocks
    bm.swap_out(0)
    bm.allocate(1, 9)  # 3 blocks: the device pool is full
    before = snapshot(bm)
    assert not bm.can_swap_in(0)
    with pytest.raises(NoFreeBlocksError):
        bm.swap_in(0)
    assert snapshot(bm) == before and bm.is_swapped(0)
    bm.free(1)
    assert bm.can_swap_in(0, num_new_tokens=4)  # 12 tokens: 3 blocks, all free
    assert not bm.can_swap_in(0, num_new_tokens=5)  # 13 tokens would need a 4th
    with pytest.raises(ValueError, match="swapped out: swap_in first"):
        bm.append_slots(0, 1)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate(0, 1)  # a swapped id is still taken


def test_swapping_out_a_forked_sequence_keeps_the_shared_blocks_for_its_sibling():
    bm = BlockManager(num_blocks=8, block_size=4, num_swap_blocks=8)
    bm.allocate(0, 5)
    bm.fork(0, 1)
    a, b = bm.block_table(0)
    pairs = bm.swap_out(1)
    assert [g for g, _ in pairs] == [a, b]  # both copied to the CPU ...
    assert bm.allocator.refcount(a) == bm.allocator.refcount(b) == 1  # ... and still held by 0
    assert bm.block_table(0) == [a, b] and bm.allocator.num_used == 2
    back = bm.swap_in(1)
    fresh = bm.block_table(1)
    assert [g for _, g in back] == fresh and not set(fresh) & {a, b}  # a private copy comes back
    assert all(bm.allocator.refcount(x) == 1 for x in [a, b, *fresh])


def test_freeing_a_swapped_sequence_frees_its_swap_blocks():
    bm = BlockManager(num_blocks=4, block_size=4, num_swap_blocks=4)
    bm.allocate(0, 6)
    bm.swap_out(0)
    assert bm.usage().used_blocks == 0 and bm.swap_usage().used_blocks == 2
    bm.free(0)
    assert bm.swap_usage() == SwapUsage(total_blocks=4, used_blocks=0, free_blocks=4)
    assert not bm.is_swapped(0) and 0 not in bm
    with pytest.raises(ValueError, match="unknown sequence id 0"):
        bm.free(0)


# ---- chapter 06: the prefix cache's free-but-cached blocks and their evictor ---------------------------

KEY_A, KEY_B = ("m:1", None, "tenant:a"), ("m:1", None, "tenant:b")


def cached_sequence(bm: BlockManager, seq_id: int, ids: list[int], key=KEY_A) -> list[int]:
    """Allocate ids as a prompt, mark its K/V written (its full blocks get their hashes), free it."""
    bm.allocate(seq_id, len(ids))
    bm.cache_blocks(seq_id, ids, key, len(ids))
    table = bm.block_table(seq_id)
    bm.free(seq_id)
    return table


def test_a_freed_full_block_stays_cached_and_a_partial_one_does_not():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    table = cached_sequence(bm, 0, list(range(10)))  # blocks: full, full, 2 of 4 slots
    u = bm.usage()
    assert (u.used_blocks, u.cached_blocks, u.free_blocks) == (0, 2, 6)
    assert sorted(bm.cached_block_ids()) == sorted(table[:2])
    assert bm.find_cached_prefix(list(range(12)), KEY_A, max_tokens=11) == table[:2]
    assert bm.find_cached_prefix(list(range(12)), KEY_B, max_tokens=11) == []  # another scope: no hit
    assert bm.find_cached_prefix(list(range(12)), KEY_A, max_tokens=7) == table[:1]  # capped: whole blocks


def test_allocate_takes_free_blocks_before_evicting_the_least_recently_used_cached_one():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = cached_sequence(bm, 0, [5, 6])  # cached first: least recently used
    new = cached_sequence(bm, 1, [7, 8])
    assert bm.allocator.num_free == 2 and bm.allocator.num_cached == 2
    bm.allocate(2, 4)  # the two free blocks: nothing evicted
    assert bm.allocator.num_cached == 2
    bm.allocate(3, 2)  # the free list is empty: the LRU cached block goes
    assert bm.block_table(3) == old and bm.cached_block_ids() == new
    assert bm.find_cached_prefix([5, 6, 1], KEY_A, 2) == []  # its hash went with it
    assert bm.find_cached_prefix([7, 8, 1], KEY_A, 2) == new


def test_an_evicted_block_is_never_found_under_its_old_hash():
    """The stale-hash bug: after eviction and reuse for other tokens, no lookup may lead to the block,
    and when its new holder fills it, it is registered under the NEW tokens' hash."""
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    first = cached_sequence(bm, 0, [5, 6, 7, 8])
    bm.allocate(1, 4)  # evicts both
    bm.cache_blocks(1, [9, 9, 9, 9], KEY_A, 4)
    assert set(bm.block_table(1)) == set(first)  # the same blocks, reused
    assert bm.find_cached_prefix([5, 6, 7, 8, 0], KEY_A, 4) == []
    assert bm.find_cached_prefix([9, 9, 9, 9, 0], KEY_A, 4) == bm.block_table(1)


def test_a_hit_takes_its_blocks_out_of_the_evictor_and_admission_counts_them():
    """3 blocks cached, 2 held, 1 free. A request sharing 2 cached blocks and needing 3 new ones needs
    3 + 2 = 5 of the 4 available (free or cached): the 2 it shares leave the evictor. Refused, all or
    nothing; with one new block fewer it fits."""
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    prompt = [2, 3, 4, 5, 6, 7]
    cached_sequence(bm, 0, prompt)
    bm.allocate(1, 4)  # holds 2 blocks
    mine = prompt[:4] + [9] * 6  # 10 tokens: 5 blocks, 2 of them cached
    hit = bm.find_cached_prefix(mine, KEY_A, len(mine) - 1)
    assert len(hit) == 2 and bm.allocator.num_available == 4
    before = snapshot(bm)
    assert not bm.can_allocate(len(mine), hit)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, len(mine), hit)
    assert snapshot(bm) == before and bm.allocator.num_cached == 3
    assert bm.can_allocate(len(mine) - 2, hit)
    table = bm.allocate(2, len(mine) - 2, hit)
    assert table[:2] == hit and all(bm.allocator.refcount(b) == 1 for b in table)
    assert not set(hit) & set(bm.cached_block_ids())


def test_reset_prefix_cache_refuses_while_blocks_are_held_and_then_frees_every_cached_block():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    cached_sequence(bm, 0, [2, 3, 4, 5])
    bm.allocate(1, 1)
    assert bm.reset_prefix_cache() is False and bm.allocator.num_cached == 2
    bm.free(1)
    assert bm.reset_prefix_cache() is True
    assert bm.allocator.num_free == 4 and bm.find_cached_prefix([2, 3, 4, 5], KEY_A, 3) == []


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences over a tiny alphabet (so prefixes repeat) in two scopes, sharing cached blocks. The fake
    pool holds each slot's token and the scope that wrote it: a hit must read back exactly the sequence's
    own tokens, written in its own scope, and every hash must lead to a block holding its tokens."""

    @initialize(num_blocks=st.integers(2, MAX_BLOCKS), block_size=st.sampled_from([1, 2, 3]),
                num_swap_blocks=st.integers(0, 6))
    def setup(self, num_blocks, block_size, num_swap_blocks):
        self.bm = BlockManager(num_blocks, block_size, num_swap_blocks, enable_prefix_caching=True)
        self.pool: dict[int, tuple] = {}  # slot -> (token, key) on the device
        self.cpu_pool: dict[int, tuple] = {}
        self.seqs: dict[int, tuple[list[int], tuple]] = {}  # seq -> (its tokens, its key)
        self.hashed: dict[str, list[int]] = {}  # hash -> the tokens of the block it names
        self.next_seq = 0

    def _write(self, seq_id, slots, start):
        ids, key = self.seqs[seq_id]
        for pos, slot in zip(range(start, len(ids)), slots, strict=True):
            self.pool[slot] = (ids[pos], key)
        self._cache(seq_id)

    def _cache(self, seq_id):
        ids, key = self.seqs[seq_id]
        self.bm.cache_blocks(seq_id, ids, key, len(ids))
        bs = self.bm.block_size
        for i, h in enumerate(block_hashes(ids, bs, key)):
            self.hashed[h] = ids[i * bs:(i + 1) * bs]

    def _live(self, data):
        return data.draw(st.sampled_from(sorted(self.bm.seq_ids())))

    @rule(ids=st.lists(st.integers(0, 2), min_size=1, max_size=2 * MAX_TOKENS_PER_CALL), b_scope=st.booleans())
    def new_sequence(self, ids, b_scope):
        key, bs = KEY_B if b_scope else KEY_A, self.bm.block_size
        hit = self.bm.find_cached_prefix(ids, key, len(ids) - 1)
        assert len(hit) * bs <= len(ids) - 1
        before, can = snapshot(self.bm), self.bm.can_allocate(len(ids), hit)
        seq_id, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self.bm.allocate(seq_id, len(ids), hit)
        except NoFreeBlocksError:
            assert not can and snapshot(self.bm) == before
            return
        assert can
        self.seqs[seq_id] = (list(ids), key)
        start = len(hit) * bs
        for pos, slot in enumerate(self.bm.slot_mapping(seq_id, range(start))):  # the shared prefix
            assert self.pool[slot] == (ids[pos], key), "a hit read a block holding something else"
        self._write(seq_id, self.bm.slot_mapping(seq_id, range(start, len(ids))), start)

    @precondition(lambda self: self.bm.seq_ids())
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=MAX_TOKENS_PER_CALL))
    def append(self, data, new):
        seq_id = self._live(data)
        try:
            result = self.bm.append_slots(seq_id, len(new))
        except NoFreeBlocksError:
            return
        for src, dst in result.copies:  # copy-on-write, before writing
            for off in range(self.bm.block_size):
                if src * self.bm.block_size + off in self.pool:
                    self.pool[dst * self.bm.block_size + off] = self.pool[src * self.bm.block_size + off]
        ids, key = self.seqs[seq_id]
        self.seqs[seq_id] = (ids + new, key)
        self._write(seq_id, result.slots, len(ids))

    @precondition(lambda self: self.bm.seq_ids())
    @rule(data=st.data())
    def fork(self, data):
        parent = self._live(data)
        child, self.next_seq = self.next_seq, self.next_seq + 1
        self.bm.fork(parent, child)
        ids, key = self.seqs[parent]
        self.seqs[child] = (list(ids), key)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: self.bm.seq_ids())
    @rule(data=st.data())
    def swap_out_and_back(self, data):
        seq_id = self._live(data)
        if not self.bm.can_swap_out(seq_id):
            return
        copy_blocks(self.pool, self.cpu_pool, self.bm.swap_out(seq_id), self.bm.block_size)
        if self.bm.can_swap_in(seq_id):
            copy_blocks(self.cpu_pool, self.pool, self.bm.swap_in(seq_id), self.bm.block_size)
            self._cache(seq_id)  # the next forward ran: fresh copies may be registered

    @invariant()
    def refcounts_equal_table_entries_and_every_block_is_in_one_state(self):
        if not hasattr(self, "bm"):
            return
        alloc = self.bm.allocator
        holders = Counter(b for s in self.bm.seq_ids() for b in self.bm.block_table(s))
        assert [alloc.refcount(b) for b in range(alloc.num_blocks)] == [holders[b] for b in range(alloc.num_blocks)]
        cached = set(self.bm.cached_block_ids())
        assert not cached & set(holders) and alloc.num_free + len(cached) + len(holders) == alloc.num_blocks

    @invariant()
    def every_hash_leads_to_a_block_holding_its_tokens(self):
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for h, block in self.bm.prefix_cache.entries().items():
            held = [self.pool.get(block * bs + off, (None,))[0] for off in range(bs)]
            assert held == self.hashed[h], "a stale hash: the block now holds other tokens"

    @invariant()
    def every_sequence_reads_back_its_tokens_in_its_scope(self):
        if not hasattr(self, "bm"):
            return
        for s in self.bm.seq_ids():
            ids, key = self.seqs[s]
            assert [self.pool[x] for x in self.bm.slot_mapping(s, range(len(ids)))] == [(t, key) for t in ids]

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for s in list(self.seqs):
            self.bm.free(s)
        assert self.bm.allocator.num_used == 0 and self.bm.reset_prefix_cache()
        assert self.bm.allocator.num_free == self.bm.allocator.num_blocks


PrefixCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_prefix_cache_bookkeeping_holds_under_random_interleavings = PrefixCacheMachine.TestCase

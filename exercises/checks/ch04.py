"""Checks for chapter 04: an allocator, slot mapping, growth, a copy-on-write fork,
and waste questions.

Each `check_<claim>(mod)` runs against the student's `exercises/ch04_paged_kv.py` or the reference
in `exercises/solutions/`. The answers come from two places: small cases worked out by hand in the
comments, and `engine.kv.block_manager` (BlockAllocator, BlockManager) doing the same thing. The
student's `BlockAllocator` has the engine's methods, so the allocator checks also pass on the
engine's.
"""

from __future__ import annotations

import math
import random

from engine.kv.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError
from engine.lab.workloads import sample_request_lengths, total_lengths
from exercises.checks import raises

SEED = 4  # chapter 04: any fixed seed makes a failure reproducible
# allocator operations in the random comparison: enough to free, reuse and share often
RANDOM_OPS = 300
POOL = 12  # blocks in the random comparison's pool: small, so it runs dry and refills many times
REL_TOL = 1e-12


def _assert_close(got, want, call: str) -> None:
    assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=REL_TOL), (
        f"{call} gave {got!r}, expected {want!r}")




class _CountingAllocator:
    """allocate_fn for the checks: hands out the given ids in order and counts the calls."""

    def __init__(self, ids):
        self._ids, self.calls = list(ids), 0

    def __call__(self) -> int:
        assert self.calls < len(self._ids), (
            f"allocate_fn was called more than the {len(self._ids)} time(s) needed")
        self.calls += 1
        return self._ids[self.calls - 1]


# ---- the allocator -------------------------------------------------------------------------------


def check_allocator_hands_out_every_block_once_then_raises(mod) -> None:
    alloc = mod.BlockAllocator(5)
    got = [alloc.allocate() for _ in range(5)]
    assert got == [0, 1, 2, 3, 4], (
        f"a fresh BlockAllocator(5) handed out {got}, expected [0, 1, 2, 3, 4]")
    assert (alloc.num_free, alloc.num_used) == (0, 5), (
        f"(num_free, num_used) is {(alloc.num_free, alloc.num_used)} after taking all 5 blocks, "
        "expected (0, 5)")
    assert raises(alloc.allocate, RuntimeError), (
        "allocate() on an empty pool must raise NoFreeBlocksError")
    assert alloc.free(2) is True and alloc.num_free == 1, (
        "free(2) of a block held once must return True")
    assert alloc.allocate() == 2, "after free(2), the only free block, 2, must be handed out again"


def check_allocator_frees_a_shared_block_only_when_the_last_owner_lets_go(mod) -> None:
    alloc = mod.BlockAllocator(3)
    block = alloc.allocate()
    alloc.incref(block)
    alloc.incref(block)
    assert alloc.refcount(block) == 3, (
        f"allocate + 2 x incref: refcount {alloc.refcount(block)}, expected 3")
    results = [alloc.free(block) for _ in range(3)]
    assert results == [False, False, True], (
        f"three free() calls on a block held 3 times returned {results}, expected "
        "[False, False, True]")
    assert alloc.refcount(block) == 0 and alloc.num_free == 3, (
        "the block must be back on the free list")


def check_allocator_refuses_a_double_free_and_unknown_ids(mod) -> None:
    alloc = mod.BlockAllocator(4)
    block = alloc.allocate()
    alloc.free(block)
    assert raises(lambda: alloc.free(block), ValueError), (
        "freeing a block twice must raise ValueError")
    assert raises(lambda: alloc.free(3), ValueError), (
        "freeing a block never allocated must raise ValueError")
    assert raises(lambda: alloc.incref(3), ValueError), (
        "incref of a free block must raise ValueError")
    for bad in (-1, 4):
        assert raises(lambda b=bad: alloc.free(b), ValueError), (
            f"free({bad}) in a pool of 4 must raise")
        assert raises(lambda b=bad: alloc.refcount(b), ValueError), (
            f"refcount({bad}) must raise ValueError")
    assert alloc.num_free == 4, (
        f"refused calls must change nothing: num_free is {alloc.num_free}, expected 4")
    for bad in (0, -3):
        assert raises(lambda n=bad: mod.BlockAllocator(n), ValueError), (
            f"BlockAllocator({bad}) must raise ValueError")


def check_allocate_many_takes_all_or_nothing(mod) -> None:
    alloc = mod.BlockAllocator(5)
    assert alloc.allocate_many(2) == [0, 1], (
        "allocate_many(2) on a fresh pool of 5 must give [0, 1]")
    assert raises(lambda: alloc.allocate_many(4), NoFreeBlocksError), (
        "allocate_many(4) with 3 free blocks must raise NoFreeBlocksError")
    assert alloc.num_free == 3 and alloc.refcount(2) == 0, (
        f"after a refused allocate_many(4), num_free is {alloc.num_free} and block 2 has refcount "
        f"{alloc.refcount(2)}, expected 3 and 0: check before taking any block")
    assert alloc.allocate_many(3) == [2, 3, 4] and alloc.allocate_many(0) == [], (
        "allocate_many(3) must then take the 3 free blocks [2, 3, 4], and allocate_many(0) nothing")


def check_allocator_matches_the_engine_on_random_operations(mod) -> None:
    rng = random.Random(SEED)
    mine, engine = mod.BlockAllocator(POOL), BlockAllocator(POOL)
    held: list[int] = []  # one entry per reference: a block appears as often as its refcount
    for step in range(RANDOM_OPS):
        op = rng.choice(["allocate", "allocate", "incref", "free", "free"])
        if op == "allocate" and engine.num_free:
            n = rng.choice([1, 1, 2])
            if n > engine.num_free:
                continue
            got, want = mine.allocate_many(n), engine.allocate_many(n)
            assert got == want, (
                f"operation {step}: allocate_many({n}) gave {got}, the engine's allocator "
                f"gave {want}")
            held.extend(want)
        elif op == "incref" and held:
            block = rng.choice(held)
            mine.incref(block), engine.incref(block)
            held.append(block)
        elif op == "free" and held:
            block = held.pop(rng.randrange(len(held)))
            got, want = mine.free(block), engine.free(block)
            assert got == want, (
                f"operation {step}: free({block}) returned {got}, the engine returned {want}")
        assert (mine.num_free, mine.num_used) == (engine.num_free, engine.num_used), (
            f"operation {step} ({op}): (num_free, num_used) is {(mine.num_free, mine.num_used)}, "
            f"the engine's {(engine.num_free, engine.num_used)}")
    counts = [mine.refcount(b) for b in range(POOL)]
    assert counts == [engine.refcount(b) for b in range(POOL)], (
        f"refcounts {counts} differ from the engine's")


# ---- slot mapping --------------------------------------------------------------------------------


def check_slot_mapping_of_the_worked_example(mod) -> None:
    # BS = 4, table [7, 2, 5]: positions 0-3 -> 28-31 (block 7), 4-7 -> 8-11 (block 2),
    # 8-9 -> 20-21.
    got = mod.slot_mapping([7, 2, 5], 4, list(range(10)))
    want = [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert got == want, f"slot_mapping([7, 2, 5], 4, 0..9) gave {got}, expected {want}"
    assert mod.slot_mapping([7, 2, 5], 4, [9, 0]) == [21, 28], "positions may come in any order"


def check_slot_mapping_matches_the_engine_on_interleaved_tables(mod) -> None:
    rng = random.Random(SEED)
    for block_size in (1, 3, 16):
        # 40 appends of <= BS + 1 tokens fit
        bm = BlockManager(num_blocks=128, block_size=block_size)
        for seq in range(3):
            bm.allocate(seq, 0)
        for _ in range(40):  # sequences grow in turn, so their blocks interleave in the pool
            seq = rng.randrange(3)
            bm.append_slots(seq, rng.randint(1, block_size + 1))
        for seq in range(3):
            positions = list(range(bm.num_tokens(seq)))
            got = mod.slot_mapping(bm.block_table(seq), block_size, positions)
            assert got == bm.slot_mapping(seq, positions), (
                f"slot_mapping({bm.block_table(seq)}, {block_size}, all positions) differs "
                "from the engine's")


# ---- growth --------------------------------------------------------------------------------------


def check_append_tokens_crosses_a_block_boundary(mod) -> None:
    # BS = 4, [3] holds 3 tokens: 2 more fill slot 3 of block 3
    # and spill one token into a new block.
    alloc = _CountingAllocator([9])
    table = [3]
    got = mod.append_tokens(table, 3, 2, 4, alloc)
    assert got == [3, 9], f"append_tokens([3], 3 tokens, +2, BS 4) gave {got}, expected [3, 9]"
    assert table == [3], (
        f"append_tokens changed its input table to {table}; return a new list instead")


def check_append_tokens_fills_the_last_block_before_taking_a_new_one(mod) -> None:
    alloc = _CountingAllocator([9])
    got = mod.append_tokens([3], 3, 1, 4, alloc)  # the 4th token fits in slot 3 of block 3
    assert got == [3] and alloc.calls == 0, (
        f"append_tokens([3], 3 tokens, +1, BS 4) gave {got} after {alloc.calls} allocation(s), "
        "expected [3] and no allocation")
    alloc = _CountingAllocator([5, 6, 7])
    got = mod.append_tokens([], 0, 9, 4, alloc)  # 9 tokens from nothing: ceil(9 / 4) = 3 blocks
    assert got == [5, 6, 7], f"append_tokens([], 0 tokens, +9, BS 4) gave {got}, expected [5, 6, 7]"


def check_append_tokens_matches_the_engine(mod) -> None:
    rng = random.Random(SEED)
    for block_size in (1, 4, 16):
        bm, alloc = BlockManager(num_blocks=200, block_size=block_size), BlockAllocator(200)
        bm.allocate(0, 0)
        table, tokens = [], 0
        for _ in range(30):
            new = rng.choice([0, 1, 1, block_size - 1, block_size, 2 * block_size + 1])
            table = mod.append_tokens(table, tokens, new, block_size, alloc.allocate)
            bm.append_slots(0, new)
            tokens += new
            assert table == bm.block_table(0), (
                f"BS {block_size}: after {tokens} tokens your table is {table}, "
                f"the engine's {bm.block_table(0)}")


# ---- copy-on-write -------------------------------------------------------------------------------


FORK_POOL = 12  # blocks 0..11; the parent holds 4 and 7, and the next free block is 11


def _pool_holding(table: list[int]) -> BlockAllocator:
    """An engine allocator in which exactly the blocks of `table` are held (refcount 1), and the
    free list runs from the highest id down, so the next block handed out is 11."""
    alloc = BlockAllocator(FORK_POOL)
    for block in reversed(alloc.allocate_many(FORK_POOL)):
        if block not in table:
            alloc.free(block)
    return alloc


def _fork(mod, table: list[int], tokens: int, new: int, want: tuple,
          want_refcounts: dict[int, int]) -> None:
    alloc, call = (_pool_holding(table),
                   f"fork_copy_on_write({table}, {tokens} tokens, +{new}, BS 4)")
    given = list(table)
    child, copies = mod.fork_copy_on_write(given, tokens, new, 4, alloc)
    assert (list(child), list(copies)) == want, f"{call} gave {(child, copies)}, expected {want}"
    assert given == table, (
        f"{call} changed the parent's table to {given}; build the child's in a new list")
    got_counts = {b: alloc.refcount(b) for b in want_refcounts}
    assert got_counts == want_refcounts, (
        f"after {call}, the refcounts are {got_counts}, expected {want_refcounts}: each block "
        "counts the tables that hold it (a shared block is held by parent and child; a block the "
        "child swapped out is held by the parent alone)")


def check_fork_copies_a_shared_partly_filled_last_block(mod) -> None:
    # BS = 4, parent [4, 7] with 6 tokens: block 7 holds 2 tokens. The child's next token would
    # land in slot 2 of block 7, which the parent also reads: the child gets block 11 instead.
    # Block 4 is now held by both tables (2), block 7 by the parent only (1),
    # block 11 by the child (1).
    _fork(mod, [4, 7], 6, 1, ([4, 11], [(7, 11)]), {4: 2, 7: 1, 11: 1})


def check_fork_shares_full_blocks_without_copying(mod) -> None:
    # 8 tokens fill [4, 7] exactly: the child's next token opens a new block, nothing is copied.
    _fork(mod, [4, 7], 8, 1, ([4, 7, 11], []), {4: 2, 7: 2, 11: 1})
    # A child that writes nothing copies nothing and takes no block, but it does share both.
    _fork(mod, [4, 7], 6, 0, ([4, 7], []), {4: 2, 7: 2, 11: 0})


def check_fork_matches_the_engine(mod) -> None:
    for block_size in (1, 4, 16):
        for parent_tokens in (1, block_size, block_size + 1, 3 * block_size - 1):
            for new in (0, 1, 2, block_size + 3):
                bm, twin = (BlockManager(num_blocks=64, block_size=block_size) for _ in range(2))
                parent = bm.allocate(0, parent_tokens)
                # same state: twin's allocator hands out what bm's will
                twin.allocate(0, parent_tokens)
                bm.fork(0, 1)
                result = bm.append_slots(1, new)
                got = mod.fork_copy_on_write(parent, parent_tokens, new, block_size, twin.allocator)
                want = (bm.block_table(1), result.copies)
                call = (f"fork_copy_on_write({parent}, {parent_tokens} tokens, +{new}, "
                        f"BS {block_size})")
                assert (list(got[0]), list(got[1])) == want, (
                    f"{call} gave {got}, the engine's fork + append_slots gave {want}")
                counts = [twin.allocator.refcount(b) for b in range(64)]
                want_counts = [bm.allocator.refcount(b) for b in range(64)]
                wrong = {b: (c, w) for b, (c, w) in enumerate(zip(counts, want_counts, strict=True))
                         if c != w}
                assert not wrong, (
                    f"after {call}, block: (your refcount, the engine's) differ at {wrong}")


# ---- how much is wasted --------------------------------------------------------------------------


def check_expected_waste_is_the_average_over_a_full_period_of_lengths(mod) -> None:
    # Lengths 1..BS*k end their last block at every offset equally often: the empty tail takes
    # each value 0..BS-1 once per period, so the average is (BS - 1) / 2: 0 for BS 1, 7.5 for BS 16.
    _assert_close(mod.expected_waste_slots(1), 0.0, "expected_waste_slots(1)")
    _assert_close(mod.expected_waste_slots(16), 7.5, "expected_waste_slots(16)")
    for bs in (2, 8, 32):
        tails = [math.ceil(n / bs) * bs - n for n in range(1, 5 * bs + 1)]
        _assert_close(mod.expected_waste_slots(bs), sum(tails) / len(tails),
                      f"expected_waste_slots({bs})")


def check_contiguous_waste_of_a_small_batch(mod) -> None:
    # max_len 2048: 1 token wastes 2047, 2048 tokens waste 0, 1000 tokens waste 1048: 3095 in all.
    got = mod.contiguous_waste([1, 2048, 1000], 2048)
    assert got == 3095, f"contiguous_waste([1, 2048, 1000], 2048) gave {got!r}, expected 3095"
    assert mod.contiguous_waste([], 2048) == 0, "no sequences, no waste"
    # Each reserved max_len up front, however short the batch turned out:
    # 3 x 4096 - 1000 - 300 - 20.
    got = mod.contiguous_waste([1000, 300, 20], 4096)
    assert got == 10_968, (
        f"contiguous_waste([1000, 300, 20], 4096) gave {got!r}, expected 10968: each "
        "sequence reserved max_len = 4096 slots, not the length of the longest one")


def check_paged_waste_of_a_small_batch_and_of_the_engine(mod) -> None:
    # BS 16: 1 token wastes 15, 16 waste 0, 17 waste 15 (second block holds 1), 40 waste 8: 38.
    got = mod.paged_waste([1, 16, 17, 40], 16)
    assert got == 38, f"paged_waste([1, 16, 17, 40], 16) gave {got!r}, expected 38"
    lengths = total_lengths(sample_request_lengths(100, SEED))
    for bs in (1, 16, 128):
        bm = BlockManager(num_blocks=sum(math.ceil(n / bs) for n in lengths), block_size=bs)
        for seq, n in enumerate(lengths):
            bm.allocate(seq, n)
        got = mod.paged_waste(lengths, bs)
        assert got == bm.usage().wasted_slots, (
            f"paged_waste(100 chat-like lengths, BS {bs}) gave {got!r}, "
            f"the engine counts {bm.usage().wasted_slots}")


def check_concurrency_gain_of_paging(mod) -> None:
    # max_len 4096, mean 600 tokens, BS 16: a paged sequence costs 600 + 7.5 = 607.5 slots on
    # average, a reservation 4096: 4096 / 607.5 = 6.742... times more sequences.
    _assert_close(mod.concurrency_gain(4096, 600, 16), 4096 / 607.5,
                  "concurrency_gain(4096, 600, BS 16)")
    # BS 1 wastes nothing: 2048 / 512 = 4 exactly. BS 128 wastes 63.5 a sequence: 2048 / 575.5.
    _assert_close(mod.concurrency_gain(2048, 512, 1), 4.0, "concurrency_gain(2048, 512, BS 1)")
    _assert_close(mod.concurrency_gain(2048, 512, 128), 2048 / 575.5,
                  "concurrency_gain(2048, 512, BS 128)")

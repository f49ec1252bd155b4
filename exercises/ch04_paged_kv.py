"""Chapter 04 exercises: a block allocator, slot mapping, growing across a block boundary, a
copy-on-write fork, and how much memory paging wastes.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch04

Notation: BS block size (token slots per block), NB blocks in the pool. A sequence's *block table*
lists its physical blocks in token order; token position p lives in block table[p // BS] at offset
p % BS, i.e. in slot table[p // BS] * BS + p % BS of the pool:

    BS = 4, table [7, 2, 5], 10 tokens

    positions   0  1  2  3 | 4  5  6  7 | 8  9  .  .
    block           7      |     2      |     5        position 9 -> block 5, offset 1 -> slot 21

The engine's versions live in engine/kv/block_manager.py; try not to peek until the checks pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class BlockAllocator:
    """A free list of physical block ids 0..num_blocks-1, with a reference count per block.

    The engine's own class, engine.kv.block_manager.BlockAllocator, has exactly these methods (and
    passes the same checks). A block is free (refcount 0, on the free list) or held (refcount >= 1:
    the number of block tables that hold it). Hand out ids from the FRONT of the free list and put
    freed ids at the BACK, so a fresh allocator hands out 0, 1, 2, ...
    """

    def __init__(self, num_blocks: int):
        """ValueError for num_blocks < 1. Keep `self.num_blocks`."""
        raise NotImplementedError(
            "which data structure lets you take from one end and give back at the other cheaply? "
            "And where will each block's reference count live?")

    @property
    def num_free(self) -> int:
        """How many blocks are on the free list."""
        raise NotImplementedError("how long is the free list?")

    @property
    def num_used(self) -> int:
        """How many blocks are held (refcount >= 1)."""
        raise NotImplementedError("every block is either free or used: so how many are used?")

    def refcount(self, block: int) -> int:
        """How many tables hold `block` (0 when free).
        ValueError for an id outside 0..num_blocks-1."""
        raise NotImplementedError("what does a Python list answer for index -1? Check the id first")

    def allocate(self) -> int:
        """Take the first free block; its refcount becomes 1. With none free, raise
        engine.kv.block_manager.NoFreeBlocksError (a RuntimeError a scheduler can catch)."""
        raise NotImplementedError("take from the front of the free list; what if it is empty?")

    def allocate_many(self, n: int) -> list[int]:
        """Take n blocks, or none at all: with fewer than n free, raise NoFreeBlocksError BEFORE
        taking any (a scheduler that catches it finds the pool as it was)."""
        raise NotImplementedError(
            "when must you know that all n fit: before taking the first one, or after?")

    def incref(self, block: int) -> None:
        """One more table holds `block` (sharing after a fork).
        ValueError if it is free or unknown."""
        raise NotImplementedError("can a table share a block that nobody holds?")

    def free(self, block: int) -> bool:
        """One table lets go of `block`; return True when its count reaches 0 and it goes back on
        the free list. ValueError for a block that is already free (a double free) or unknown."""
        raise NotImplementedError(
            "a shared block has other holders: when may it go back on the free list, and at which "
            "end? What should a second free of the same block do?")


def slot_mapping(block_table: Sequence[int], block_size: int,
                 positions: Sequence[int]) -> list[int]:
    """The pool slot of each token position: block_table[p // BS] * BS + p % BS."""
    raise NotImplementedError("which entry of the table holds position p, and where inside that "
                              "block is it?")


def append_tokens(block_table: Sequence[int], num_tokens: int, new_tokens: int, block_size: int,
                  allocate_fn: Callable[[], int]) -> list[int]:
    """A sequence holding `num_tokens` tokens in `block_table` gets `new_tokens` more:
    return its new table.

    Take a new block (by calling allocate_fn(), once per block) only when the tokens spill past the
    last block; a partly filled last block is filled first. Do not change `block_table` itself.

        BS = 4, table [3], 3 tokens, +2 tokens: slot 3 of block 3 takes one, a new block the other
        -> [3, allocate_fn()]
    """
    raise NotImplementedError(
        "how many blocks do num_tokens + new_tokens tokens need (round which way?), and how many "
        "does the table hold already?")


def fork_copy_on_write(block_table: Sequence[int], num_tokens: int, new_tokens: int,
                       block_size: int,
                       allocator: BlockAllocator) -> tuple[list[int], list[tuple[int, int]]]:
    """Fork a sequence (the child shares every block of the parent),
    then the child writes `new_tokens`.

    `allocator` holds the parent's blocks (an engine.kv.block_manager.BlockAllocator, or yours).
    Return (child's block table, copies), leaving every refcount right: each block counts the tables
    that hold it. If the child writes into the shared last block while it is partly filled, it must
    first get a private copy: allocate a block, put it in place of the last one in the child's
    table, and report (src, dst) so the caller copies the K/V there. A full last block needs no copy
    (the new tokens go into new blocks). No new tokens, no copy. Do not change `block_table` itself.

        BS = 4, parent [4, 7] with 6 tokens, child writes 1: block 7 holds 2 tokens and is shared
        -> child [4, d], copies [(7, d)] with d = allocator.allocate(); block 4 is held twice,
        block 7 by the parent alone again
    """
    raise NotImplementedError(
        "sharing is bookkeeping: who holds each block after the fork, and after the child swaps in "
        "its copy? Then the child grows like append_tokens")


def expected_waste_slots(block_size: int) -> float:
    """Empty slots in a sequence's last block on average,
    when lengths spread evenly over offsets."""
    raise NotImplementedError("the last block holds 1, 2, ..., BS tokens equally often: how many "
                              "slots stay empty?")


def contiguous_waste(lengths: Sequence[int], max_len: int) -> int:
    """Slots left empty when every sequence reserves max_len slots up front."""
    raise NotImplementedError("each sequence reserved max_len slots, whatever the others did; how "
                              "many did it fill?")


def paged_waste(lengths: Sequence[int], block_size: int) -> int:
    """Slots left empty when each sequence holds just enough blocks of block_size slots."""
    raise NotImplementedError("how many whole blocks does a sequence of n tokens hold, and how "
                              "many slots is that?")


def concurrency_gain(max_len: int, mean_len: float, block_size: int) -> float:
    """How many times more sequences fit in the same KV memory with paging than with max_len
    reservations, for sequences of mean length mean_len (use the expected waste per sequence)."""
    raise NotImplementedError(
        "what does one sequence cost in slots each way, on average? The gain is a ratio of the two")

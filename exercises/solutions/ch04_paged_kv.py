"""Chapter 04, reference answers: an allocator, slot mapping, growth across a block boundary,
a copy-on-write fork, and how much memory paging wastes."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from engine.kv.block_manager import NoFreeBlocksError


class BlockAllocator:
    """A free list of physical block ids (lowest first; freed ids go to the back) with refcounts."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(needed=1, free=0)
        block = self._free.popleft()
        self._refcount[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        if n > len(self._free):  # all or nothing: check before taking the first one
            raise NoFreeBlocksError(needed=n, free=len(self._free))
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int) -> None:
        self._check_held(block)
        self._refcount[block] += 1

    def free(self, block: int) -> bool:
        self._check_held(block)
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free.append(block)
            return True
        return False

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:  # a negative id would silently index from the end
            raise ValueError(f"block {block} is unknown: valid ids are 0..{self.num_blocks - 1}")

    def _check_held(self, block: int) -> None:
        self._check_id(block)
        if self._refcount[block] == 0:
            raise ValueError(f"block {block} is already free (double free, or never allocated)")


def slot_mapping(block_table: Sequence[int], block_size: int,
                 positions: Sequence[int]) -> list[int]:
    """slot(p) = block_table[p // BS] * BS + p % BS for each position p."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def append_tokens(block_table: Sequence[int], num_tokens: int, new_tokens: int, block_size: int,
                  allocate_fn: Callable[[], int]) -> list[int]:
    """The table after `new_tokens` more tokens:
    one new block per BS slots spilled past the last one."""
    needed = math.ceil((num_tokens + new_tokens) / block_size) - len(block_table)
    return [*block_table, *(allocate_fn() for _ in range(needed))]


def fork_copy_on_write(block_table: Sequence[int], num_tokens: int, new_tokens: int,
                       block_size: int,
                       allocator: BlockAllocator) -> tuple[list[int], list[tuple[int, int]]]:
    """A child shares the parent's blocks, then writes `new_tokens`:
    returns (child table, copies)."""
    child, copies = list(block_table), []
    for block in child:  # the fork: one more table holds each block
        allocator.incref(block)
    if new_tokens and num_tokens % block_size != 0:  # the last block is shared and partly filled
        copy = allocator.allocate()
        allocator.free(child[-1])  # the child lets go; the parent still holds the shared block
        copies.append((child[-1], copy))
        child[-1] = copy
    return append_tokens(child, num_tokens, new_tokens, block_size, allocator.allocate), copies


def expected_waste_slots(block_size: int) -> float:
    """Empty slots in a sequence's last block, averaged over lengths: (BS - 1) / 2."""
    return (block_size - 1) / 2


def contiguous_waste(lengths: Sequence[int], max_len: int) -> int:
    """Slots a max-length reservation leaves empty: the sum of max_len - n."""
    return sum(max_len - n for n in lengths)


def paged_waste(lengths: Sequence[int], block_size: int) -> int:
    """Slots paging leaves empty: the sum of ceil(n / BS) * BS - n."""
    return sum(math.ceil(n / block_size) * block_size - n for n in lengths)


def concurrency_gain(max_len: int, mean_len: float, block_size: int) -> float:
    """How many times more sequences fit in the same KV memory with paging
    than with max_len reservations."""
    return max_len / (mean_len + expected_waste_slots(block_size))

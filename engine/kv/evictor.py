"""Chapter 06: the evictor decides which free-but-cached KV block the prefix cache gives up first.

A block whose last holder lets go keeps its K/V and its hash: it is *free but cached*, and a later
request with the same prefix can share it as is (``engine/kv/prefix_cache.py``). Those blocks wait
in an *evictor*. When the device needs a block and the free list is empty, the evictor names the
victim: its hash is dropped and the block is handed out for other tokens. The evictor is the whole
policy; the block manager never looks inside it.

Who calls what, and when (the block manager, through ``BlockAllocator`` and ``PrefixCache``)::

    what happens to a block                                evictor call
    its last holder frees it and it has a hash (free)      add(block)
    a prefix-cache hit shares it again (allocate, incref)  remove(block)
    the free list is empty, a block is needed (allocate)   pop() -> the victim
    a table still holds it, but its hash goes (rollback)   forget(block)
    every hash goes at once (reset_prefix_cache)           forget(block), for every hashed block
    questions                                              block in evictor, len(evictor), blocks()

``remove`` and ``forget`` are two calls on purpose: after ``remove`` the block keeps its hash and
will come back (FIFO must remember its place in the queue); after ``forget`` (and after ``pop``)
the hash is gone, so the policy must forget whatever it kept about the block. There is no
``touch``: a hit is a ``remove`` now and an ``add`` when its new holders let go, and ``add`` is
where a policy decides whether coming back refreshes a block.

The two policies differ on a block that is hit while it waits::

    free A    add A              LRU [A]        FIFO [A]
    free B    add B              LRU [A, B]     FIFO [A, B]
    hit A     remove A           LRU [B]        FIFO [B]         FIFO remembers A came first
    free A    add A              LRU [B, A]     FIFO [A, B]
    need one  pop()              LRU -> B       FIFO -> A        (victim first in every list)

Where new things go: a new eviction policy is one class in this file that follows ``Evictor``
(and its line in ``_POLICIES`` below), plus its name in ``EVICTION_POLICIES`` in
``engine/config.py``. Nothing else changes: ``make_evictor`` builds it from
``CacheConfig.eviction_policy``, for the device's prefix cache and the host tier's alike.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Protocol

from engine.config import EVICTION_POLICIES


class Evictor(Protocol):
    """The contract of every eviction policy: an ordered set of free-but-cached block ids.

    ``blocks()`` lists them in eviction order, the next victim first; ``pop()`` takes that first
    one. A policy never frees, hashes or allocates anything: it only keeps an order.
    """

    def add(self, block: int) -> None:
        """``block`` became free but cached (its last holder let go; it has a hash)."""

    def remove(self, block: int) -> None:
        """A hit revived ``block``: a table holds it again. It keeps its hash and may come back."""

    def pop(self) -> int:
        """Take the next victim out (its hash is dropped right after); raises ``LookupError``
        when the evictor is empty."""

    def forget(self, block: int) -> None:
        """``block`` lost its hash: drop it and all we remember of it (a no-op if unknown)."""

    def __contains__(self, block: int) -> bool: ...

    def __len__(self) -> int: ...

    def blocks(self) -> list[int]:
        """The blocks waiting, in eviction order: the next victim first."""


class LRUEvictor:
    """Least recently used first (vLLM's policy, and ours by default).

    "Used" means held: a block is in use while a table holds it, and it enters the evictor at the
    moment its last holder frees it. So the order is the order of those moments, oldest first; a
    block revived by a hit and freed again goes to the back. The block manager frees a sequence's
    blocks tail first, so a prefix's last blocks are evicted before its first ones, which more
    requests share.
    """

    def __init__(self):
        self._order: OrderedDict[int, None] = OrderedDict()  # least recently freed first

    def add(self, block: int) -> None:
        _check_absent(self, block)
        self._order[block] = None

    def remove(self, block: int) -> None:
        _check_present(self, block)
        del self._order[block]

    def pop(self) -> int:
        _check_not_empty(self)
        block, _ = self._order.popitem(last=False)
        return block

    def forget(self, block: int) -> None:
        self._order.pop(block, None)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)

    def blocks(self) -> list[int]:
        return list(self._order)


class FIFOEvictor:
    """The block cached first is evicted first, however often it was hit since.

    "Cached first" needs care, because a block can leave and come back many times under one hash.
    Its place in the queue is set the FIRST time it is added under its current hash and is NOT
    refreshed by a hit: a revived block that is freed again goes back to its old place, not to the
    back. The place lasts as long as the hash: after ``pop`` or ``forget`` the block is a stranger,
    and when it is cached again (under a new hash) it starts at the back. We count from the first
    ``add`` rather than from when the block was hashed, because the evictor only sees adds, and
    because the manager frees a sequence's tail first: a prefix's last blocks then queue before
    its first ones.

    What FIFO costs: a popular system prompt's blocks are evicted in their turn however many
    requests hit them, and a chain can lose its head while its tail is still cached (a later
    request extended the chain): ``find_cached_prefix`` stops at the first miss, so that tail is
    unreachable until it is evicted in turn. LRU rarely does this: a hit on a block is a hit on
    every block before it.

        _queue    (arrival, block) of the blocks waiting, sorted: the victim first
        _arrival  block -> its arrival number, for every block added under its current hash,
                  waiting or revived (a revived one comes back to the same place)
    """

    def __init__(self):
        self._queue: list[tuple[int, int]] = []
        self._arrival: dict[int, int] = {}
        self._next_arrival = 0

    def add(self, block: int) -> None:
        _check_absent(self, block)
        if block not in self._arrival:  # first time under this hash: the back of the queue
            self._arrival[block] = self._next_arrival
            self._next_arrival += 1
        bisect.insort(self._queue, (self._arrival[block], block))

    def remove(self, block: int) -> None:
        _check_present(self, block)
        self._queue.remove((self._arrival[block], block))  # its arrival is kept for its return

    def pop(self) -> int:
        _check_not_empty(self)
        _, block = self._queue.pop(0)
        del self._arrival[block]
        return block

    def forget(self, block: int) -> None:
        if block in self:
            self.remove(block)
        self._arrival.pop(block, None)

    def __contains__(self, block: int) -> bool:
        arrival = self._arrival.get(block)
        if arrival is None:
            return False
        i = bisect.bisect_left(self._queue, (arrival, block))
        return i < len(self._queue) and self._queue[i] == (arrival, block)

    def __len__(self) -> int:
        return len(self._queue)

    def blocks(self) -> list[int]:
        return [block for _, block in self._queue]


# The policies by the name CacheConfig.eviction_policy uses; the names are EVICTION_POLICIES.
_POLICIES: dict[str, type] = {"lru": LRUEvictor, "fifo": FIFOEvictor}


def make_evictor(policy: str) -> Evictor:
    """A new, empty evictor of the named policy (one of ``EVICTION_POLICIES``)."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {policy!r}")
    if policy not in _POLICIES:
        raise ValueError(f"eviction_policy {policy!r} is in EVICTION_POLICIES but has no class: "
                         "add one to _POLICIES in engine/kv/evictor.py")
    return _POLICIES[policy]()


def _check_absent(evictor: Evictor, block: int) -> None:
    if block in evictor:
        raise ValueError(f"block {block} is already in the evictor: a block is added once, when "
                         "its last holder frees it")


def _check_present(evictor: Evictor, block: int) -> None:
    if block not in evictor:
        raise ValueError(f"block {block} is not in the evictor (it is used, or free and unhashed); "
                         "only a free-but-cached block can be revived")


def _check_not_empty(evictor: Evictor) -> None:
    if not len(evictor):
        raise LookupError("the evictor is empty: no free-but-cached block to evict (check "
                          "len(evictor) first, or free a sequence)")

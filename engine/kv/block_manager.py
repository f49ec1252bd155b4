"""Paged KV blocks: the allocator, per-sequence block tables, copy-on-write and waste accounting.

A contiguous KV cache reserves ``max_context`` slots for every sequence up front, and most of
them are never used. We do what an operating system does with memory pages instead: cut the KV
pool into fixed-size *blocks* of ``block_size`` (BS) token slots each, hand a sequence one more
block only when its tokens spill over, and keep for every sequence a *block table* that maps its
logical blocks (0, 1, 2, ... in token order) to physical blocks (anywhere in the pool).

With BS = 4, a sequence of 10 tokens and the table ``[7, 2, 5]``::

    token positions   0  1  2  3 | 4  5  6  7 | 8  9  .  .
    logical block         0      |     1      |     2
                          |            |            |
    block table  [  7,        2,           5  ]
                    v         v            v
    physical pool  ... | blk 2 | ... | blk 5 | ... | blk 7 | ...
    slots              | 8..11 |     | 20..23|     | 28..31|

    slot(position) = block_table[position // BS] * BS + position % BS
    position 9  ->  logical block 2, offset 1  ->  physical block 5  ->  slot 5 * 4 + 1 = 21

Only the last block can be partly filled (here 2 of its 4 slots are empty): that is all the
waste paging leaves, at most BS - 1 slots per sequence.

Sharing: ``fork`` gives a child sequence the parent's table and bumps every block's reference
count, so a prompt shared by n samples is stored once. The first write into a shared, partly
filled last block triggers *copy-on-write*: the writer gets a fresh block, and we report the
``(src_block, dst_block)`` pair that the caller must copy in the KV pools before writing.

Swapping: when the device pool runs out, the scheduler may preempt a sequence by *swapping* it:
its blocks move to a CPU-side swap pool of the same layout, and come back later. Its table moves
with them, so a sequence is always in exactly one of the two places::

                      swap_out(s)                          swap_in(s)
    device table [7, 2, 5]  ----->  CPU table [0, 1, 2]  ----->  device table [3, 4, 6]
    swap_out: device blocks 7, 2, 5 freed, returns [(7, 0), (2, 1), (5, 2)]   (GPU, CPU) pairs
    swap_in:  CPU blocks 0, 1, 2 freed,    returns [(0, 3), (1, 4), (2, 6)]   (CPU, GPU) pairs

The pairs are the copies the KV pool (``engine/kv/kv_pool.py``) must do before the next forward.
A block shared by forked sequences is copied once per sequence that swaps out, and each gets a
private device copy on the way back (vLLM swaps a whole sample group at once to keep the sharing;
we keep it simple).

Prefix caching (chapter 06, ``enable_prefix_caching``): once a sequence's FULL block has its K/V
written, ``cache_blocks`` registers it under its chained hash (``engine/kv/prefix_cache.py``).
When its last holder lets go, the block is not wiped: it becomes *free but cached* and waits in an
evictor, so the next request with the same prefix shares it (``find_cached_prefix``, then
``allocate(..., cached_blocks)``). ``allocate`` uses truly free blocks first and evicts a cached
block only when there are none, dropping its hash before the block is reused. Which one goes is
the ``eviction_policy`` (``engine/kv/evictor.py``: least recently used first by default, or FIFO)::

    block state     refcount   hash   where
    used            >= 1       maybe  in block tables
    free but cached 0          yes    the evictor (victim first)  <- a hit revives it, no copy
    free            0          no     the free list

Sliding window (Mistral, ``sliding_window = W``): a query at position p reads only positions
p - W + 1 .. p, so a block whose last position is before the window of every FUTURE query is dead.
``free_out_of_window`` gives such blocks back (to the free list, or to the evictor when cached) and
leaves ``NULL_BLOCK`` in their table entries, so positions keep their logical blocks::

    W = 6, BS = 4, next query at position 14 (it reads 9..14)
    block table  [3, 8, 5, 9]  ->  [-1, -1, 5, 9]     blocks 3 and 8 (positions 0..7) go back

A long sequence then holds about ceil(W / BS) + 1 blocks, however long it grows.

Host tier (``num_host_blocks``, needs the prefix cache): a second, larger and slower pool for
free-but-cached blocks. When the device must evict one, its K/V is first copied to the host tier
under the same hash ("offload"), instead of being lost; a later request whose prefix misses on the
device but hits on the host gets a fresh device block with the K/V copied back ("reload"), instead
of prefilling it again. The host tier is itself a prefix cache with the same eviction policy: when
it is full, its evictor's victim (the least recently used, by default) is dropped for good::

    device:  used | free | free-but-cached --evict--> offload to host --hit--> reload to device
    host:    free | cached (evictor order)                       (dropped when the host is full)

Rollback (for speculative decoding: a step writes K/V for several guessed tokens, the rejected ones
are taken back): ``rollback(seq, n)`` forgets a sequence's last n slots, frees the blocks left
empty and drops the hash of every block whose hashed tokens it took back (see its docstring).

Every block copy any method decides (swap out/in, copy-on-write, offload, reload) is also
recorded, in decision order, as a ``BlockMove``; ``take_moves`` hands them to the KV pool, which
must do them in that order before the next forward (a block can be read by one move and
overwritten by a later one within the same step, so the order matters).

This module is pure bookkeeping: it never touches a tensor. The KV pools live in
``engine/kv/kv_pool.py``, and the attention kernels that read through the tables in
``kernels/paged_attention``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.evictor import make_evictor
from engine.kv.prefix_cache import PrefixCache, block_hashes
from kernels.paged_attention.reference import NULL_BLOCK


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs; nothing was allocated.

    A scheduler catches this and waits, preempts, or rejects; the manager's state is unchanged.
    """

    def __init__(self, needed: int, free: int, pool: str = "KV"):
        self.needed = needed
        self.free = free
        advice = ("raise swap_space_blocks, or preempt by recompute" if pool == "CPU swap"
                  else "free a sequence, preempt one, or give the cache more blocks")
        super().__init__(f"need {needed} free {pool} block(s) but only {free} are free; {advice}")


class BlockAllocator:
    """A free list of physical block ids with a reference count per block.

    A block is *free* (refcount 0, on the free list) or *used* (refcount >= 1: the number of
    block tables that hold it). We hand out the lowest ids first, which makes pictures readable.

    With a prefix cache (chapter 06) there is a third state, *free but cached*: refcount 0, its
    K/V still valid and findable by hash, parked in the cache's evictor instead of the free
    list. ``allocate`` takes a truly free block first and evicts the evictor's victim only when
    there is none; ``num_available`` counts both kinds.
    """

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None,
                 on_evict: Callable[[int, str], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache
        self.on_evict = on_evict  # called with (block, its hash) before an evicted block is reused
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list (holding nothing anyone can find)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Free-but-cached blocks: refcount 0, contents kept for a prefix-cache hit until
        evicted."""
        return self.cache.num_evictable if self.cache else 0

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out: the free ones, then the free-but-cached ones
        (evicted)."""
        return self.num_free + self.num_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def allocate(self) -> int:
        """Take one block (a free one first, else evict a cached one); its reference count
        becomes 1."""
        if self._free:
            block = self._free.popleft()
        elif self.num_cached:
            block, h = self.cache.evict_with_hash()  # its hash is gone before anyone writes into it
            if self.on_evict is not None:
                self.on_evict(block, h)
        else:
            raise NoFreeBlocksError(needed=1, free=0)
        self._refcount[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """Take ``n`` blocks, or none at all (raises ``NoFreeBlocksError`` before taking any)."""
        if n > self.num_available:
            raise NoFreeBlocksError(needed=n, free=self.num_available)
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int) -> None:
        """One more table holds ``block`` (sharing, or a prefix-cache hit that revives a
        free-but-cached block: it leaves the evictor)."""
        self._check_id(block)
        if self.cache and self._refcount[block] == 0 and self.cache.is_evictable(block):
            self.cache.unpark(block)
        else:
            self._check_used(block, action="incref")
        self._refcount[block] += 1

    def free(self, block: int) -> bool:
        """One table lets go of ``block``. Returns True when nobody holds it any more: it goes
        back to the free list, or, when it has a prefix-cache hash, to the cache's evictor."""
        self._check_used(block, action="free")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self.cache and self.cache.hash_of(block) is not None:
                self.cache.park(block)
            else:
                self._free.append(block)
            return True
        return False

    def drop_cached(self) -> int:
        """Forget every prefix-cache hash; free-but-cached blocks join the free list. Returns how
        many."""
        freed = self.cache.clear() if self.cache else []
        self._free.extend(sorted(freed))
        return len(freed)

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block!r} is unknown: valid ids are "
                             f"0..{self.num_blocks - 1}")

    def _check_used(self, block: int, action: str) -> None:
        self._check_id(block)
        if self._refcount[block] == 0:
            raise ValueError(f"cannot {action} block {block}: it is already free (double free, "
                             "or never allocated)")


@dataclass(frozen=True)
class AppendResult:
    """What ``BlockManager.append_slots`` did.

    slots:  the slot id of each new token, in order; write its K/V there.
    copies: ``(src_block, dst_block)`` pairs to copy in every layer's K and V pools *before*
            writing (copy-on-write of a shared last block). Empty almost always.
    """

    slots: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class HostBlock:
    """A prefix-cache hit found in the host tier (``kv_offload_blocks``): block ``id`` of the
    host pool. ``allocate`` copies it back into a fresh device block (a "reload" move)."""

    id: int


@dataclass(frozen=True)
class BlockMove:
    """One block copy the KV pool must do before the next forward, in the order the manager decided.

    kind      from          to
    swap_out  device        swap pool     (a preempted sequence's block)
    swap_in   swap pool     device
    copy      device        device        (copy-on-write of a shared last block)
    offload   device        host tier     (an evicted prefix-cache block keeps its K/V on the host)
    reload    host tier     device        (a prefix-cache hit in host memory)
    """

    kind: str
    src: int
    dst: int


MOVE_KINDS = ("swap_out", "swap_in", "copy", "offload", "reload")


@dataclass(frozen=True)
class BlockUsage:
    """A snapshot of the pool, in blocks and in token slots (shared blocks counted once).

    wasted_slots = reserved_slots - used_slots: slots inside allocated blocks that hold no
    token, i.e. the empty tail of each partly filled last block. With a prefix cache,
    total = used + free + cached: ``cached_blocks`` are free but cached (refcount 0, reusable on a
    hit).
    """

    total_blocks: int
    used_blocks: int
    free_blocks: int
    reserved_slots: int
    used_slots: int
    wasted_slots: int
    cached_blocks: int = 0

    @property
    def waste_fraction(self) -> float:
        return self.wasted_slots / self.reserved_slots if self.reserved_slots else 0.0


@dataclass(frozen=True)
class SwapUsage:
    """The CPU swap pool, in blocks (all zeros when there is none: preemption by recompute)."""

    total_blocks: int
    used_blocks: int
    free_blocks: int


@dataclass
class _Sequence:
    block_table: list[int]
    num_tokens: int
    # the hashes of its first full blocks whose K/V is written
    block_hashes: list[str] = field(default_factory=list)
    # its first blocks already offered to the prefix cache (cache_blocks starts after them)
    num_registered: int = 0


class BlockManager:
    """Every block table: the device pool's (one ``BlockAllocator``) and the CPU swap pool's.

    Every method that can run out of blocks is all-or-nothing: it checks first, and on
    ``NoFreeBlocksError`` the tables, token counts and free lists are exactly as before.
    ``seq_id in manager`` and ``seq_ids()`` speak of the device pool; a swapped sequence is
    asked about with ``is_swapped``.

    ``eviction_policy`` (one of ``EVICTION_POLICIES``, ``engine/kv/evictor.py``) orders the
    free-but-cached blocks of the prefix cache and of the host tier; checked even without a cache.
    """

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 enable_prefix_caching: bool = False, sliding_window: int | None = None,
                 num_host_blocks: int = 0, eviction_policy: str = "lru"):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError("sliding_window must be an integer >= 1 or None (no window), got "
                             f"{sliding_window!r}")
        self.sliding_window = sliding_window
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0 (0: no swap pool), got "
                             f"{num_swap_blocks}")
        self.block_size = block_size
        # The prefix cache (chapter 06): hash -> block for full blocks, and the evictor of the
        # free-but-cached ones. The allocator consults it when a block's last holder lets go, and
        # evicts from it when the free list is empty.
        evictor = make_evictor(eviction_policy)  # raises on an unknown name, cache or no cache
        self.eviction_policy = eviction_policy
        self.prefix_cache = PrefixCache(evictor) if enable_prefix_caching else None
        self.allocator = BlockAllocator(num_blocks, self.prefix_cache)
        self.swap_allocator = BlockAllocator(num_swap_blocks) if num_swap_blocks else None
        if num_host_blocks < 0 or (num_host_blocks and not enable_prefix_caching):
            raise ValueError("num_host_blocks must be >= 0, and > 0 only with "
                             "enable_prefix_caching=True (the host tier keeps evicted prefix-cache "
                             f"blocks), got {num_host_blocks}")
        # The host tier: a prefix cache of its own (same policy), every block free but cached.
        self.host_cache = self.host_allocator = None
        if num_host_blocks:
            self.host_cache = PrefixCache(make_evictor(eviction_policy))
            self.host_allocator = BlockAllocator(num_host_blocks, self.host_cache)
        if self.host_allocator is not None:
            self.allocator.on_evict = self._offload
        self._moves: list[BlockMove] = []  # decided copies not yet taken by the KV pool, in order
        self.num_offloaded = self.num_reloaded = 0  # blocks, since the start
        self._seqs: dict[int, _Sequence] = {}  # on the device
        self._swapped: dict[int, _Sequence] = {}  # in the CPU swap pool: tables of CPU block ids

    # ---- questions -------------------------------------------------------------------------
    def __contains__(self, seq_id: int) -> bool:
        """Does the sequence hold blocks on the device? (A swapped one does not.)"""
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self._swapped

    def swapped_seq_ids(self) -> list[int]:
        return list(self._swapped)

    def swap_table(self, seq_id: int) -> list[int]:
        """The CPU blocks of a swapped sequence, in token order."""
        return list(self._get_swapped(seq_id).block_table)

    def can_swap_out(self, seq_id: int) -> bool:
        free = self.swap_allocator.num_free if self.swap_allocator else 0
        return len(_held(self._get(seq_id).block_table)) <= free

    def can_swap_in(self, seq_id: int, num_new_tokens: int = 0) -> bool:
        """Do its blocks, plus room for ``num_new_tokens`` more tokens, fit in the device pool?"""
        seq = self._get_swapped(seq_id)
        grow = self.blocks_for(seq.num_tokens + num_new_tokens) - len(seq.block_table)
        return len(_held(seq.block_table)) + grow <= self.allocator.num_available

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Would ``allocate(seq, num_tokens, cached_blocks)`` succeed? A cached block that is free
        but cached leaves the evictor when shared, so it counts against the blocks still
        available."""
        needed = self._blocks_needed_to_allocate(num_tokens, cached_blocks)
        return needed <= self.allocator.num_available

    def can_append_slots(self, seq_id: int, num_new_tokens: int) -> bool:
        needed = self._blocks_needed_to_append(self._get(seq_id), num_new_tokens)
        return needed <= self.allocator.num_available

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block of each logical block, in token order (``NULL_BLOCK``: freed by the
        window)."""
        return list(self._get(seq_id).block_table)

    def num_held_blocks(self, seq_id: int) -> int:
        """Device blocks the sequence holds (its table without the ``NULL_BLOCK`` entries)."""
        return len(_held(self._get(seq_id).block_table))

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def slot_mapping(self, seq_id: int, positions) -> list[int]:
        """Slot id of each token position: ``table[pos // BS] * BS + pos % BS``."""
        seq = self._get(seq_id)
        slots = []
        for pos in positions:
            if not 0 <= pos < seq.num_tokens:
                raise ValueError(
                    f"position {pos} of sequence {seq_id} is outside 0..{seq.num_tokens - 1}; "
                    "append_slots first"
                )
            block = seq.block_table[pos // self.block_size]
            if block == NULL_BLOCK:
                raise ValueError(f"position {pos} of sequence {seq_id} fell out of the sliding "
                                 f"window (W = {self.sliding_window}): its block was freed")
            slots.append(block * self.block_size + pos % self.block_size)
        return slots

    # ---- changes ---------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, cached_blocks: list[int] = ()) -> list[int]:
        """Register a new sequence holding ``num_tokens`` tokens; returns its block table.

        ``cached_blocks`` (from ``find_cached_prefix``) start the table: shared, not allocated. We
        take them out of the evictor BEFORE allocating the rest, so that the rest cannot evict
        them.
        """
        if seq_id in self._seqs or seq_id in self._swapped:
            raise ValueError(f"sequence {seq_id} already has blocks; free it or use append_slots")
        if num_tokens < 0 or len(cached_blocks) * self.block_size > num_tokens:
            raise ValueError(f"num_tokens must be >= 0 and cover the {len(cached_blocks)} cached "
                             f"blocks, got {num_tokens}")
        needed = self._blocks_needed_to_allocate(num_tokens, cached_blocks)
        if needed > self.allocator.num_available:
            raise NoFreeBlocksError(needed=needed, free=self.allocator.num_available)
        on_device = [b for b in cached_blocks if not isinstance(b, HostBlock)]
        on_host = [b.id for b in cached_blocks if isinstance(b, HostBlock)]
        for block in on_device:
            self.allocator.incref(block)
        for block in on_host:  # pinned while we allocate: an offload must not evict what we reload
            self.host_allocator.incref(block)
        fresh = iter(self.allocator.allocate_many(self.blocks_for(num_tokens) - len(on_device)))
        blocks = [b if not isinstance(b, HostBlock) else self._reload(b.id, next(fresh))
                  for b in cached_blocks]
        blocks += list(fresh)
        self._seqs[seq_id] = _Sequence(block_table=blocks, num_tokens=num_tokens)
        return list(blocks)

    def append_slots(self, seq_id: int, num_new_tokens: int) -> AppendResult:
        """Make room for ``num_new_tokens`` more tokens; returns their slots and any COW copy.

        New blocks are taken only when the tokens spill past the last block. If the last block
        is partly filled *and* shared (refcount > 1), we first swap in a private copy. If it is
        partly filled, ours alone and still hashed (a rollback left it partial while another holder
        kept it full, and that holder has left since), it loses its hash before we overwrite it.
        """
        seq = self._get(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        needed = self._blocks_needed_to_append(seq, num_new_tokens)
        if needed > self.allocator.num_available:
            raise NoFreeBlocksError(needed=needed, free=self.allocator.num_available)
        copies = []
        if num_new_tokens and self._last_block_is_shared_and_partial(seq):
            src = seq.block_table[-1]
            dst = self.allocator.allocate()
            self.allocator.free(src)  # the other holders keep it; we drop our reference
            seq.block_table[-1] = dst
            copies.append((src, dst))
            self._moves.append(BlockMove("copy", src, dst))
        elif num_new_tokens and seq.num_tokens % self.block_size and self.prefix_cache:
            self.prefix_cache.unregister(seq.block_table[-1])  # no-op for an unhashed block
        grow = self.blocks_for(seq.num_tokens + num_new_tokens) - len(seq.block_table)
        seq.block_table.extend(self.allocator.allocate_many(grow))
        start = seq.num_tokens
        seq.num_tokens += num_new_tokens
        slots = self.slot_mapping(seq_id, range(start, seq.num_tokens))
        return AppendResult(slots=slots, copies=copies)

    def rollback(self, seq_id: int, num_tokens: int) -> list[int]:
        """Take back the last ``num_tokens`` slots of a sequence (speculative decoding's rejected
        guesses); returns the blocks that nobody holds any more, in table order.

        Its token count drops by ``num_tokens``, every block left without a token of it leaves its
        table, and the next ``append_slots`` writes from the new end, into the partly filled last
        block first. With BS = 4, 10 tokens, ``rollback(s, 5)``::

            positions   0 1 2 3 | 4 5 6 7 | 8 9      before: table [7, 2, 5], 7 and 2 hashed
            kept        a b c d | e . . . | . .      after:  table [7, 2]
                        block 7   block 2   block 5
                        full:     partial:  empty: leaves the table, freed
                        hash kept hash goes

        Hashes: a block whose hashed tokens we take back (every block from the first rolled-back
        position on) loses its hash when this sequence is its only holder, before anything else:
        its rolled-back slots may hold K/V of rejected tokens, or be written again, and a hit on a
        wrong hash is far worse than a miss. A block another sequence also holds (a fork, a
        prefix-cache hit) keeps its hash, which is true for that holder, and only loses our
        reference; if it is our partial last block, our next write copies it first (copy-on-write)
        or, once we hold it alone, drops its hash then (``append_slots``).

        Raises ``ValueError``, changing nothing, for an unknown or swapped-out ``seq_id``, a
        ``num_tokens`` below 0 or above the sequence's tokens, or a rollback past a block the
        sliding window already freed that the next query would read.
        """
        seq = self._check_rollback(seq_id, num_tokens)
        keep_tokens = seq.num_tokens - num_tokens
        full = keep_tokens // self.block_size  # blocks whose every token stays
        keep = self.blocks_for(keep_tokens)  # blocks still holding a token: full, maybe one partial
        table = seq.block_table
        if self.prefix_cache is not None:
            for block in _held(table[full:]):
                if self.allocator.refcount(block) == 1:
                    self.prefix_cache.unregister(block)
        leaving = _held(table[keep:])
        freed = {b for b in reversed(leaving) if self.allocator.free(b)}  # tail first, as in free
        del table[keep:]
        del seq.block_hashes[full:]
        seq.num_registered = min(seq.num_registered, full)
        seq.num_tokens = keep_tokens
        return [b for b in leaving if b in freed]

    def _check_rollback(self, seq_id: int, num_tokens: int) -> _Sequence:
        """The sequence ``rollback`` may change, or a ValueError saying which argument is wrong."""
        if seq_id in self._swapped:
            raise ValueError(f"seq_id {seq_id!r} is swapped out: swap_in first, then roll back")
        if seq_id not in self._seqs:
            raise ValueError(f"unknown seq_id {seq_id!r}; live ids: {sorted(self._seqs)}")
        seq = self._seqs[seq_id]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) \
                or not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"num_tokens must be an integer in 0..{seq.num_tokens} (the tokens "
                             f"sequence {seq_id} holds), got {num_tokens!r}")
        if self.sliding_window is not None:
            # The next query, at position keep_tokens, reads blocks from `needed` on: none may be
            # a NULL_BLOCK the window freed (it would read nothing, or write into nothing).
            keep_tokens = seq.num_tokens - num_tokens
            needed = max(0, keep_tokens - self.sliding_window + 1) // self.block_size
            kept = seq.block_table[needed:self.blocks_for(keep_tokens)]
            if NULL_BLOCK in kept:
                raise ValueError(f"num_tokens={num_tokens} rolls sequence {seq_id} back past a "
                                 "block the sliding window already freed, which its next query "
                                 "reads; roll back before free_out_of_window, or by fewer tokens")
        return seq

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (no copy, no new block)."""
        parent = self._get(parent_id)
        if child_id in self._seqs or child_id in self._swapped:
            raise ValueError(f"cannot fork into sequence {child_id}: it already exists")
        for block in _held(parent.block_table):
            self.allocator.incref(block)
        self._seqs[child_id] = _Sequence(block_table=list(parent.block_table),
                                         num_tokens=parent.num_tokens,
                                         block_hashes=list(parent.block_hashes),
                                         num_registered=parent.num_registered)

    def free(self, seq_id: int) -> None:
        """Drop the sequence, on the device or swapped; blocks nobody else holds go back to the
        free list."""
        if seq_id in self._swapped:
            for block in self._swapped.pop(seq_id).block_table:
                self.swap_allocator.free(block)
            return
        seq = self._get(seq_id)
        # The tail first: with a prefix cache, the evictor then reuses a prefix's last blocks before
        # its first ones, which more requests share (vLLM frees in the same order).
        held = _held(seq.block_table)
        for block in reversed(held) if self.prefix_cache else held:
            self.allocator.free(block)
        del self._seqs[seq_id]

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence's table to the CPU pool; returns the (GPU block, CPU block) copies.

        Its device blocks are freed (a block a forked sibling still holds stays used). Raises
        ``NoFreeBlocksError`` (nothing changed) when the swap pool has too few free blocks or none.
        """
        seq = self._get(seq_id)
        held = _held(seq.block_table)
        if not self.can_swap_out(seq_id):
            free = self.swap_allocator.num_free if self.swap_allocator else 0
            raise NoFreeBlocksError(needed=len(held), free=free, pool="CPU swap")
        cpu_blocks = self.swap_allocator.allocate_many(len(held)) if held else []
        self.free(seq_id)
        self._swapped[seq_id] = _Sequence(block_table=_refill(seq.block_table, cpu_blocks),
                                          num_tokens=seq.num_tokens, block_hashes=seq.block_hashes)
        self._moves += [BlockMove("swap_out", g, c) for g, c in zip(held, cpu_blocks, strict=True)]
        return list(zip(held, cpu_blocks, strict=True))

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring a swapped sequence back to fresh device blocks; returns the (CPU block, GPU block)
        copies. Raises ``NoFreeBlocksError`` (nothing changed) when the device pool is too full."""
        seq = self._get_swapped(seq_id)
        held = _held(seq.block_table)
        gpu_blocks = self.allocator.allocate_many(len(held))
        for block in held:
            self.swap_allocator.free(block)
        del self._swapped[seq_id]
        self._seqs[seq_id] = _Sequence(block_table=_refill(seq.block_table, gpu_blocks),
                                       num_tokens=seq.num_tokens, block_hashes=seq.block_hashes)
        self._moves += [BlockMove("swap_in", c, g) for c, g in zip(held, gpu_blocks, strict=True)]
        return list(zip(held, gpu_blocks, strict=True))

    def free_out_of_window(self, seq_id: int, next_query_position: int) -> list[int]:
        """Sliding window: give back the blocks no query at ``next_query_position`` or later can
        read.

        A query at p reads positions >= p - W + 1, so block j (positions j*BS .. j*BS + BS - 1) is
        dead once j*BS + BS - 1 < next_query_position - W + 1. Its table entry becomes
        ``NULL_BLOCK``. Returns the freed physical blocks (a block a forked sibling still holds
        stays used). No-op without a window. Call it after the step's slots are reserved, with the
        step's first query.
        """
        seq = self._get(seq_id)
        if self.sliding_window is None:
            return []
        # blocks 0 .. dead - 1 are behind the window
        dead = max(0, next_query_position - self.sliding_window + 1) // self.block_size
        freed = []
        for j in range(min(dead, len(seq.block_table))):
            block = seq.block_table[j]
            if block != NULL_BLOCK:
                self.allocator.free(block)
                seq.block_table[j] = NULL_BLOCK
                freed.append(block)
        return freed

    def take_moves(self) -> list[BlockMove]:
        """The block copies decided since the last call, in order (the KV pool must do them
        before the next forward); the list is handed over and cleared."""
        moves, self._moves = self._moves, []
        return moves

    def host_usage(self) -> SwapUsage:
        """The host tier, in blocks: ``used_blocks`` counts those holding offloaded K/V."""
        pool = self.host_allocator
        if pool is None:
            return SwapUsage(0, 0, 0)
        return SwapUsage(pool.num_blocks, pool.num_cached, pool.num_free)

    def _offload(self, block: int, h: str) -> None:
        """The device evicts cached ``block`` (hash ``h``): keep its K/V in the host tier. Already
        there: nothing to copy (it goes back to the host's evictor: under LRU, the most recently
        used). Host tier full of pinned blocks: dropped."""
        held = self.host_cache.lookup(h)
        if held is not None:
            self.host_allocator.incref(held)
            self.host_allocator.free(held)  # back in the host evictor, most recently used
            return
        if self.host_allocator.num_available == 0:
            return
        host = self.host_allocator.allocate()  # a free host block, or the host evictor's victim
        self.host_cache.register(host, h)
        self.host_allocator.free(host)  # refcount 0 with a hash: free but cached, on the host
        self._moves.append(BlockMove("offload", block, host))
        self.num_offloaded += 1

    def _reload(self, host: int, block: int) -> int:
        """Copy host block ``host`` back into fresh device ``block`` (registered under its hash at
        once: the copy is done before the next forward, before anyone can read it)."""
        self._moves.append(BlockMove("reload", host, block))
        self.prefix_cache.register(block, self.host_cache.hash_of(host))
        self.host_allocator.free(host)  # unpinned: stays cached on the host (back in its evictor)
        self.num_reloaded += 1
        return block

    def swap_usage(self) -> SwapUsage:
        pool = self.swap_allocator
        if pool is None:
            return SwapUsage(0, 0, 0)
        return SwapUsage(pool.num_blocks, pool.num_used, pool.num_free)

    def usage(self) -> BlockUsage:
        """Blocks and slots in use; a shared block's filled slots are counted once."""
        filled: dict[int, int] = {}  # physical block -> tokens it holds
        for seq in self._seqs.values():
            for i, block in enumerate(seq.block_table):
                if block == NULL_BLOCK:
                    continue
                in_block = min(self.block_size, seq.num_tokens - i * self.block_size)
                filled[block] = max(filled.get(block, 0), in_block)
        used_blocks = self.allocator.num_used
        reserved = used_blocks * self.block_size
        used = sum(filled.values())
        return BlockUsage(
            total_blocks=self.allocator.num_blocks,
            used_blocks=used_blocks,
            free_blocks=self.allocator.num_free,
            reserved_slots=reserved,
            used_slots=used,
            wasted_slots=reserved - used,
            cached_blocks=self.allocator.num_cached,
        )

    # ---- the prefix cache (chapter 06; engine/kv/prefix_cache.py) -------------------------------
    def find_cached_prefix(self, token_ids: list[int], extra_keys: tuple,
                           max_tokens: int) -> list[int | HostBlock]:
        """The blocks holding the longest cached prefix of ``token_ids`` (whole blocks, at most
        ``max_tokens`` tokens), to pass to ``allocate``; [] when prefix caching is off. A block
        found only in the host tier is a ``HostBlock`` (``allocate`` reloads it into a fresh
        device block).

        The caller caps ``max_tokens`` at len(token_ids) - 1: the last token is always fed again,
        because sampling needs its logits (a fully cached prompt would leave nothing to run)::

            tokens  a b c d | e f g h | i j          BS = 4, blocks 0 and 1 cached
            hit     [7, 2]  -> 8 tokens; prefill i j only
        """
        if self.prefix_cache is None or max_tokens < self.block_size:
            return []
        blocks: list[int | HostBlock] = []
        for h in block_hashes(token_ids[:max_tokens], self.block_size, extra_keys):
            block = self.prefix_cache.lookup(h)
            on_host = self.host_cache.lookup(h) if self.host_cache is not None else None
            if block is None and on_host is not None:
                block = HostBlock(on_host)  # copied back by allocate
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_blocks(self, seq_id: int, token_ids: list[int], extra_keys: tuple,
                     num_computed: int) -> None:
        """The K/V of the sequence's first ``num_computed`` tokens is written (the forward ran):
        register its full blocks in the prefix cache, so later requests can share them. A no-op
        without a cache.

        We hash only the blocks that filled since the last call (the chain continues from the last
        hash), and offer only the blocks not offered yet (a swap-in's fresh copies start again from
        block 0), so a step's cost is its new full blocks, not the whole table.
        """
        if self.prefix_cache is None:
            return
        seq = self._get(seq_id)
        full = min(num_computed, seq.num_tokens) // self.block_size
        known = len(seq.block_hashes)
        if full > known:
            parent = seq.block_hashes[-1] if known else None
            seq.block_hashes += block_hashes(token_ids[:full * self.block_size], self.block_size,
                                             extra_keys, start=known, parent=parent)
        for i in range(seq.num_registered, full):
            if seq.block_table[i] != NULL_BLOCK:
                self.prefix_cache.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered = max(seq.num_registered, full)

    def cached_block_ids(self) -> list[int]:
        """The free-but-cached blocks in eviction order, the next victim first."""
        return self.prefix_cache.evictable() if self.prefix_cache else []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name). Only when no sequence holds a device block: a
        block in use keeps its contents, and its holder may still rely on its hash. Returns False
        (nothing changed) otherwise; True when cleared (or there is no cache)."""
        if self.prefix_cache is None:
            return True
        if self.allocator.num_used:
            return False
        self.allocator.drop_cached()
        if self.host_allocator is not None:
            self.host_allocator.drop_cached()
        for seq in self._swapped.values():
            seq.block_hashes = []  # rehashed (and registered again) after their next forward
        return True

    # ---- helpers ---------------------------------------------------------------------------
    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            swapped = " (it is swapped out: swap_in first)" if seq_id in self._swapped else ""
            raise ValueError(f"unknown sequence id {seq_id!r}; live ids: {sorted(self._seqs)}"
                             + swapped) from None

    def _get_swapped(self, seq_id: int) -> _Sequence:
        try:
            return self._swapped[seq_id]
        except KeyError:
            raise ValueError(f"sequence {seq_id!r} is not swapped out; swapped ids: "
                             f"{sorted(self._swapped)}") from None

    def _last_block_is_shared_and_partial(self, seq: _Sequence) -> bool:
        # The last block is never NULL_BLOCK: the newest token is inside every window.
        partial = seq.num_tokens % self.block_size != 0
        return partial and self.allocator.refcount(seq.block_table[-1]) > 1

    def _blocks_needed_to_allocate(self, num_tokens: int, cached_blocks: list[int]) -> int:
        """New blocks, plus the cached blocks that a hit takes out of the evictor (refcount 0
        now)."""
        on_device = [b for b in cached_blocks if not isinstance(b, HostBlock)]
        revived = sum(1 for b in on_device if self.allocator.refcount(b) == 0)
        return self.blocks_for(num_tokens) - len(on_device) + revived

    def _blocks_needed_to_append(self, seq: _Sequence, num_new_tokens: int) -> int:
        if num_new_tokens <= 0:
            return 0
        cow = 1 if self._last_block_is_shared_and_partial(seq) else 0
        return cow + self.blocks_for(seq.num_tokens + num_new_tokens) - len(seq.block_table)


def _held(table: list[int]) -> list[int]:
    """The blocks a table really holds: without the ``NULL_BLOCK`` entries a sliding window
    freed."""
    return [b for b in table if b != NULL_BLOCK]


def _refill(table: list[int], blocks: list[int]) -> list[int]:
    """``table`` with its held entries replaced, in order, by ``blocks`` (NULL_BLOCK entries
    stay)."""
    it = iter(blocks)
    return [b if b == NULL_BLOCK else next(it) for b in table]

"""Chapter 08: which replica serves a request. Routing policies as pure logic:
no processes, no clocks.

Replicas are the simplest way to use more devices: N full copies of the engine, each with its own
weights and its own KV pool, and a router in front that sends every request to one of them. Nothing
is split, so nothing is communicated per token; the whole question is WHERE each request goes:

                      ┌──► replica 0   (LLMEngine, own KV pool, own prefix cache)
    request ──► router├──► replica 1
                      └──► replica 2

    round_robin        0, 1, 2, 0, 1, 2, ...      blind to load: two long requests can land on
                                                  one replica
    least_outstanding  the replica with the fewest requests in flight (ties: the lowest index)
    prefix_aware       the replica that already served this prompt's prefix (its prefix cache holds
                       the K/V: a hit), else least_outstanding

A router counts what it sent and what came back: `pick(prompt_token_ids)` returns a replica index
and counts one more request in flight there, `on_finish(replica)` counts one fewer. It never sees
the replicas themselves, so every policy here can be tested with a fake workload and a fake clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.kv.prefix_cache import block_hashes

# How many leading full blocks of a prompt name its prefix for prefix_aware routing. Deeper keys
# tell apart prompts that share a long system prompt but differ later (different documents,
# different chat histories); each costs one sha256 per request. 32 blocks = 512 tokens at the
# default block size 16.
MAX_PREFIX_BLOCKS = 32
# The prefix table holds at most this many block hashes (LRU): about 100 bytes each, a few hundred
# KB. A replica's own prefix cache forgets blocks too (it evicts them when the pool is full), so a
# table much bigger than all the replicas' KV pools together would only remember prefixes nobody
# holds any more.
MAX_PREFIX_ENTRIES = 4096
# A hot prefix (one system prompt for everybody) would send EVERY request to the one replica that
# served it first. We give up a hit when that replica has more than this many requests in flight
# beyond the least busy one: a hit saves one prefill, a queue that long costs every request on that
# replica its TTFT.
MAX_IMBALANCE = 8


class Router:
    """What every policy shares: the count of requests in flight per replica,
    and the pick/finish protocol.

    Subclasses write `_choose(prompt_token_ids) -> replica`; `pick` counts the choice.
    """

    name = "router"

    def __init__(self, num_replicas: int):
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        self.num_replicas = num_replicas
        # requests in flight per replica (picked, not yet finished)
        self.outstanding = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests ever sent to each replica

    def pick(self, prompt_token_ids: Sequence[int]) -> int:
        """The replica that should serve this prompt;
        counts it as one more request in flight there."""
        replica = self._choose(prompt_token_ids)
        self.outstanding[replica] += 1
        self.routed[replica] += 1
        return replica

    def on_finish(self, replica: int) -> None:
        """A request that `pick` sent to `replica` finished (or was aborted):
        one fewer in flight there."""
        if (isinstance(replica, bool) or not isinstance(replica, int)
                or not 0 <= replica < self.num_replicas):
            raise ValueError(f"replica must be an index in [0, {self.num_replicas}), "
                             f"got {replica!r}")
        if self.outstanding[replica] == 0:
            raise ValueError(f"on_finish({replica}): replica {replica} has no request in flight; "
                             "call on_finish once per request that pick() sent there")
        self.outstanding[replica] -= 1

    def least_outstanding(self) -> int:
        """The replica with the fewest requests in flight; ties go to the lowest index."""
        return min(range(self.num_replicas), key=lambda i: (self.outstanding[i], i))

    def _choose(self, prompt_token_ids: Sequence[int]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    """Replicas in turn, whatever they are doing: fair in COUNT,
    blind to how long each request runs."""

    name = "round_robin"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._next = 0

    def _choose(self, prompt_token_ids: Sequence[int]) -> int:
        replica, self._next = self._next, (self._next + 1) % self.num_replicas
        return replica


class LeastOutstanding(Router):
    """The replica with the fewest requests in flight (ties: the lowest index).

    A replica stuck with a long request keeps its count up until that request finishes, so new
    requests flow around it: this balances what round robin cannot see, how LONG requests run.
    """

    name = "least_outstanding"

    def _choose(self, prompt_token_ids: Sequence[int]) -> int:
        return self.least_outstanding()


class PrefixAware(Router):
    """Send a prompt to the replica that served its prefix before,
    so that replica's prefix cache hits.

    We name a prefix the way the engine's prefix cache names its blocks (engine/kv/prefix_cache.py):
    a hash chain over full blocks of token ids, so key i names the whole prefix
    tokens[0 : (i+1) * BS], where BS = block_size::

        prompt  [ 4 system-prompt blocks ][ question ... ]
        keys    h0   h1   h2   h3   h4 ...              the first MAX_PREFIX_BLOCKS full blocks
        table   h0 -> 1, h1 -> 1, h2 -> 1, h3 -> 1      (from an earlier prompt replica 1 served)

    We look for the DEEPEST key in the table (the longest prefix served before) and go to its
    replica; no key found (a new prefix, or a prompt shorter than one block): least outstanding.
    Then every key of this prompt points at the replica we chose. The table is an LRU of at most
    `max_entries` keys.

    The table is a guess about the replicas' caches, not a view of them: a replica may have evicted
    the blocks since. A wrong guess costs a prefill, never a wrong answer. Our keys carry no model
    id, template or tenant (the engine's do): with tenant-private caching, prompts equal across
    tenants route together but do not share blocks. The `max_imbalance` guard keeps one hot prefix
    from piling everything on one replica (see MAX_IMBALANCE).
    """

    name = "prefix_aware"

    def __init__(self, num_replicas: int, block_size: int = 16,
                 max_prefix_blocks: int = MAX_PREFIX_BLOCKS,
                 max_entries: int = MAX_PREFIX_ENTRIES, max_imbalance: int = MAX_IMBALANCE):
        super().__init__(num_replicas)
        for field, value, low in (("block_size", block_size, 1),
                                  ("max_prefix_blocks", max_prefix_blocks, 1),
                                  ("max_entries", max_entries, 1),
                                  ("max_imbalance", max_imbalance, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PrefixAware: {field} must be an integer >= {low}, got {value!r}")
        self.block_size, self.max_prefix_blocks = block_size, max_prefix_blocks
        self.max_entries, self.max_imbalance = max_entries, max_imbalance
        # block-chain hash -> replica, least recent first
        self._table: OrderedDict[str, int] = OrderedDict()
        self.prefix_matches = 0  # picks that followed a prefix seen before

    def __len__(self) -> int:
        return len(self._table)

    def prefix_keys(self, prompt_token_ids: Sequence[int]) -> list[str]:
        """The hash chain of the prompt's first `max_prefix_blocks` full blocks
        (none for a short prompt)."""
        head = list(prompt_token_ids[:self.max_prefix_blocks * self.block_size])
        return block_hashes(head, self.block_size, extra_keys=())

    def _choose(self, prompt_token_ids: Sequence[int]) -> int:
        keys = self.prefix_keys(prompt_token_ids)
        replica = self._deepest_match(keys)
        if replica is None:
            replica = self.least_outstanding()
        else:
            self.prefix_matches += 1
        for key in keys:
            self._table[key] = replica
            self._table.move_to_end(key)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)  # the least recently routed prefix
        return replica

    def _deepest_match(self, keys: list[str]) -> int | None:
        """The replica of the longest known prefix that is not too far above the least busy
        replica."""
        least = min(self.outstanding)
        for key in reversed(keys):
            replica = self._table.get(key)
            if replica is not None and self.outstanding[replica] - least <= self.max_imbalance:
                return replica
        return None


ROUTERS = {cls.name: cls for cls in (RoundRobin, LeastOutstanding, PrefixAware)}


def make_router(name: str, num_replicas: int, block_size: int = 16) -> Router:
    """A router by name: "round_robin", "least_outstanding" or "prefix_aware" (which needs the
    engines' `block_size`, so that its keys cover the same full blocks their prefix caches
    share)."""
    if name not in ROUTERS:
        raise ValueError(f"router={name!r} is not a routing policy; "
                         f"choose one of {', '.join(ROUTERS)}")
    if name == PrefixAware.name:
        return PrefixAware(num_replicas, block_size)
    return ROUTERS[name](num_replicas)

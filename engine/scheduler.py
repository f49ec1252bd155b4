"""Chapter 05: the scheduler decides, at every step, which tokens of which requests run next.

Static batching (the baseline) admits a batch and runs it until its LAST request finishes; a
short request's slot sits idle while a long one decodes. Continuous batching admits new requests
at every step, so a finished request's place is refilled at once:

    step       1  2  3  4  5  6  7  8  9                  P prefill  d decode  . waiting
    static     A: P  d  d  d                               (A, B batch; C must wait for B)
               B: P  d  d  d  d  d  d
               C: .  .  .  .  .  .  .  P  d
    continuous A: P  d  d  d
               B: P  d  d  d  d  d  d
               C: .  .  .  .  P  d  d  d  d                (C takes A's place at step 5)

One `schedule()` builds one step, in this order (vLLM's):
1. running requests, decodes first (one token each), then unfinished prefills (a chunk each);
   if one needs a KV block and none is free, we PREEMPT a victim (below) until it fits;
2. if nobody was preempted in this step: swapped requests come back (swap in), then waiting
   requests are admitted in (priority, arrival) order while the token budget, `max_num_seqs`,
   the tenant's quota and the free blocks allow. The first waiting request that does not fit
   stops admission (FCFS: nobody overtakes it), except one blocked only by its tenant's quota.

Every step stays within `max_num_batched_tokens` tokens (prefill chunk tokens + one per decode).

Sliding window: once a request's slots for a step are reserved, the blocks that no query of this
step or later can read (wholly before the window of its first query) go back to the pool at once
(`BlockManager.free_out_of_window`); a "window_freed" event names them.

Prefix caching (chapter 06): a request that holds no blocks yet (new, or back after a recompute
preemption) first looks up its longest cached prefix in whole blocks, at most all its tokens but the
last (whose logits we sample from). It shares those blocks and starts with num_computed_tokens at
the hit, so only the rest is prefilled; the blocks a hit takes out of the evictor count against the
free ones at admission. A "prefix_hit" event records each lookup.

The victim: among the running requests not yet scheduled in this step (and the needy request
itself), the one with the LOWEST priority (largest number), then the LATEST arrival. This is
vLLM's choice: the newest request has the least work to lose and the least waiting behind it,
and the oldest request always makes progress, so the engine never livelocks. We never undo work
already scheduled in this step. Preemption is by:
- recompute: free its blocks, put it back in `waiting`; later its prompt AND outputs so far are
  prefilled again (cheap for short sequences, costs compute);
- swap: copy its blocks to a CPU-side pool and free the GPU ones; later copy them back (costs
  transfers, no compute). When the CPU pool is full we fall back to recompute.

The scheduler only decides (queues, victims, who runs). The block manager owns every block table,
the CPU swap pool's included, and the engine's KV pool (engine/kv/kv_pool.py) moves the tensors:
`SchedulerOutput` lists the block copies it must do before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv.block_manager import BlockManager, BlockMove, HostBlock
from engine.request import RUNNING, SWAPPED, WAITING, Request


@dataclass
class ScheduledWork:
    """Feed positions [start, end) of `request`; score (keep the logits of) its last `num_scored`
    positions.

    A plain step scores one position, the last, when `end` is the request's last known token (it
    samples the next token from it), and none for a prefill chunk that stops short of the prompt's
    end. A decode that verifies k guessed tokens (speculative decoding, chapter 12) feeds its last
    token and the k guesses, positions [start, start + k + 1), and scores all k + 1 of them
    (`scored=k + 1`): the logits at each say whether the next guess was right.

        all_token_ids  ... o4 o5 |                  num_tokens = start + 1
        fed                 o5 g1 g2 g3             draft_token_ids = [g1, g2, g3], end = start + 4
        scored              r0 r1 r2 r3             r_i: the target's logits after fed token i
    """

    request: Request
    start: int
    end: int
    phase: str  # "prefill" or "decode"
    slots: list[int]  # KV slot of each fed position
    scored: int | None = None  # positions whose logits are kept; None: 1 if it samples, else 0
    draft_token_ids: list[int] = field(default_factory=list)  # guesses fed after the last token

    def __post_init__(self) -> None:
        if self.scored is not None and not 0 <= self.scored <= self.end - self.start:
            raise ValueError(f"scored={self.scored} must be in [0, {self.end - self.start}] "
                             "(the fed positions)")

    @property
    def samples(self) -> bool:
        """Does this work end at the request's last known token (so it chooses the next)?"""
        return self.end - len(self.draft_token_ids) == self.request.num_tokens

    def fed_token_ids(self) -> list[int]:
        """The tokens at positions [start, end): the request's own, then any guesses."""
        known = self.request.all_token_ids[self.start:self.end]
        return known + self.draft_token_ids if self.draft_token_ids else known

    @property
    def num_scored(self) -> int:
        """How many rows of logits this work needs: its last `num_scored` fed positions."""
        return int(self.samples) if self.scored is None else self.scored


@dataclass
class SchedulerOutput:
    work: list[ScheduledWork] = field(default_factory=list)
    # (GPU block, CPU block), copy first
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, GPU block)
    # (src, dst) GPU copy-on-write
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # every copy above and the host tier's, in order
    moves: list[BlockMove] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    budget_left: int = 0
    preempted: bool = False

    @property
    def num_scored(self) -> int:
        """Rows of logits the step's forward keeps (the LM head runs on these only)."""
        return sum(w.num_scored for w in self.work)


def rank(req: Request) -> tuple:
    """Sort key: higher priority (lower number) first, then earlier arrival."""
    return (req.priority, req.arrival_time, req.seq_id)


class Scheduler:
    """Waiting, running and swapped queues over one BlockManager (it also holds the swap pool)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.token_budget = config.max_num_batched_tokens or max_model_len
        if not config.enable_chunked_prefill and self.token_budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.token_budget} is below the context "
                f"({max_model_len}) with enable_chunked_prefill=False, so a long prompt could "
                "never run: raise it or enable chunking")
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []

    # ---- queues -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fork(self, parent: Request, child: Request) -> None:
        """child (a sample of parent's request) starts running on parent's KV blocks, shared."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RUNNING
        self.running.append(child)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request from its queue and free all its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        if req.seq_id in self.block_manager or self.block_manager.is_swapped(req.seq_id):
            self.block_manager.free(req.seq_id)  # its device blocks, or its CPU swap blocks

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(budget_left=self.token_budget)
        if self.config.policy == "static" and not self.running and not self.swapped:
            self._admit_static_batch(out)
        scheduled: set[int] = set()
        self._schedule_running(out, scheduled)
        if not out.preempted:
            self._swap_in(out)
            if self.config.policy == "continuous":
                self._admit_waiting(out)
        # the KV pool does them, in this order, before the forward
        out.moves = self.block_manager.take_moves()
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[int]) -> None:
        order = sorted(self.running, key=rank)
        decodes_first = ([r for r in order if r.is_decoding]
                         + [r for r in order if not r.is_decoding])
        for req in decodes_first:
            if req.status != RUNNING:  # preempted earlier in this loop, as someone's victim
                continue
            # a static batch's request holds no block until it first runs
            hit = self._cached_prefix(req)
            n = self._num_new_tokens(req, out.budget_left, hit)
            k = self._guesses_that_fit(req, n, out)
            if n and self._make_room(req, n + k, out, scheduled, hit):
                self._schedule(req, n + k, out, hit, req.draft_token_ids[:k])
                scheduled.add(req.seq_id)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        for req in sorted(self.waiting, key=rank):
            if not self._has_seats(req):
                return  # its n samples will all run
            if not self._tenant_has_room(req):
                continue  # a quota blocks only its own tenant
            hit = self._cached_prefix(req)
            n = self._num_new_tokens(req, out.budget_left, hit)
            if n == 0 or not self.block_manager.can_allocate(self._computed(req, hit) + n, hit):
                return  # FCFS: nobody overtakes the first request that does not fit
            self._move(req, self.waiting, self.running, RUNNING)
            out.events.append({"type": "admitted", "request_id": req.request_id,
                               "after_preemption": req.preempted})
            req.preempted = False
            self._schedule(req, n, out, hit)

    def _admit_static_batch(self, out: SchedulerOutput) -> None:
        """Static policy: take the next batch of up to max_num_seqs requests as a whole. Their
        blocks are allocated when each is first scheduled (the token budget may spread the batch's
        prefills over a few steps); no one else joins until the whole batch has finished."""
        for req in sorted(self.waiting, key=rank):
            if not self._has_seats(req):
                return
            if self._tenant_has_room(req):
                self._move(req, self.waiting, self.running, RUNNING)
                out.events.append({"type": "admitted", "request_id": req.request_id,
                                   "after_preemption": req.preempted})
                req.preempted = False

    def _swap_in(self, out: SchedulerOutput) -> None:
        bm = self.block_manager
        for req in sorted(self.swapped, key=rank):
            if not self._has_seats(req) or not self._tenant_has_room(req):
                return
            n = self._num_new_tokens(req, out.budget_left)
            if n == 0 or not bm.can_swap_in(req.seq_id, n):
                return
            out.swap_in += bm.swap_in(req.seq_id)
            self._move(req, self.swapped, self.running, RUNNING)
            req.preempted = False
            out.events.append({"type": "swapped_in", "request_id": req.request_id})
            self._schedule(req, n, out)

    # ---- helpers ------------------------------------------------------------------------------
    def _seats_taken(self) -> int:
        """Sequences running now plus those already promised a seat: a running sample 0 that has
        not sampled yet will fork its `pending_forks` at its first token, with no admission in
        between."""
        return sum(1 + len(r.pending_forks) for r in self.running)

    def _has_seats(self, req: Request) -> bool:
        """Whether req and the samples it will fork fit under max_num_seqs (a hard limit)."""
        return self._seats_taken() + 1 + len(req.pending_forks) <= self.config.max_num_seqs

    def _cached_prefix(self, req: Request) -> list[int]:
        """For a request that holds no blocks yet (new, or back after a recompute preemption): the
        cached blocks of its longest cached prefix, at most num_tokens - 1 tokens (its last token is
        fed again: sampling needs its logits). [] when it holds blocks already, or prefix caching is
        off."""
        if req.seq_id in self.block_manager or req.params.prompt_logprobs is not None:
            return []  # (prompt logprobs: every prompt position must be computed, vLLM's rule)
        return self.block_manager.find_cached_prefix(req.all_token_ids, req.cache_key,
                                                     req.num_tokens - 1)

    def _computed(self, req: Request, hit: list[int]) -> int:
        """Tokens whose K/V is in the cache: computed by req, or found cached (a hit on a new
        request)."""
        return req.num_computed_tokens + len(hit) * self.block_manager.block_size

    def _num_new_tokens(self, req: Request, budget_left: int, hit: list[int] = ()) -> int:
        """How many of req's uncomputed tokens fit in this step (0: none, wait for the next)."""
        remaining = req.num_tokens - self._computed(req, hit)
        if self.config.enable_chunked_prefill:
            chunk = self.config.max_prefill_chunk_tokens or remaining
            return min(remaining, chunk, budget_left)
        return remaining if remaining <= budget_left else 0

    def _guesses_that_fit(self, req: Request, n: int, out: SchedulerOutput) -> int:
        """How many of a decoding request's guesses (chapter 12) this step verifies: as many as the
        token budget and the free KV blocks allow WITHOUT preempting anyone (a guess is a bet; it
        never costs another request its seat). Guesses that do not fit are dropped, with why."""
        guesses = req.draft_token_ids
        if not guesses or n != 1 or not req.is_decoding:
            return 0
        k = min(len(guesses), out.budget_left - 1)
        why = "token budget"
        while k and not self.block_manager.can_append_slots(req.seq_id, 1 + k):
            k, why = k - 1, "no free KV block"
        if k < len(guesses):
            out.events.append({"type": "drafts_cut", "request_id": req.request_id,
                               "proposed": len(guesses), "kept": k, "reason": why})
        return k

    def _schedule(self, req: Request, n: int, out: SchedulerOutput, hit: list[int] = (),
                  guesses: list[int] = ()) -> None:
        """Reserve KV slots for n more tokens of req (the caller checked there is room) and record
        it. `hit`: the cached blocks a request that holds no blocks yet starts with (prefix
        caching). `guesses`: the last len(guesses) of the n tokens are a proposer's guesses, fed
        after req's last token to be verified (chapter 12); the engine rolls back the rejected."""
        bm = self.block_manager
        if req.seq_id in bm:
            appended = bm.append_slots(req.seq_id, n)
            slots = appended.slots
            out.block_copies += appended.copies
        else:  # first time it runs (or again after a recompute preemption): share what is cached
            req.num_computed_tokens = start = self._computed(req, hit)
            bm.allocate(req.seq_id, start + n, hit)
            slots = bm.slot_mapping(req.seq_id, range(start, start + n))
            if bm.prefix_cache is not None:
                # reloaded from the host tier
                from_host = sum(isinstance(b, HostBlock) for b in hit) * bm.block_size
                out.events.append({"type": "prefix_hit", "request_id": req.request_id,
                                   "num_tokens": start, "num_query_tokens": req.num_tokens,
                                   "num_host_tokens": from_host})
        start = req.num_computed_tokens
        # sliding window: blocks no query can read again
        freed = bm.free_out_of_window(req.seq_id, start)
        if freed:
            out.events.append({"type": "window_freed", "request_id": req.request_id,
                               "blocks": freed})
        phase = "decode" if req.is_decoding else "prefill"
        req.num_computed_tokens = start + n
        out.budget_left -= n
        scored = len(guesses) + 1 if guesses else None
        if phase == "prefill" and req.params.prompt_logprobs is not None:
            scored = n  # every fed position: each predicts the prompt token after it
        out.work.append(ScheduledWork(req, start, start + n, phase, slots, scored, list(guesses)))

    def _has_room(self, req: Request, n: int, hit: list[int] = ()) -> bool:
        bm = self.block_manager
        if req.seq_id in bm:
            return bm.can_append_slots(req.seq_id, n)
        return bm.can_allocate(self._computed(req, hit) + n, hit)

    def _make_room(self, req: Request, n: int, out: SchedulerOutput, scheduled: set[int],
                   hit: list[int] = ()) -> bool:
        """Preempt victims until req's n tokens fit; False when req itself had to go (or wait).
        (Preempting only frees blocks, never evicts one, so the cached blocks in `hit` stay
        valid.)"""
        while not self._has_room(req, n, hit):
            candidates = [r for r in self.running if r.seq_id not in scheduled]
            victim = max(candidates, key=rank)  # lowest priority, then latest arrival
            if victim is req and req.seq_id not in self.block_manager:
                return False  # it holds nothing yet (static batch, not started): it simply waits
            self._preempt(victim, out, f"no free KV block for request {req.request_id}")
            if victim is req:
                return False
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput, reason: str) -> None:
        swapped = self.config.preemption_mode == "swap" and self._swap_out(victim, out)
        mode = "swap" if swapped else "recompute"
        if mode == "recompute":
            if victim.seq_id in self.block_manager:
                self.block_manager.free(victim.seq_id)
            victim.num_computed_tokens = 0
            self._move(victim, self.running, self.waiting, WAITING)
        victim.preempted = True
        victim.num_preemptions += 1
        out.preempted = True
        out.events.append({"type": "preempted", "request_id": victim.request_id, "mode": mode,
                           "reason": reason})

    def _swap_out(self, victim: Request, out: SchedulerOutput) -> bool:
        """Copy victim's blocks to the CPU pool (False: nothing to swap, or the pool is too
        full)."""
        bm = self.block_manager
        if victim.seq_id not in bm or not bm.can_swap_out(victim.seq_id):
            return False
        out.swap_out += bm.swap_out(victim.seq_id)
        self._move(victim, self.running, self.swapped, SWAPPED)
        return True

    def _tenant_has_room(self, req: Request) -> bool:
        quota = self.config.tenant_quota(req.tenant)
        return quota is None or sum(r.tenant == req.tenant for r in self.running) < quota

    @staticmethod
    def _move(req: Request, src: list[Request], dst: list[Request], status: str) -> None:
        src.remove(req)
        dst.append(req)
        req.status = status


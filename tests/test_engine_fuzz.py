"""Issue 9: a seeded fuzz of the whole engine. No request, however bad, breaks the engine or the others.

Each trial draws a configuration (policy, preemption mode, a tiny pool, chunked prefill or not, prefix
caching or not, with or without a host tier, a sliding window or not) and then, step by step: arrivals
(n up to 3, some starting with an earlier prompt), bad prompts (which must raise and leave no trace),
aborts of whole requests, of single samples "<id>#i" and of finished ones, and now and then a step whose
forward or sampler raises. After EVERY step we check the invariants below; at the end every request
is finished, the greedy outputs of the ones that were neither aborted nor failed equal the naive loop's
(and the others' are a prefix of it), and every block is free (or free but cached).
"""

import functools
import random
import warnings
from collections import Counter

import numpy as np
import pytest

from engine import llm_engine, runner
from engine.companions.naive import generate_naive
from engine.llm_engine import LLMEngine, engine_config
from engine.request import RUNNING, SWAPPED, WAITING
from engine.sampling import SamplingParams
from engine_fixtures import VOCAB, random_model

NUM_TRIALS = 30  # about 10 s on one core
MAX_STEPS = 1000  # far above what a trial needs: a stuck engine fails instead of hanging
BLOCK_SIZE = 4
MAX_PROMPT, MAX_OUT = 20, 10
MIN_BLOCKS = -(-(MAX_PROMPT + MAX_OUT - 1) // BLOCK_SIZE)  # the largest request fits alone (its last token: never fed)
BAD_PROMPTS = [[VOCAB], [5000], [-1], [2.5], [True], [], None, [[3, 4]], b"\x03", [3, "x"], "text", {3}]

MODEL = random_model(seed=7)


@functools.cache
def naive_tokens(prompt: tuple[int, ...], max_tokens: int, window: int | None = None) -> list[int]:
    """The oracle: the no-cache loop, with the same sliding-window mask as the engine's."""
    MODEL.config.sliding_window = window
    try:
        return generate_naive(MODEL, None, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens)).token_ids
    finally:
        MODEL.config.sliding_window = None


class FailSwitch:
    """Stands in for one of llm_engine's functions; when armed, its next call raises (then it disarms)."""

    def __init__(self, real):
        self.real, self.armed = real, False

    def __call__(self, *args, **kwargs):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected failure")
        return self.real(*args, **kwargs)


def random_config(rng: random.Random) -> dict:
    config = dict(policy=rng.choice(["continuous", "static"]), preemption_mode=rng.choice(["recompute", "swap"]),
                  num_blocks=rng.randint(MIN_BLOCKS, MIN_BLOCKS + 6), block_size=BLOCK_SIZE,
                  max_num_seqs=rng.randint(2, 5), enable_chunked_prefill=rng.random() < 0.5,
                  swap_space_blocks=rng.choice([None, 3, 8]), enable_prefix_caching=rng.random() < 0.5,
                  sliding_window=rng.choice([None, None, 3, 6, 11]))
    if config["enable_prefix_caching"]:
        config["kv_offload_blocks"] = rng.choice([0, 2, 12])
    if config["enable_chunked_prefill"]:
        config |= dict(max_num_batched_tokens=rng.choice([8, 16]), max_prefill_chunk_tokens=rng.choice([4, 8, None]))
    return config


# ---- the invariants, checked after every step -----------------------------------------------------


def check_invariants(engine: LLMEngine) -> None:
    s, bm = engine.scheduler, engine.block_manager
    limit = engine.config.scheduler.max_num_seqs
    assert len(s.running) <= limit and s._seats_taken() <= limit
    check_refcounts(bm.allocator, [bm.block_table(q) for q in bm.seq_ids()])
    if bm.swap_allocator is not None:
        check_refcounts(bm.swap_allocator, [bm.swap_table(q) for q in bm.swapped_seq_ids()])
    if bm.host_allocator is not None:  # every host block is free, or free but cached (none pinned between steps)
        host = bm.host_usage()
        check_refcounts(bm.host_allocator, [])
        assert host.used_blocks + host.free_blocks == host.total_blocks == bm.host_cache.num_hashes + host.free_blocks
    assert set(bm.seq_ids()) <= {r.seq_id for r in s.running}  # only running sequences hold device blocks
    assert set(bm.swapped_seq_ids()) == {r.seq_id for r in s.swapped}
    check_registration(engine)


def check_refcounts(allocator, tables: list[list[int]]) -> None:
    """Every block's reference count is the number of block-table entries that hold it."""
    holders = Counter(block for table in tables for block in table)
    assert [allocator.refcount(b) for b in range(allocator.num_blocks)] == [
        holders[b] for b in range(allocator.num_blocks)]


def check_registration(engine: LLMEngine) -> None:
    """No request is half-registered: an unfinished sequence is in exactly one place (its queue, or its
    sample 0's pending forks); a finished one is nowhere and holds nothing."""
    s, bm = engine.scheduler, engine.block_manager
    place = {id(r): status for status, queue in ((WAITING, s.waiting), (RUNNING, s.running), (SWAPPED, s.swapped))
             for r in queue}
    assert len(place) == len(s.waiting) + len(s.running) + len(s.swapped)  # nobody queued twice
    pending = Counter(id(f) for r in engine.requests.values() for f in r.pending_forks)
    for rid, req in engine.requests.items():
        assert req.request_id == rid
        if req.is_finished:
            assert id(req) not in place and id(req) not in pending
            assert req.seq_id not in bm and not bm.is_swapped(req.seq_id)
        elif id(req) in pending:
            assert pending[id(req)] == 1 and id(req) not in place and req.samples[0].status != "finished"
        else:
            assert place.get(id(req)) == req.status
    queued = s.waiting + s.running + s.swapped
    assert all(engine.requests.get(r.request_id) is r for r in queued)


# ---- one trial ------------------------------------------------------------------------------------


class Trial:
    def __init__(self, seed: int, switches: dict[str, FailSwitch], speed: str):
        self.rng, self.switches = random.Random(seed), switches
        self.config = random_config(self.rng)
        self.engine = LLMEngine(MODEL, None, engine_config(model="random", speed=speed, **self.config))
        self.expected: dict[str, tuple[tuple[int, ...], int]] = {}  # sample id -> (prompt, max_tokens)
        self.to_arrive = self.rng.randint(3, 9)

    def run(self) -> None:
        rng, engine = self.rng, self.engine
        for _ in range(MAX_STEPS):
            for _ in range(rng.choice([0, 0, 1, 2])):
                self.arrive()
            if rng.random() < 0.2:
                self.bad_request()
            if rng.random() < 0.15 and self.expected:
                self.abort()
            if not engine.has_unfinished_requests():
                if self.to_arrive == 0:
                    return
                continue
            if rng.random() < 0.06:
                self.failing_step()
            else:
                report = engine.step()
                assert report.num_tokens <= engine.scheduler.token_budget
            check_invariants(engine)
        raise AssertionError(f"the engine did not finish in {MAX_STEPS} steps")

    def arrive(self) -> None:
        if self.to_arrive == 0:
            return
        self.to_arrive -= 1
        rng = self.rng
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, MAX_PROMPT))]
        if self.expected and rng.random() < 0.4:  # an earlier prompt's start: prefix-cache (and host-tier) hits
            earlier = rng.choice([p for p, _ in self.expected.values()])
            prompt = (list(earlier) + prompt)[:MAX_PROMPT]
        max_tokens, n = rng.randint(1, MAX_OUT), rng.choice([1, 1, 2, 3])
        params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens)
        given = [np.int64(t) for t in prompt] if rng.random() < 0.2 else prompt  # numpy ids are fine too
        if n > self.engine.config.scheduler.max_num_seqs:
            self.expect_rejected(lambda: self.engine.add_request(given, params), ValueError)
            return
        rid = self.engine.add_request(given, params, priority=rng.randint(0, 2))
        for seq in self.engine.get_request(rid).samples:
            self.expected[seq.request_id] = (tuple(prompt), max_tokens)

    def bad_request(self) -> None:
        prompt = self.rng.choice(BAD_PROMPTS)
        self.expect_rejected(lambda: self.engine.add_request(prompt, SamplingParams(max_tokens=3)),
                             (ValueError, TypeError))

    def expect_rejected(self, call, errors) -> None:
        """The call raises, and leaves no trace: same requests, queues, block tables, pending events."""
        before = state_of(self.engine)
        with pytest.raises(errors, match="request '"):  # the message names the request
            call()
        assert state_of(self.engine) == before

    def abort(self) -> None:
        """Abort a whole request, one sample, or something already finished (or unknown)."""
        target = self.rng.choice([*self.expected, "no-such-id"])
        req = self.engine.requests.get(target)
        group = [] if req is None else req.samples if req.index == 0 else [req]
        live = [s for s in group if not s.is_finished]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert self.engine.abort_request(target) is bool(live)
        assert all(s.finish_reason == "abort" for s in live)

    def failing_step(self) -> None:
        """The sequences the step ran fail, with the samples waiting to fork from them; nobody else."""
        forks = {rid: [f.request_id for f in r.pending_forks] for rid, r in self.engine.requests.items()}
        self.switches[self.rng.choice(list(self.switches))].armed = True
        with pytest.raises(RuntimeError, match="injected failure"):
            self.engine.step()
        for switch in self.switches.values():
            switch.armed = False
        report = self.engine.trace[-1]
        ran = {s.request_id for s in report.scheduled}
        failed = {rid for rid, why in report.queues.finished.items() if why == "error"}
        assert ran and failed == ran | {f for rid in ran for f in forks[rid]}

    def check_outcome(self) -> None:
        engine = self.engine
        for rid, (prompt, max_tokens) in self.expected.items():
            seq, expected = engine.get_request(rid), naive_tokens(prompt, max_tokens, self.config["sliding_window"])
            assert seq.is_finished
            if seq.finish_reason in ("abort", "error"):  # what it produced before is still right
                assert seq.output_token_ids == expected[: len(seq.output_token_ids)]
            else:  # the others' aborts, failures and preemptions did not change a single token
                assert seq.output_token_ids == expected
        assert engine.block_manager.usage().used_blocks == 0 and engine.block_manager.seq_ids() == []
        assert engine.block_manager.swap_usage().used_blocks == 0


def state_of(engine: LLMEngine) -> tuple:
    s, bm = engine.scheduler, engine.block_manager
    return (list(engine.requests), [[r.request_id for r in q] for q in (s.waiting, s.running, s.swapped)],
            {q: bm.block_table(q) for q in bm.seq_ids()}, bm.usage(), len(engine._events))


@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_random_arrivals_aborts_bad_prompts_and_failing_steps_never_break_the_engine(monkeypatch, speed):
    modules = {"run_model": runner, "sample": llm_engine}  # where each is looked up at call time
    switches = {name: FailSwitch(getattr(module, name)) for name, module in modules.items()}
    for name, switch in switches.items():
        monkeypatch.setattr(modules[name], name, switch)
    seen = Counter()
    for seed in range(NUM_TRIALS):
        trial = Trial(seed, switches, speed)
        try:
            trial.run()
            trial.check_outcome()
        except AssertionError as e:
            raise AssertionError(f"trial seed={seed} speed={speed} config={trial.config}: {e}") from e
        for report in trial.engine.trace.steps:
            seen.update(e.get("mode", e.get("reason", e["type"])) for e in report.events)
            moved = [e for e in report.events if e["type"] == "blocks_moved"]
            seen.update(k for e in moved for k in ("offload", "reload") if k in e)
    # the fuzz really went where it should: both preemption modes, forks, aborts, failed steps
    assert all(seen[kind] > 0 for kind in ("swap", "recompute", "forked", "aborted", "error", "window_freed",
                                           "offload", "reload")), seen

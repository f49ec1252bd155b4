"""Checks for chapter 05: a scheduling step, the preemption victim, TTFT/TPOT from a trace, and
static batching's idle seats.

Each `check_<claim>(mod)` runs against the student's `exercises/ch05_scheduling.py` or the reference
in `exercises/solutions/`. The answers come from small cases worked out by hand in the comments, and
from the engine itself: `engine.scheduler.Scheduler` deciding the same steps,
`engine.scheduler.rank` choosing the same victims, `engine.companions.metrics` reading the same
times, and a static-policy `LLMEngine` run whose step count shows the idle seats.
"""

from __future__ import annotations

import math
import random

import torch

from engine.companions.metrics import requests_from_trace
from engine.config import ModelConfig, SchedulerConfig
from engine.kv.block_manager import BlockManager
from engine.llm_engine import LLMEngine, engine_config
from engine.model import LlamaModel
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, rank
from engine.trace import ScheduledRequest, StepReport, Trace
from exercises.checks import raises

SEED = 5  # chapter 05: any fixed seed makes a failure reproducible
ROUNDS = 60  # scheduler steps in the random comparison: queues fill, drain and refill several times
ABS_TOL = 1e-9  # seconds read from the same floats: only the order of subtraction may differ


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=0, abs_tol=ABS_TOL)




# ---- one scheduling step -------------------------------------------------------------------------


def check_schedule_step_admits_until_the_first_request_that_does_not_fit(mod) -> None:
    # The stub's docstring: a, b run (2 tokens, 1 block); c fits (9 tokens, 2 blocks: 0 blocks
    # left); d needs a block: admission stops there, and e (which would fit) must not overtake d.
    got = mod.schedule_step([("a", 1, 0), ("b", 1, 1)], [("c", 9, 2), ("d", 2, 1), ("e", 1, 0)],
                            token_budget=16, max_num_seqs=4, free_blocks=3)
    assert tuple(got) == (["a", "b"], ["c"]), (
        f"got {got}, expected (['a', 'b'], ['c']): e must not overtake d")
    # Budget: 10 tokens; "big" (20) does not fit, so "small" waits too (FCFS), though it would fit.
    got = mod.schedule_step([], [("big", 20, 1), ("small", 1, 0)], token_budget=10, max_num_seqs=8,
                            free_blocks=9)
    assert tuple(got) == ([], []), f"got {got}, expected ([], []): nobody overtakes 'big'"


def check_schedule_step_lets_a_running_request_sit_out_and_keeps_going(mod) -> None:
    # Budget 4: a (1) runs -> 3 left; p (5 tokens) sits out; b (1) still runs -> 2 left; c (2)
    # admitted, using the budget up exactly (a request that fits exactly, fits).
    got = mod.schedule_step([("a", 1, 0), ("p", 5, 1), ("b", 1, 0)], [("c", 2, 0)],
                            token_budget=4, max_num_seqs=8, free_blocks=10)
    assert tuple(got) == (["a", "b"], ["c"]), (
        f"got {got}, expected (['a', 'b'], ['c']): p sits out, b still runs, c fills the "
        "budget exactly")
    # No free block: x needs one and sits out; y needs none and runs.
    got = mod.schedule_step([("x", 1, 1), ("y", 1, 0)], [],
                            token_budget=8, max_num_seqs=4, free_blocks=0)
    assert tuple(got) == (["y"], []), (
        f"got {got}, expected (['y'], []): x needs a block and none is free")


def check_schedule_step_counts_every_running_request_against_max_num_seqs(mod) -> None:
    # a runs, b (100 tokens) sits out but still holds a seat: 2 seats taken of 3, so only c joins.
    got = mod.schedule_step([("a", 1, 0), ("b", 100, 0)], [("c", 1, 0), ("d", 1, 0)],
                            token_budget=10, max_num_seqs=3, free_blocks=5)
    assert tuple(got) == (["a"], ["c"]), f"got {got}, expected (['a'], ['c']): b still holds a seat"


def _request(rid: str, seq_id: int, prompt_len: int, max_tokens: int, arrival: float) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, seq_id, None, [3] * prompt_len, params, arrival)


def _as_exercise_input(sched: Scheduler) -> tuple[list, list]:
    """The scheduler's queues as (id, new tokens, new blocks),
    in the order Scheduler.schedule uses."""
    bm = sched.block_manager

    def blocks(req: Request, n: int) -> int:
        held = len(bm.block_table(req.seq_id)) if req.seq_id in bm else 0
        return bm.blocks_for(req.num_computed_tokens + n) - held

    order = sorted(sched.running, key=rank)
    running = [r for r in order if r.is_decoding] + [r for r in order if not r.is_decoding]
    return ([(r.request_id, r.num_uncomputed_tokens, blocks(r, r.num_uncomputed_tokens))
             for r in running],
            [(r.request_id, r.num_uncomputed_tokens, blocks(r, r.num_uncomputed_tokens))
             for r in sorted(sched.waiting, key=rank)])


def check_schedule_step_matches_the_engine_scheduler(mod) -> None:
    """Random arrivals into a real Scheduler; every step without a preemption must match."""
    rng = random.Random(SEED)
    budget, max_seqs, block_size = 24, 4, 4
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                      BlockManager(num_blocks=20, block_size=block_size), max_model_len=budget)
    compared, seq_id = 0, 0
    for step in range(ROUNDS):
        for _ in range(rng.choice((0, 0, 1, 2))):
            sched.add(_request(f"q{seq_id}", seq_id, rng.randint(1, 20), rng.randint(1, 12),
                               float(step)))
            seq_id += 1
        running, waiting = _as_exercise_input(sched)
        free = sched.block_manager.allocator.num_free
        out = sched.schedule()
        admitted = [e["request_id"] for e in out.events if e["type"] == "admitted"]
        ran = [w.request.request_id for w in out.work if w.request.request_id not in admitted]
        if not out.preempted:
            got = mod.schedule_step(running, waiting, budget, max_seqs, free)
            assert tuple(got) == (ran, admitted), (
                f"step {step}: running={running}, waiting={waiting}, budget {budget}, "
                f"max_num_seqs {max_seqs}, free blocks {free}: got {got}, the engine ran {ran} and "
                f"admitted {admitted}")
            compared += 1
        # pretend the forward ran: each request that reached its end gets a token
        for w in out.work:
            if w.samples and w.request.append_token(7):
                w.request.finish("length", float(step))
                sched.finish(w.request)
    assert compared >= ROUNDS // 2, f"only {compared} steps were compared (too many preemptions)"


# ---- the preemption victim -----------------------------------------------------------------------


def check_choose_victim_takes_the_lowest_priority_then_the_latest_arrival(mod) -> None:
    # Priority 1 is served after priority 0, so b and c are the candidates; b arrived later.
    got = mod.choose_victim([("a", 0, 9.0), ("b", 1, 0.5), ("c", 1, 0.2)])
    assert got == "b", f"got {got!r}, expected 'b' (lowest priority 1, then the latest arrival 0.5)"
    got = mod.choose_victim([("x", 0, 1.0), ("y", 0, 1.0), ("z", 0, 0.3)])
    assert got == "y", f"got {got!r}, expected 'y': x and y tie, and y comes last in the list"
    assert raises(lambda: mod.choose_victim([]), ValueError), (
        "choose_victim([]) must raise ValueError")


def check_choose_victim_matches_the_engine_rank(mod) -> None:
    rng = random.Random(SEED)
    for trial in range(200):
        n = rng.randint(1, 6)
        # ties on purpose
        cands = [(f"r{i}", rng.randint(0, 2), float(rng.randint(0, 3))) for i in range(n)]
        reqs = [Request(rid, i, None, [3], SamplingParams(), arrival, priority)
                for i, (rid, priority, arrival) in enumerate(cands)]
        want = max(reqs, key=rank).request_id
        got = mod.choose_victim(cands)
        assert got == want, (
            f"trial {trial}: candidates {cands}: got {got!r}, the engine picks {want!r}")


# ---- TTFT and TPOT from a trace ------------------------------------------------------------------


def _hand_trace() -> Trace:
    """a: arrives 0.5, tokens at 1.0, 2.0, 3.5, finishes at 3.5
          -> TTFT 0.5, TPOT (3.5 - 1.0) / 2 = 1.25.
    b: arrives 1.5, a prefill chunk with no token at 2.0, tokens at 3.5 and 4.0
       -> TTFT 2.0, TPOT 0.5.
    c: arrives 1.5, one token at 2.0 and finishes -> TTFT 0.5, TPOT nan.
    d: never runs -> absent."""
    def arrived(rid, t):
        return {"type": "arrived", "request_id": rid, "arrival_time": t, "num_prompt_tokens": 4}

    def run(rid, phase, out):
        return ScheduledRequest(rid, phase, 0, 1, out)

    def finished(rid):
        return {"type": "finished", "request_id": rid, "reason": "stop"}

    steps = [
        StepReport(0, 0.6, 1.0, scheduled=[run("a", "prefill", 1)], events=[arrived("a", 0.5)]),
        StepReport(1, 1.6, 2.0,
                   scheduled=[run("a", "decode", 1), run("b", "prefill", 0),
                              run("c", "prefill", 1)],
                   events=[arrived("b", 1.5), arrived("c", 1.5), arrived("d", 1.7), finished("c")]),
        StepReport(2, 2.1, 3.5, scheduled=[run("a", "decode", 1), run("b", "prefill", 1)],
                   events=[finished("a")]),
        StepReport(3, 3.6, 4.0, scheduled=[run("b", "decode", 1)], events=[finished("b")]),
    ]
    return Trace(steps=steps)


def _check_times(got, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: got requests {sorted(got)}, expected {sorted(want)}"
    for rid, (ttft, tpot) in want.items():
        g_ttft, g_tpot = got[rid]
        assert _close(g_ttft, ttft) and _close(g_tpot, tpot), (
            f"{where}: request {rid}: got (TTFT, TPOT) = ({g_ttft}, {g_tpot}), expected "
            f"({ttft}, {tpot})")


def check_ttft_and_tpot_of_a_hand_made_trace(mod) -> None:
    want = {"a": (0.5, 1.25), "b": (2.0, 0.5), "c": (0.5, math.nan)}
    trace = _hand_trace()
    _check_times(mod.ttft_and_tpot(trace), want, "a Trace")
    _check_times(mod.ttft_and_tpot([s.to_dict() for s in trace.steps]), want,
                 "a list of step dicts")


def _tiny_model() -> LlamaModel:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(SEED)
    return LlamaModel(cfg).eval()


def check_ttft_and_tpot_match_the_engine_trace(mod) -> None:
    """A real run with staggered arrivals and chunked prefill;
    engine.companions.metrics reads the same times."""
    config = engine_config(model="tiny", max_num_seqs=3, block_size=4, enable_chunked_prefill=True,
                           max_num_batched_tokens=8)
    engine = LLMEngine(_tiny_model(), None, config)
    rng = random.Random(SEED)
    for _ in range(6):  # one arrival per step, while earlier ones prefill in chunks and decode
        ids = [rng.randint(3, 63) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 6), ignore_eos=True)
        engine.add_request(ids, params)
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    want = {r.request_id: (r.ttft_s, r.tpot_s) for r in requests_from_trace(engine.trace)}
    _check_times(mod.ttft_and_tpot(engine.trace), want, "an engine trace")


# ---- static batching's idle seats ----------------------------------------------------------------


def check_static_idle_fraction_by_hand(mod) -> None:
    # [4, 1 | 1, 2] two at a time: seats 2 x 4 + 2 x 2 = 12, tokens 8 -> 1 - 8/12 = 1/3.
    got = mod.static_idle_fraction([4, 1, 1, 2], 2)
    assert math.isclose(got, 1 / 3), f"static_idle_fraction([4, 1, 1, 2], 2) = {got}, expected 1/3"
    # One request of 5 tokens alone in a batch of 4 seats: 20 seat-steps, 5 used -> 0.75.
    got = mod.static_idle_fraction([5], 4)
    assert math.isclose(got, 0.75), (
        f"static_idle_fraction([5], 4) = {got}, expected 0.75 (empty seats count)")
    got = mod.static_idle_fraction([3, 3, 3], 3)
    assert got == 0.0, f"equal lengths in full batches waste nothing, got {got}"
    for bad in (([], 2), ([0, 2], 2), ([2], 0)):
        assert raises(lambda b=bad: mod.static_idle_fraction(*b), ValueError), (
            f"static_idle_fraction{bad} must raise ValueError")


def check_static_idle_fraction_matches_a_static_engine_run(mod) -> None:
    """The engine's static policy, all requests at once: each batch takes as many steps as its
    longest request (the prefill step makes the first token), so seats x steps - tokens are the idle
    seats."""
    seats, lengths = 3, [5, 1, 2, 6, 6, 1, 3]
    engine = LLMEngine(_tiny_model(), None, engine_config(model="tiny", policy="static",
                                                          max_num_seqs=seats, block_size=4))
    for n in lengths:
        engine.add_request([5, 6, 7],
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    tokens = sum(s.tokens_out for report in engine.trace.steps for s in report.scheduled)
    want = 1 - tokens / (seats * len(engine.trace))
    got = mod.static_idle_fraction(lengths, seats)
    assert math.isclose(got, want), (
        f"static_idle_fraction({lengths}, {seats}) = {got}; the engine's run says {want}")

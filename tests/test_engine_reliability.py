"""Chapter 05, property tests: random arrivals, aborts and tiny pools never lose a request, never leak
a block, and never change the tokens of the requests that were not aborted."""

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import llm_engine, runner
from engine.companions.naive import generate_naive
from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine_fixtures import VOCAB, random_model

MAX_STEPS = 2000  # far above what any example needs: a stuck engine fails instead of hanging
BLOCK_SIZE = 4
MAX_PROMPT, MAX_OUT = 24, 12
MIN_BLOCKS = -(-(MAX_PROMPT + MAX_OUT) // BLOCK_SIZE)  # the largest request must fit alone




MODEL = random_model(seed=5)


@functools.cache
def naive_tokens(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return generate_naive(MODEL, None, list(prompt), params).token_ids



@st.composite
def prompts(draw) -> list[int]:
    """A prompt of 1..MAX_PROMPT tokens (the length drawn first, so long prompts are common)."""
    length = draw(st.integers(1, MAX_PROMPT))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return torch.randint(2, VOCAB, (length,), generator=g).tolist()


requests = st.lists(
    st.tuples(
        prompts(),
        st.integers(1, MAX_OUT),  # max_tokens
        st.integers(0, 4),  # the step at which it arrives
        st.integers(0, 2),  # priority
        st.one_of(st.none(), st.none(), st.integers(0, 12)),  # the step at which it is aborted (None: never)
        st.sampled_from([1, 1, 2]),  # n: samples forked from the prompt's blocks
    ),
    min_size=2, max_size=8,
)
configs = st.fixed_dictionaries({
    "policy": st.sampled_from(["continuous", "static"]),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "num_blocks": st.integers(MIN_BLOCKS, MIN_BLOCKS + 4),
    "max_num_seqs": st.integers(2, 6),
    "enable_chunked_prefill": st.booleans(),
    "swap_space_blocks": st.sampled_from([None, 4]),
})


def run(reqs, config) -> tuple[LLMEngine, dict[str, int]]:
    """Add and abort requests between steps as scheduled; returns the engine and id -> index in reqs."""
    options = dict(config, block_size=BLOCK_SIZE)
    if options["enable_chunked_prefill"]:
        options |= dict(max_num_batched_tokens=16, max_prefill_chunk_tokens=8)
    engine = LLMEngine(MODEL, None, engine_config(**options))
    ids: dict[str, int] = {}
    for step in range(MAX_STEPS):
        for i, (prompt, max_tokens, arrive, priority, _, n) in enumerate(reqs):
            if arrive == step:
                params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens)
                rid = engine.add_request(prompt, params, priority=priority)
                ids[rid] = i
        for rid, i in ids.items():
            if reqs[i][4] == step and not engine.get_request(rid).is_finished:
                engine.abort_request(rid)
        if step > max(r[2] for r in reqs) and not engine.has_unfinished_requests():
            return engine, ids
        report = engine.step()
        assert report.num_tokens <= engine.scheduler.token_budget
        check_block_owners(engine)
    raise AssertionError(f"the engine did not finish {len(reqs)} requests in {MAX_STEPS} steps")


def check_block_owners(engine: LLMEngine) -> None:
    """Only running requests hold GPU blocks, only swapped ones CPU blocks, and the pools agree."""
    sched, bm = engine.scheduler, engine.block_manager
    assert set(bm.seq_ids()) <= {r.seq_id for r in sched.running}
    assert set(bm.swapped_seq_ids()) == {r.seq_id for r in sched.swapped}
    assert bm.swap_usage().used_blocks == sum(len(bm.swap_table(s)) for s in bm.swapped_seq_ids())
    held = {block for seq in bm.seq_ids() for block in bm.block_table(seq)}  # forked samples share
    assert bm.usage().used_blocks == len(held)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, config=configs)
def test_every_request_finishes_or_is_aborted_and_no_block_leaks(reqs, config):
    engine, ids = run(reqs, config)
    assert len(ids) == len(reqs)
    kinds = {e["type"] for report in engine.trace.steps for e in report.events}
    # counted by `--hypothesis-show-statistics`: do the examples really preempt and abort?
    event(f"preempted: {'preempted' in kinds}, aborted: {'aborted' in kinds}")
    for rid, i in ids.items():
        expected = naive_tokens(tuple(reqs[i][0]), reqs[i][1])
        for seq in engine.get_request(rid).samples:  # greedy: every sample is the naive output
            assert seq.is_finished
            if seq.finish_reason == "abort":  # what it produced before the abort is still right
                assert seq.output_token_ids == expected[: len(seq.output_token_ids)]
            else:  # others' aborts and preemptions did not change a single token
                assert seq.output_token_ids == expected
    assert engine.block_manager.usage().used_blocks == 0
    assert engine.block_manager.swap_usage().used_blocks == 0


# ---- issue 9: a failing step, the max_num_seqs limit, aborting what is left of a request ----------


class FailingCall:
    """Wraps a function so that its `fail_at`-th call (1-based) raises, like an out-of-memory in one forward."""

    def __init__(self, real, fail_at: int):
        self.real, self.fail_at, self.calls = real, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated out of memory in step")
        return self.real(*args, **kwargs)


def greedy_workload(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(2, VOCAB, (int(torch.randint(1, MAX_PROMPT, (1,), generator=g)),), generator=g).tolist(),
             SamplingParams(temperature=0, max_tokens=int(torch.randint(2, MAX_OUT, (1,), generator=g))))
            for _ in range(n)]


@pytest.mark.parametrize("where", ["run_model", "sample"])  # in the forward, or after it (sampling)
def test_a_step_that_raises_fails_only_the_requests_it_ran_and_the_engine_goes_on(monkeypatch, where):
    work = greedy_workload(6, seed=1)
    engine = LLMEngine(MODEL, None, engine_config(max_num_seqs=3, num_blocks=40, block_size=BLOCK_SIZE))
    ids = [engine.add_request(p, sp) for p, sp in work]
    module = runner if where == "run_model" else llm_engine  # the forward runs in engine/runner.py
    monkeypatch.setattr(module, where, FailingCall(getattr(module, where), fail_at=3))
    engine.step(), engine.step()
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        engine.step()
    failed_step = engine.trace[-1]
    ran = {s.request_id for s in failed_step.scheduled}
    assert ran and {rid for rid, why in failed_step.queues.finished.items() if why == "error"} == ran
    assert {e["request_id"] for e in failed_step.events if e.get("reason") == "error"} == ran
    late = engine.add_request(*work[0])  # a request that arrives after the failure
    while engine.has_unfinished_requests():
        engine.step()  # raises no more: the failure was one step's
    for rid, (prompt, sp) in zip([*ids, late], [*work, work[0]], strict=True):
        req, expected = engine.get_request(rid), naive_tokens(tuple(prompt), sp.max_tokens)
        if rid in ran:
            assert req.finish_reason == "error" and "simulated out of memory" in req.error
            assert req.output_token_ids == expected[: len(req.output_token_ids)]
        else:
            assert req.finish_reason != "error" and req.output_token_ids == expected
    assert engine.block_manager.usage().used_blocks == 0 and engine.block_manager.seq_ids() == []


def test_llm_generate_warns_once_for_a_failing_step_and_returns_everyone_else(monkeypatch):
    work = greedy_workload(5, seed=2)
    monkeypatch.setattr(runner, "run_model", FailingCall(runner.run_model, fail_at=2))
    llm = LLM(MODEL, max_num_seqs=2)
    with pytest.warns(RuntimeWarning, match="a step raised RuntimeError") as caught:
        outputs = llm.generate([p for p, _ in work], [sp for _, sp in work], use_tqdm=False)
    assert len([w for w in caught if "a step raised" in str(w.message)]) == 1
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert 1 <= reasons.count("error") < len(work)
    for out, (prompt, sp) in zip(outputs, work, strict=True):
        expected, got = naive_tokens(tuple(prompt), sp.max_tokens), out.outputs[0]
        if got.finish_reason == "error":
            assert "simulated" in got.error and got.token_ids == expected[: len(got.token_ids)]
        else:
            assert got.token_ids == expected and got.error is None
    assert llm.engine.requests == {} and llm.engine.block_manager.usage().used_blocks == 0


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_max_num_seqs_counts_the_samples_a_running_request_will_fork(policy):
    """A = n=2, its prompt prefilled in chunks: its second sample appears only at its first token. B (which
    arrives right after A and outlives A's prefill) must not take that seat, or three sequences would run
    with max_num_seqs=2."""
    engine = LLMEngine(MODEL, None, engine_config(policy=policy, max_num_seqs=2, enable_chunked_prefill=True,
                                                  max_num_batched_tokens=8, max_prefill_chunk_tokens=4,
                                                  block_size=BLOCK_SIZE))
    prompt_a, params_a = list(range(2, 22)), SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)
    prompt_b, params_b = [7, 8, 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = engine.add_request(prompt_a, params_a)
    b = engine.add_request(prompt_b, params_b)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        assert len(engine.scheduler.running) <= 2
    assert most == 2  # A's two samples did run together
    for rid, prompt, params in ((a, prompt_a, params_a), (f"{a}#1", prompt_a, params_a), (b, prompt_b, params_b)):
        expected = generate_naive(MODEL, None, prompt, dataclasses.replace(params, n=1)).token_ids
        assert engine.get_request(rid).output_token_ids == expected


def test_aborting_a_request_stops_its_other_samples_after_sample_0_has_finished():
    """Sampled (temperature > 0) samples end at different steps; we look for a seed where sample 0 ends
    first (EOS), then abort the request by its id."""
    params = SamplingParams(n=2, temperature=4.0, max_tokens=MAX_PROMPT + MAX_OUT, min_tokens=0)
    for seed in range(200):
        engine = LLMEngine(MODEL, None, engine_config(block_size=BLOCK_SIZE))
        rid = engine.add_request([5, 6, 7], dataclasses.replace(params, seed=seed))
        head, other = engine.get_request(rid).samples
        while engine.has_unfinished_requests() and not head.is_finished:
            engine.step()
        if head.is_finished and not other.is_finished:
            break
    else:
        raise AssertionError("no seed made sample 0 finish before sample 1")
    assert engine.abort_request(rid) is True
    assert other.finish_reason == "abort" and head.finish_reason != "abort"
    assert not engine.has_unfinished_requests() and engine.block_manager.usage().used_blocks == 0
    with pytest.warns(UserWarning, match="already finished"):
        assert engine.abort_request(rid) is False  # now nothing is left to stop

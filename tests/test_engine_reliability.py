"""Chapter 05, property tests: random arrivals, aborts and tiny pools never lose a request, never leak
a block, and never change the tokens of the requests that were not aborted."""

import functools

import torch
from engine_fixtures import VOCAB, random_model
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.llm_engine import LLMEngine, engine_config
from engine.naive import generate_naive
from engine.sampling import SamplingParams

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
    assert set(sched.swap_tables) == {r.seq_id for r in sched.swapped}
    if sched.swap_pool is not None:
        assert sched.swap_pool.num_used == sum(len(t) for t in sched.swap_tables.values())
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
    pool = engine.scheduler.swap_pool
    assert pool is None or pool.num_used == 0

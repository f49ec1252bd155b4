"""Chapter 08: replicas behind a router. The policies as pure logic (a fake workload, a fake clock), then the
pool: in this process (deterministic, for prefix-cache hits) and as real replica processes (greedy outputs
equal a single engine's; a killed replica is a clear error, never a hang)."""

import os
import random
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.prefix_cache import block_hashes
from engine.llm import LLM
from engine.loading.loader import load_model
from engine.replicas.replicas import ReplicaError, ReplicaPool
from engine.replicas.router import LeastOutstanding, PrefixAware, RoundRobin, Router, make_router
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["12+7=", "Once upon a time", [5, 6, 7, 8, 9, 10], "34-5=", "The cat", [40, 41, 42]]
FIRST_ID = 3  # tinylab's ids 0-2 are pad, BOS and EOS: random prompts draw from the rest


@pytest.fixture(scope="module")
def tinylab():
    return load_model("tinylab")


@pytest.fixture(scope="module")
def reference(tinylab):
    """The oracle: one plain engine, every prompt at once."""
    model, tokenizer = tinylab
    return LLM(model, tokenizer).generate(PROMPTS, GREEDY, use_tqdm=False)


def same_outputs(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == \
            [(c.token_ids, c.text, c.finish_reason) for c in w.outputs]


# ---- routers: pure logic ------------------------------------------------------------------------------
def test_round_robin_cycles_through_the_replicas_whatever_their_load():
    router = RoundRobin(3)
    picks = [router.pick([1]) for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert router.outstanding == [3, 2, 2] and router.routed == [3, 2, 2]


def test_least_outstanding_picks_the_fewest_in_flight_and_breaks_ties_by_the_lowest_index():
    router = LeastOutstanding(3)
    assert [router.pick([1]) for _ in range(3)] == [0, 1, 2]  # all tied at each pick: lowest index
    router.on_finish(1)
    assert router.pick([1]) == 1  # the only one with nothing in flight
    router.on_finish(2)
    router.on_finish(0)
    assert router.outstanding == [0, 1, 0]
    assert router.pick([1]) == 0 and router.pick([1]) == 2


def test_on_finish_refuses_a_replica_with_nothing_in_flight_or_out_of_range():
    router = LeastOutstanding(2)
    router.pick([1])
    with pytest.raises(ValueError, match="replica 1 has no request in flight"):
        router.on_finish(1)
    with pytest.raises(ValueError, match=r"replica must be an index in \[0, 2\), got 2"):
        router.on_finish(2)
    assert router.outstanding == [1, 0]


def test_make_router_names_the_allowed_policies_for_an_unknown_name():
    with pytest.raises(ValueError, match="'random'.*round_robin, least_outstanding, prefix_aware"):
        make_router("random", 2)
    with pytest.raises(ValueError, match="num_replicas must be an integer >= 1, got 0"):
        make_router("round_robin", 0)
    assert isinstance(make_router("prefix_aware", 2, block_size=8), PrefixAware)
    assert make_router("prefix_aware", 2, block_size=8).block_size == 8


def max_outstanding(router: Router, durations: list[int]) -> int:
    """A fake clock: request t arrives at tick t and holds its replica for durations[t] ticks. Returns the
    most requests any replica ever had in flight."""
    in_flight, worst = [], 0  # (end tick, replica)
    for tick, duration in enumerate(durations):
        for _end, replica in [f for f in in_flight if f[0] <= tick]:
            router.on_finish(replica)
        in_flight = [f for f in in_flight if f[0] > tick]
        in_flight.append((tick + duration, router.pick([1, 2, 3])))
        worst = max(worst, *router.outstanding)
    return worst


def test_least_outstanding_balances_a_skewed_workload_better_than_round_robin():
    long, short = 10, 1  # ticks
    durations = [long, short] * 20  # round robin sends every long request to replica 0
    rr, lo = max_outstanding(RoundRobin(2), durations), max_outstanding(LeastOutstanding(2), durations)
    print(f"max in flight on one replica: round_robin {rr}, least_outstanding {lo}")
    assert lo < rr


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["round_robin", "least_outstanding", "prefix_aware"]),
       ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(3, 6), max_size=12)), max_size=40))
def test_every_router_counts_in_flight_as_picks_minus_finishes(name, ops):
    router, sent = make_router(name, 3, block_size=2), []
    for finish, prompt in ops:
        if finish and sent:
            router.on_finish(sent.pop(0))
        else:
            sent.append(router.pick(prompt))
    assert router.outstanding == [sent.count(i) for i in range(3)]


def test_prefix_aware_sends_a_known_prefix_back_to_its_replica_and_a_new_one_to_the_least_busy():
    router = PrefixAware(3, block_size=4)
    system_a, system_b = list(range(10, 22)), list(range(30, 42))  # 3 full blocks each
    first_a = router.pick(system_a + [1, 2])
    first_b = router.pick(system_b + [1, 2])
    assert (first_a, first_b) == (0, 1)  # new prefixes: least outstanding
    assert [router.pick(system_a + [i]) for i in range(3, 6)] == [first_a] * 3
    assert router.pick(system_b + [9, 9, 9]) == first_b
    assert router.pick(list(range(50, 62))) == 2  # new again: replica 2 has nothing in flight
    assert router.prefix_matches == 4


def test_prefix_aware_follows_the_longest_prefix_it_knows():
    router = PrefixAware(2, block_size=4, max_imbalance=0)
    shared, a, b = [7] * 4, [1, 2, 3, 4], [5, 6, 7, 8]
    assert router.pick(shared + a) == 0  # keys: shared -> 0, shared+a -> 0
    assert router.pick(shared + b) == 1  # replica 0 is busier: the hit is given up; shared -> 1 now
    assert router.pick(shared + a + [9]) == 0  # shared+a (2 blocks, on 0) beats shared (1 block, on 1)


def test_prefix_aware_keys_are_the_engines_block_hash_chain_of_the_first_full_blocks():
    router = PrefixAware(2, block_size=4, max_prefix_blocks=2)
    prompt = list(range(3, 14))  # 11 tokens: 2 full blocks, a partial one
    assert router.prefix_keys(prompt) == block_hashes(prompt[:8], 4, extra_keys=())
    assert router.prefix_keys(list(range(3, 30))) == block_hashes(list(range(3, 11)), 4, extra_keys=())
    assert router.prefix_keys([3, 4, 5]) == []  # shorter than a block: no key, least outstanding decides


def test_prefix_table_is_an_lru_bounded_by_max_entries():
    router = PrefixAware(2, block_size=2, max_prefix_blocks=1, max_entries=3)
    prompts = [[i, i] for i in range(10, 16)]  # 6 distinct one-block prefixes
    replicas = [router.pick(p) for p in prompts]
    assert len(router) == 3  # prompts 3, 4, 5 remembered, 3 the least recently used
    assert router.pick(prompts[3]) == replicas[3] and router.prefix_matches == 1  # now 4 is the LRU
    router.pick(prompts[0])  # forgotten long ago: no match; its key evicts prompt 4's
    assert router.prefix_matches == 1 and len(router) == 3
    router.pick(prompts[3])
    assert router.prefix_matches == 2  # used recently, so kept
    router.pick(prompts[4])
    assert router.prefix_matches == 2  # evicted


def test_prefix_aware_gives_up_a_hit_on_a_replica_far_busier_than_the_others():
    router = PrefixAware(2, block_size=2, max_imbalance=2)
    hot = [5, 5, 6, 6]
    picks = [router.pick(hot + [i]) for i in range(5)]
    # replica 0 takes the hot prefix until it runs 3 more than replica 1, then replica 1 gets one
    assert picks == [0, 0, 0, 1, 1]  # from the 4th on, the table points the hot prefix at replica 1
    assert max(router.outstanding) - min(router.outstanding) <= 3


# ---- the pool in this process -----------------------------------------------------------------------
def test_in_process_pool_greedy_outputs_equal_a_single_engine(reference):
    with ReplicaPool("tinylab", 2, router="round_robin", in_process=True) as pool:
        outs = pool.generate(PROMPTS, GREEDY)
        assert pool.last_placement == [0, 1, 0, 1, 0, 1]
        assert pool.router.outstanding == [0, 0]
    same_outputs(outs, reference)


def grouped_workload(num_groups: int, per_group: int, prefix_len: int, seed: int = 0):
    """num_groups shared prefixes, each followed by per_group distinct 3-token questions."""
    rng = random.Random(seed)
    groups = []
    for _ in range(num_groups):
        prefix = [rng.randrange(FIRST_ID, 1000) for _ in range(prefix_len)]
        groups.append([prefix + [rng.randrange(FIRST_ID, 1000) for _ in range(3)] for _ in range(per_group)])
    return groups


def prefix_hits(router: str, groups, block_size: int) -> tuple[int, list[int]]:
    """Serve each group's first request, then all the others (group by group, all at once); returns the
    replicas' own count of prefix-cache hit tokens in the second wave, and where it went."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with ReplicaPool("tinylab", 2, router=router, in_process=True, block_size=block_size,
                     enable_prefix_caching=True) as pool:
        pool.generate([g[0] for g in groups], params)
        before = sum(s.prefix_cache_hits for s in pool.stats())
        pool.generate([p for g in groups for p in g[1:]], params)
        return sum(s.prefix_cache_hits for s in pool.stats()) - before, pool.last_placement


def test_prefix_aware_gets_more_prefix_cache_hits_than_round_robin():
    block_size, prefix_len = 4, 24  # 6 full shared blocks per group
    groups = grouped_workload(num_groups=3, per_group=4, prefix_len=prefix_len)
    rr_hits, rr_where = prefix_hits("round_robin", groups, block_size)
    pa_hits, pa_where = prefix_hits("prefix_aware", groups, block_size)
    print(f"second-wave prefix-cache hit tokens: round_robin {rr_hits} {rr_where}, "
          f"prefix_aware {pa_hits} {pa_where}")
    second_wave = sum(len(g) - 1 for g in groups)
    assert pa_hits == second_wave * (prefix_len // block_size * block_size)  # every shared block, every time
    assert pa_hits > rr_hits


def test_a_prompt_a_replica_refuses_names_it_and_the_pool_keeps_serving(reference):
    bad = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[5000])  # outside the vocabulary
    long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # still running when the refusal comes
    with ReplicaPool("tinylab", 2, in_process=True) as pool:
        with pytest.raises(ValueError, match=r"prompts\[1\] \(on replica 1\).*stop_token_ids"):
            pool.generate(PROMPTS[:3], [long, bad, long])
        assert pool.router.outstanding == [2, 0]  # prompts[0] and [2] were aborted, not yet handed back
        outs = pool.generate(PROMPTS, GREEDY)
        assert pool.router.outstanding == [0, 0]
        aborted = [e["request_id"] for step in pool.engines[0].trace.steps for e in step.events
                   if e["type"] == "aborted"]
        assert aborted == ["0", "2"]  # recorded at the replica's next step
        assert all(not e.has_unfinished_requests() and not e.requests for e in pool.engines)
    same_outputs(outs, reference)


def test_a_bad_prompt_raises_before_anything_is_routed():
    with ReplicaPool("tinylab", 2, in_process=True) as pool:
        with pytest.raises(ValueError, match=r"prompts\[1\].*outside the model's vocabulary"):
            pool.generate(["1+1=", [5, 5000]], GREEDY)
        assert pool.router.routed == [0, 0]
        with pytest.raises(ValueError, match="arrival_times_s must be finite, >= 0 and non-decreasing"):
            pool.generate(["1+1=", "2+2="], GREEDY, arrival_times_s=[0.5, 0.1])


# ---- the pool of processes ----------------------------------------------------------------------------
def test_pool_of_processes_greedy_outputs_equal_a_single_engine(reference):
    arrivals = [0.0, 0.0, 0.02, 0.05, 0.05, 0.1]  # later prompts arrive while earlier ones are served
    with ReplicaPool("tinylab", 2, router="least_outstanding") as pool:
        outs = pool.generate(PROMPTS, GREEDY, arrival_times_s=arrivals)
        stats = pool.stats()
        assert set(pool.last_placement) == {0, 1}
        assert pool.router.outstanding == [0, 0]
    same_outputs(outs, reference)
    assert [s.requests_served for s in stats] == [pool.last_placement.count(i) for i in range(2)]
    assert sum(s.generated_tokens for s in stats) == sum(len(o.outputs[0].token_ids) for o in reference)
    assert len({s.pid for s in stats} | {os.getpid()}) == 3  # two processes of their own
    print("replica stats:", stats)


def test_a_killed_replica_raises_a_clear_error_instead_of_hanging():
    pool = ReplicaPool("tinylab", 2, router="round_robin")
    pids = pool.pids
    try:
        os.kill(pids[1], signal.SIGKILL)
        # timeout_s only so that a missed death fails with TimeoutError rather than hanging the suite
        with pytest.raises(ReplicaError, match=r"replica 1 died \(pid \d+ was killed by signal 9\).*shutdown"):
            pool.generate(["1+1=", "2+2="], GREEDY, timeout_s=60)
        with pytest.raises(ReplicaError, match="replica 1 died"):
            pool.generate(["1+1="], GREEDY)  # a broken pool stays broken
    finally:
        pool.shutdown()
    for pid in pids:  # both gone (and reaped), none left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

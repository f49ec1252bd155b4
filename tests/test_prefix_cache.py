"""Chapter 06: the prefix cache shares full KV blocks between requests with the same prefix, and never
changes a token: greedy outputs with it on equal those with it off and the naive loop's, under a fuzz of
shared prefixes, tenants, scopes, templates, aborts, both preemption modes, forks and chunked prefill.

The three classic bugs each have a test here that fails when the bug is planted:
(a) a fully cached prompt that does not recompute its last token,
(b) a stale hash after eviction (a block reused while its old hash still leads to it),
(c) a key without the model id, the template version or the tenant.
"""

import os
import random
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.patches import Patch

from engine.companions.metrics import prefix_cache_stats, trace_metrics
from engine.companions.naive import generate_naive
from engine.config import CacheConfig
from engine.kv.block_manager import BlockManager
from engine.kv.prefix_cache import PUBLIC_SCOPE, block_hash, block_hashes, cache_key, cache_scope, model_id
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine.trace import Trace
from engine.viz.blocks import CACHED_COLOR, FREE_COLOR, block_snapshot, render_block_grid
from engine_fixtures import VOCAB, random_model

BS = 4
MODEL = random_model(seed=5)
GREEDY = dict(temperature=0.0)


def naive(model, prompt, max_tokens) -> list[int]:
    return generate_naive(model, None, list(prompt), SamplingParams(max_tokens=max_tokens, **GREEDY)).token_ids


def new_engine(model=MODEL, **options) -> LLMEngine:
    options = dict(num_blocks=32, block_size=BS, max_num_seqs=4, enable_prefix_caching=True) | options
    return LLMEngine(model, None, engine_config(model="random", **options))


def run(engine: LLMEngine, prompt, max_tokens=4, **kwargs) -> str:
    """Add one request and step until everything finished; returns its id."""
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, **GREEDY), **kwargs)
    while engine.has_unfinished_requests():
        engine.step()
    return rid


def hit_tokens(engine: LLMEngine, rid: str) -> list[int]:
    """The prefix-cache hits (in tokens) reported for request rid, in order."""
    return [e["num_tokens"] for s in engine.trace.steps for e in s.events
            if e["type"] == "prefix_hit" and e["request_id"] == rid]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


# ---- the hash chain and the key -----------------------------------------------------------------------


def test_only_full_blocks_get_a_hash_and_each_names_its_whole_prefix():
    ids, key = tokens(10, 0), ("m", None, PUBLIC_SCOPE)
    hashes = block_hashes(ids, BS, key)
    assert len(hashes) == 10 // BS  # the partial last block (2 tokens) has none
    assert hashes[1] == block_hash(hashes[0], ids[4:8], key)  # chained on the parent
    # the same 4 tokens after another first block get another hash: a hash names the prefix, not the block
    other = block_hashes(tokens(4, 1) + ids[4:8], BS, key)
    assert other[1] != hashes[1]
    # hashing on from the middle continues the same chain
    assert block_hashes(ids, BS, key, start=1, parent=hashes[0]) == hashes[1:]


def test_every_extra_key_changes_every_block_hash():
    ids = tokens(8, 2)
    base = block_hashes(ids, BS, cache_key("m:1", None, "acme"))
    for key in (cache_key("m:2", None, "acme"), cache_key("m:1", "v2", "acme"), cache_key("m:1", None, "bob"),
                cache_key("m:1", None, "acme", scope="public")):
        assert all(a != b for a, b in zip(base, block_hashes(ids, BS, key), strict=True)), key


def test_block_hashes_are_the_same_in_another_python_process():
    """Python's hash() is salted per process; a stable hash gives the same value under any PYTHONHASHSEED."""
    ids, key = tokens(12, 3), ("m:1", "v1", "tenant:acme")
    code = f"from engine.kv.prefix_cache import block_hashes; print(block_hashes({ids}, {BS}, {key!r}))"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out == str(block_hashes(ids, BS, key))


def test_scope_is_private_to_a_tenant_by_default_and_public_on_request():
    assert cache_scope("acme") == cache_scope("acme", "private") == "tenant:acme"
    assert cache_scope("acme") != cache_scope("bob")
    assert cache_scope("acme", "public") == cache_scope("bob", "public") == cache_scope(None) == PUBLIC_SCOPE
    with pytest.raises(ValueError, match="cache_scope='private' needs a tenant"):
        cache_scope(None, "private")
    with pytest.raises(ValueError, match="cache_scope='shared' must be one of"):
        cache_scope("acme", "shared")


def test_the_model_id_follows_the_weights_and_nothing_else():
    a, b = random_model(seed=5), random_model(seed=5)
    ident = model_id("random", a.config, a.state_dict().items())
    assert ident == model_id("random", b.config, b.state_dict().items())  # same weights, same id
    assert ident != model_id("other", a.config, a.state_dict().items())
    with torch.no_grad():
        b.layers[1].mlp.down_proj.weight.mul_(1.01)  # one tensor of one layer changes
    assert ident != model_id("random", b.config, b.state_dict().items())


def test_enable_prefix_caching_must_be_a_bool_and_is_on_by_default():
    assert CacheConfig().enable_prefix_caching is True  # vLLM's default
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        CacheConfig(enable_prefix_caching="yes")


# ---- the engine: hits, and what they must never do --------------------------------------------------------


def test_a_shared_prefix_is_prefilled_once_and_the_rest_is_scheduled():
    engine, system = new_engine(), tokens(10, 4)
    first = run(engine, system + [7, 8, 9])
    second = run(engine, system + [20, 21])
    assert hit_tokens(engine, first) == [0]
    assert hit_tokens(engine, second) == [10 // BS * BS]  # two full blocks of the system prompt
    fed = [s for step in engine.trace.steps for s in step.scheduled if s.request_id == second]
    assert fed[0].start == 8 and fed[0].phase == "prefill"  # only positions 8.. were prefilled
    assert engine.get_request(second).output_token_ids == naive(MODEL, system + [20, 21], 4)


@pytest.mark.parametrize("length", [BS, 3 * BS, 3 * BS + 1])
def test_a_fully_cached_prompt_still_recomputes_its_last_token(length):
    """Bug (a): with every block of the prompt cached, the hit must stop short of the last token, whose
    logits the sampler needs. Planted (hit capped at num_tokens instead of num_tokens - 1), the second
    request has nothing left to run and the engine raises."""
    engine, prompt = new_engine(), tokens(length, 5)
    run(engine, prompt)
    again = run(engine, prompt)
    assert hit_tokens(engine, again) == [(length - 1) // BS * BS]
    assert engine.get_request(again).output_token_ids == naive(MODEL, prompt, 4)


def test_an_evicted_block_loses_its_hash_before_it_is_reused():
    """Bug (b): a pool just big enough for one request at a time, so every new prompt evicts the last one's
    cached blocks. Planted (evict without removing the hash), the old prompt's lookup finds blocks that
    now hold other tokens, and its output changes."""
    engine = new_engine(num_blocks=6, max_num_seqs=1)  # 24 slots: one request of up to 20 + 4 tokens
    first = tokens(16, 6)
    run(engine, first)
    for seed in range(7, 10):  # other prompts take every block: the first one's are evicted
        run(engine, tokens(16, seed))
    assert engine.block_manager.find_cached_prefix(first, engine.get_request("0").cache_key, 15) == []
    again = run(engine, first)
    assert hit_tokens(engine, again) == [0]
    assert engine.get_request(again).output_token_ids == naive(MODEL, first, 4)


def test_new_weights_never_read_the_old_weights_kv():
    """Bug (c), model: after the weights change in place and the id is refreshed, the same prompt misses
    and gives the new weights' tokens. Planted (no model id in the key), it is served the old KV."""
    model = random_model(seed=5)
    engine, prompt = new_engine(model), tokens(13, 11)
    run(engine, prompt, max_tokens=6)
    old_id = engine.model_id
    model.load_state_dict(random_model(seed=6).state_dict())  # a new checkpoint into the same model
    assert engine.refresh_model_id() != old_id
    again = run(engine, prompt, max_tokens=6)
    expected = naive(model, prompt, 6)
    assert hit_tokens(engine, again) == [0]
    assert engine.get_request(again).output_token_ids == expected
    assert expected != engine.get_request("0").output_token_ids  # the new weights really answer otherwise


def test_a_new_template_version_misses_and_the_same_one_hits():
    """Bug (c), template: the key holds the template version the caller names."""
    engine, prompt = new_engine(), tokens(12, 12)
    run(engine, prompt, template_version="v1")
    assert hit_tokens(engine, run(engine, prompt, template_version="v2")) == [0]
    assert hit_tokens(engine, run(engine, prompt, template_version="v1")) == [8]


def test_a_tenant_never_hits_another_tenants_private_blocks():
    """Bug (c), tenant: B guessing A's private prompt misses (no KV served, no timing signal); A hits."""
    engine, prompt = new_engine(), tokens(12, 13)
    run(engine, prompt, tenant="A")
    b = run(engine, prompt, tenant="B")
    assert hit_tokens(engine, b) == [0]
    assert engine.get_request(b).output_token_ids == naive(MODEL, prompt, 4)
    assert hit_tokens(engine, run(engine, prompt, tenant="A")) == [8]


def test_public_scope_shares_across_tenants_and_only_with_public_requests():
    engine, system = new_engine(), tokens(8, 14)
    run(engine, system + [3], tenant="A", cache_scope="public")
    assert hit_tokens(engine, run(engine, system + [4], tenant="B", cache_scope="public")) == [8]
    assert hit_tokens(engine, run(engine, system + [5], tenant="C")) == [0]  # C's private scope
    assert hit_tokens(engine, run(engine, system + [6])) == [8]  # no tenant: the public scope


def test_bad_cache_options_are_rejected_and_nothing_is_registered():
    engine = new_engine()
    with pytest.raises(ValueError, match="request '0'.*cache_scope"):
        engine.add_request([3, 4], cache_scope="shared")
    with pytest.raises(ValueError, match="request '0'.*needs a tenant"):
        engine.add_request([3, 4], cache_scope="private")
    with pytest.raises(TypeError, match="request '0'.*template_version"):
        engine.add_request([3, 4], template_version=2)
    assert engine.requests == {} and not engine.has_unfinished_requests()


def test_reset_prefix_cache_refuses_while_a_request_holds_blocks_then_clears():
    engine, prompt = new_engine(), tokens(12, 15)
    run(engine, prompt)
    engine.add_request(tokens(5, 16), SamplingParams(max_tokens=3, **GREEDY))
    engine.step()  # it now holds blocks
    assert engine.reset_prefix_cache() is False
    assert engine.block_manager.usage().cached_blocks > 0  # nothing changed
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    usage = engine.block_manager.usage()
    assert usage.cached_blocks == 0 and usage.free_blocks == usage.total_blocks
    assert hit_tokens(engine, run(engine, prompt)) == [0]


def test_n_samples_forked_from_a_cached_prompt_each_equal_a_seeded_single_request():
    engine, prompt = new_engine(), tokens(9, 17)
    run(engine, prompt)
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=5)
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert hit_tokens(engine, rid) == [8]
    alone = new_engine(enable_prefix_caching=False)
    for i, sample in enumerate(engine.get_request(rid).samples):
        one = alone.add_request(prompt, SamplingParams(temperature=0.8, seed=5 + i, max_tokens=5))
        while alone.has_unfinished_requests():
            alone.step()
        assert sample.output_token_ids == alone.get_request(one).output_token_ids


def test_step_reports_show_cached_blocks_and_the_metrics_count_queries_and_hits(tmp_path):
    engine, system = new_engine(), tokens(8, 18)
    run(engine, system + [3, 4])  # 10 tokens queried, none cached yet
    run(engine, system + [5])  # hits the 8 system tokens
    last = engine.trace[-1].blocks
    assert last.cached == len(last.cached_block_ids) > 0
    assert last.used + last.free + last.cached == last.total
    assert not set(last.cached_block_ids) & {b for t in last.tables.values() for b in t}
    stats = prefix_cache_stats(engine.trace)
    assert (stats.queries, stats.hits) == (10 + 9, 0 + 8) and stats.hit_rate == 8 / 19
    assert trace_metrics(engine.trace)["prefix_cache_hits"] == 8
    engine.trace.save(tmp_path / "t.json")
    assert Trace.load(tmp_path / "t.json")[-1].blocks.cached_block_ids == last.cached_block_ids


def test_the_block_grid_draws_free_but_cached_blocks_in_their_own_colour():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    bm.allocate(0, 8)
    bm.cache_blocks(0, tokens(8, 19), ("m", None, PUBLIC_SCOPE), 8)
    bm.free(0)
    bm.allocate(1, 3)
    snap = block_snapshot(bm)
    assert sorted(snap.cached_block_ids) == [0, 1] and snap.tables == {1: [2]}
    fig = render_block_grid(snap.tables, snap.num_blocks, snap.num_tokens, BS, cached_block_ids=snap.cached_block_ids)
    faces = {a.get_gid(): a.get_facecolor() for a in fig.axes[0].get_children()
             if a.get_gid() and isinstance(a, Patch)}  # the cells, not their labels
    assert faces["block:0"] == faces["block:1"] == to_rgba(CACHED_COLOR)
    assert faces["block:5"] == to_rgba(FREE_COLOR)
    with pytest.raises(ValueError, match="cached_block_ids"):
        render_block_grid(snap.tables, snap.num_blocks, snap.num_tokens, BS, cached_block_ids=[2])  # held


# ---- the fuzz ---------------------------------------------------------------------------------------------

NUM_TRIALS = 20  # each runs twice (cache off, cache on): about 10 s on one core
MAX_STEPS = 600
MAX_PROMPT, MAX_OUT = 20, 8
MIN_BLOCKS = -(-(MAX_PROMPT + MAX_OUT - 1) // BS)  # the largest request fits alone
TENANTS = [None, "A", "B"]


def script(seed: int) -> tuple[dict, dict[int, list]]:
    """A trial: its engine options and, per step, what happens before it (arrivals, aborts)."""
    rng = random.Random(seed)
    config = dict(policy=rng.choice(["continuous", "continuous", "static"]),
                  preemption_mode=rng.choice(["recompute", "swap"]), block_size=BS,
                  num_blocks=rng.randint(MIN_BLOCKS, MIN_BLOCKS + 8), max_num_seqs=rng.randint(2, 4),
                  swap_space_blocks=rng.choice([None, 4]), enable_chunked_prefill=rng.random() < 0.5)
    if config["enable_chunked_prefill"]:
        config |= dict(max_num_batched_tokens=rng.choice([8, 16]), max_prefill_chunk_tokens=rng.choice([4, None]))
    systems = [tokens(n, 100 * seed + n) for n in rng.sample([4, 8, 11, 13], 2)]  # shared prefixes
    actions: dict[int, list] = {}
    for i in range(rng.randint(8, 14)):
        prompt = list(rng.choice(systems)) if rng.random() < 0.85 else []
        prompt += [rng.randrange(2, VOCAB) for _ in range(rng.randint(0 if prompt else 1, MAX_PROMPT - len(prompt)))]
        if rng.random() < 0.3:
            prompt = prompt[: len(prompt) // BS * BS] or prompt  # a prompt of whole blocks: fully cached later
        tenant = rng.choice(TENANTS)
        request = dict(prompt=prompt, max_tokens=rng.randint(1, MAX_OUT), n=rng.choice([1, 1, 2]),
                       tenant=tenant, scope=rng.choice([None, None, "public"]),
                       template=rng.choice([None] * 5 + ["v1"]), priority=rng.randint(0, 1))
        step = rng.randint(0, 20)
        actions.setdefault(step, []).append(("add", str(i), request))
        if rng.random() < 0.2:
            actions.setdefault(step + rng.randint(0, 6), []).append(("abort", str(i), None))
    return config, actions


def may_share(a: dict, b: dict) -> bool:
    """The rule, written independently of the engine: same template, and the same scope."""
    def scope(r):
        return "public" if r["scope"] == "public" or r["tenant"] is None else r["tenant"]
    return a["template"] == b["template"] and scope(a) == scope(b)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class FuzzRun:
    def __init__(self, config: dict, actions: dict, caching: bool, speed: str = "fast"):
        self.engine = LLMEngine(MODEL, None, engine_config(model="random", speed=speed,
                                                           enable_prefix_caching=caching, **config))
        self.actions, self.requests = actions, {}  # sample id -> its script entry
        self.computed: dict[str, list[int]] = {}  # sample id -> the longest token prefix a forward has seen

    def run(self) -> None:
        engine, last = self.engine, max(self.actions)
        for i in range(MAX_STEPS):
            for kind, rid, request in self.actions.get(i, []):
                self.act(kind, rid, request)
            if not engine.has_unfinished_requests():
                if i > last:
                    return
                continue
            report = engine.step()
            self.check_step(report)
        raise AssertionError(f"the engine did not finish in {MAX_STEPS} steps")

    def act(self, kind: str, rid: str, request: dict) -> None:
        if kind == "abort":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # it may have finished already
                self.engine.abort_request(rid)
            return
        r = request
        params = SamplingParams(n=r["n"], max_tokens=r["max_tokens"], **GREEDY)
        self.engine.add_request(r["prompt"], params, request_id=rid, priority=r["priority"], tenant=r["tenant"],
                                template_version=r["template"], cache_scope=r["scope"])
        for sample in self.engine.get_request(rid).samples:
            self.requests[sample.request_id] = r

    def check_step(self, report) -> None:
        """After each step: refcounts, the pool's accounting, no stale hash, and no hit on a prefix that
        nobody allowed to share with the request had computed before this step."""
        engine, bm = self.engine, self.engine.block_manager
        holders = Counter(b for s in bm.seq_ids() for b in bm.block_table(s))
        assert [bm.allocator.refcount(b) for b in range(bm.allocator.num_blocks)] == [
            holders[b] for b in range(bm.allocator.num_blocks)]
        u = bm.usage()
        assert u.used_blocks + u.free_blocks + u.cached_blocks == u.total_blocks
        assert not set(bm.cached_block_ids()) & set(holders)
        for req in engine.scheduler.running:
            if req.seq_id in bm and bm.prefix_cache is not None:
                own = block_hashes(req.all_token_ids, BS, req.cache_key)
                for block, h in zip(bm.block_table(req.seq_id), own, strict=False):
                    assert bm.prefix_cache.hash_of(block) in (None, h), "a block in a table has a stale hash"
        for e in report.events:
            if e["type"] == "prefix_hit":
                self.check_hit(e)
        for s in report.scheduled:
            ids = engine.get_request(s.request_id).all_token_ids[: s.end]
            if len(ids) > len(self.computed.get(s.request_id, [])):
                self.computed[s.request_id] = ids

    def check_hit(self, e: dict) -> None:
        rid, n = e["request_id"], e["num_tokens"]
        assert n % BS == 0 and n <= e["num_query_tokens"] - 1
        mine = self.engine.get_request(rid).all_token_ids
        legal = max([common_prefix(mine, ids) for q, ids in self.computed.items()
                     if may_share(self.requests[q], self.requests[rid])], default=0)
        assert n <= legal // BS * BS, f"{rid} hit {n} tokens; only {legal} were computed in its scope"


@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_the_cache_changes_no_token_and_leaks_nothing_across_tenants_under_fuzz(speed):
    seen = Counter()
    for seed in range(NUM_TRIALS):
        config, actions = script(seed)
        runs = {caching: FuzzRun(config, actions, caching, speed) for caching in (False, True)}
        try:
            for r in runs.values():
                r.run()
            check_outcome(runs)
        except AssertionError as e:
            raise AssertionError(f"trial seed={seed} config={config}: {e}") from e
        for report in runs[True].engine.trace.steps:
            seen.update("hit" if e.get("num_tokens") else e.get("mode", e["type"]) for e in report.events)
    assert all(seen[kind] > 0 for kind in ("hit", "swap", "recompute", "forked", "aborted")), seen
    assert seen["hit"] > seen["prefix_hit"] / 6, seen  # shared prefixes really were shared (misses: 0 tokens)


def check_outcome(runs: dict) -> None:
    off, on = runs[False].engine, runs[True].engine
    for rid, r in runs[True].requests.items():
        expected = naive(MODEL, r["prompt"], r["max_tokens"])
        outputs = [e.get_request(rid) for e in (off, on)]
        assert all(seq.is_finished for seq in outputs)
        if any(seq.finish_reason == "abort" for seq in outputs):
            assert all(seq.output_token_ids == expected[: len(seq.output_token_ids)] for seq in outputs)
        else:
            assert outputs[0].output_token_ids == outputs[1].output_token_ids == expected, rid
    bm = on.block_manager
    u = bm.usage()
    assert u.used_blocks == 0 and bm.seq_ids() == [] and bm.swap_usage().used_blocks == 0
    assert all(bm.allocator.refcount(b) == 0 for b in range(u.total_blocks))
    assert u.free_blocks + u.cached_blocks == u.total_blocks
    assert on.reset_prefix_cache() and bm.usage().free_blocks == u.total_blocks

"""Chapter 05: the scheduler's rules, checked on bookkeeping alone (no model: tokens are made up)."""

import pytest

from engine.config import SchedulerConfig
from engine.kv.block_manager import BlockManager
from engine.request import RUNNING, SWAPPED, WAITING, Request
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler

EOS = 1
TOKEN = 7  # what every fake step "samples": never EOS, so requests run to max_tokens
CONTEXT = 256


class Bench:
    """A scheduler over a block manager, and requests whose sampled tokens we make up."""

    def __init__(self, num_blocks=64, block_size=4, swap_blocks=0, **config):
        self.bm = BlockManager(num_blocks, block_size, swap_blocks)
        self.sched = Scheduler(SchedulerConfig(**config), self.bm, CONTEXT)
        self.n = 0

    def add(self, prompt_len=4, max_tokens=4, priority=0, tenant=None) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        req = Request(f"r{self.n}", self.n, None, [5] * prompt_len, params, float(self.n), priority, tenant,
                      None, [EOS])
        self.n += 1
        self.sched.add(req)
        return req

    def step(self):
        """One schedule plus what the engine does after the forward: append tokens, finish."""
        out = self.sched.schedule()
        for w in out.work:
            if w.samples and w.request.append_token(TOKEN):
                w.request.finish(w.request.finish_reason, 0.0)
                self.sched.finish(w.request)
        return out

    @staticmethod
    def phases(out) -> dict[str, str]:
        return {w.request.request_id: w.phase for w in out.work}


def test_continuous_admits_a_new_request_while_another_decodes():
    bench = Bench(policy="continuous")
    bench.add(max_tokens=10)
    bench.step()
    bench.add()
    assert Bench.phases(bench.step()) == {"r0": "decode", "r1": "prefill"}


def test_static_admits_no_one_until_the_whole_batch_has_finished():
    bench = Bench(policy="static")
    a = bench.add(max_tokens=5)
    bench.step()
    b = bench.add()
    steps_before_b = 0
    while b.num_computed_tokens == 0:
        out = bench.step()
        assert "r1" not in Bench.phases(out) or a.is_finished
        steps_before_b += 1
    assert a.is_finished and steps_before_b == 5  # 4 more decodes of a, then b's batch starts


def test_a_step_never_exceeds_the_token_budget_and_chunks_long_prompts():
    bench = Bench(enable_chunked_prefill=True, max_num_batched_tokens=10, max_prefill_chunk_tokens=6)
    reqs = [bench.add(prompt_len=n, max_tokens=3) for n in (23, 1, 9, 14)]
    while bench.sched.has_unfinished():
        out = bench.step()
        assert sum(w.end - w.start for w in out.work) <= 10
        assert all(w.end - w.start <= 6 for w in out.work)
    assert all(r.is_finished and len(r.output_token_ids) == 3 for r in reqs)


def test_chunked_prefill_keeps_the_running_decodes_going():
    bench = Bench(enable_chunked_prefill=True, max_num_batched_tokens=9, max_prefill_chunk_tokens=8)
    bench.add(max_tokens=20)
    bench.step()
    bench.add(prompt_len=40)
    chunks = []
    for _ in range(5):
        out = bench.step()
        assert Bench.phases(out)["r0"] == "decode"  # never starved by the long prompt
        chunks += [(w.start, w.end) for w in out.work if w.request.request_id == "r1"]
    assert chunks == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]


def test_without_chunking_a_prompt_waits_until_it_fits_whole():
    bench = Bench(num_blocks=128, max_num_batched_tokens=CONTEXT)
    bench.add(prompt_len=200, max_tokens=3)
    bench.add(prompt_len=100)
    out = bench.step()
    assert [(w.start, w.end) for w in out.work] == [(0, 200)]  # 300 > budget: the second waits
    second = [(w.request.request_id, w.start, w.end) for w in bench.step().work]
    assert second == [("r0", 200, 201), ("r1", 0, 100)]


def test_lower_priority_number_runs_first_and_arrival_breaks_ties():
    bench = Bench(max_num_seqs=1)
    bench.add(priority=1)
    bench.add(priority=0)
    bench.add(priority=0)
    order = []
    while bench.sched.has_unfinished():
        for w in bench.step().work:
            if w.start == 0:
                order.append(w.request.request_id)
    assert order == ["r1", "r2", "r0"]


def test_a_tenant_quota_holds_back_only_that_tenant():
    bench = Bench(tenant_max_running={"free": 1})
    bench.add(tenant="free", max_tokens=3)
    bench.add(tenant="free")
    bench.add(tenant="paid")
    assert set(Bench.phases(bench.step())) == {"r0", "r2"}
    while not bench.sched.running or "r1" not in {r.request_id for r in bench.sched.running}:
        running_free = [r for r in bench.sched.running if r.tenant == "free"]
        assert len(running_free) <= 1
        bench.step()
    assert bench.sched.waiting == []


def fill_pool_and_grow(bench: Bench, reqs: list[Request]):
    """Run until some request needs a block that is not there; returns that step's output."""
    for _ in range(50):
        out = bench.step()
        if out.preempted:
            return out
    raise AssertionError("no preemption happened")


def test_the_victim_is_the_lowest_priority_then_the_latest_arrival():
    # 3 requests x 4 prompt tokens fill 3 blocks of 4; each decode then needs a new block.
    bench = Bench(num_blocks=4, block_size=4)
    reqs = [bench.add(max_tokens=8, priority=p) for p in (0, 1, 1)]
    out = fill_pool_and_grow(bench, reqs)
    victims = [e["request_id"] for e in out.events if e["type"] == "preempted"]
    assert victims[0] == "r2"  # priority 1 (lowest) and the later of the two
    assert reqs[0].status == RUNNING


def test_recompute_preemption_frees_the_blocks_and_restarts_from_zero():
    bench = Bench(num_blocks=4, block_size=4)
    reqs = [bench.add(max_tokens=8) for _ in range(3)]
    fill_pool_and_grow(bench, reqs)
    victim = reqs[2]
    assert victim.status == WAITING and victim.preempted and victim.num_computed_tokens == 0
    assert victim.seq_id not in bench.bm
    assert len(victim.output_token_ids) == 1  # its output so far is kept and will be prefilled again
    while bench.sched.has_unfinished():
        bench.step()
    assert all(len(r.output_token_ids) == 8 for r in reqs)
    assert bench.bm.usage().used_blocks == 0


def test_swap_preemption_moves_the_blocks_to_the_cpu_pool_and_back():
    bench = Bench(num_blocks=4, block_size=4, swap_blocks=8, preemption_mode="swap")
    reqs = [bench.add(max_tokens=8) for _ in range(3)]
    out = fill_pool_and_grow(bench, reqs)
    victim = reqs[2]
    assert victim.status == SWAPPED and victim.num_computed_tokens == 4
    assert [gpu for gpu, _ in out.swap_out] == [2]  # its one block (prompt of 4 tokens) left the GPU
    assert bench.bm.swap_usage().used_blocks == 1
    swapped_in = False
    while bench.sched.has_unfinished():
        out = bench.step()
        if {"type": "swapped_in", "request_id": "r2"} in out.events and not swapped_in:
            swapped_in = True
            assert victim.status == RUNNING and victim.num_computed_tokens == 5  # 4 back + this step's decode
            assert len(out.swap_in) == 1
    assert swapped_in and bench.bm.swap_usage().used_blocks == 0
    assert all(len(r.output_token_ids) == 8 for r in reqs)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    bench = Bench(num_blocks=4, block_size=4, swap_blocks=0, preemption_mode="swap")
    reqs = [bench.add(max_tokens=8) for _ in range(3)]
    out = fill_pool_and_grow(bench, reqs)
    assert [e["mode"] for e in out.events if e["type"] == "preempted"] == ["recompute"]


def test_finishing_a_request_frees_its_gpu_and_cpu_blocks_at_once():
    bench = Bench(num_blocks=4, block_size=4, swap_blocks=8, preemption_mode="swap")
    reqs = [bench.add(max_tokens=8) for _ in range(3)]
    fill_pool_and_grow(bench, reqs)
    for r in reqs:
        bench.sched.finish(r)
    assert bench.bm.usage().used_blocks == 0 and bench.bm.swap_usage().used_blocks == 0
    assert not bench.sched.has_unfinished()


@pytest.mark.parametrize("field, value", [
    ("policy", "round-robin"), ("max_num_seqs", 0), ("max_num_batched_tokens", -1),
    ("preemption_mode", "drop"), ("default_tenant_max_running", 0), ("max_prefill_chunk_tokens", 8),
    # a bool is not a count, and a switch is True or False
    ("max_num_seqs", True), ("max_num_batched_tokens", True), ("enable_chunked_prefill", 1),
    ("tenant_max_running", {"a": True}),
])
def test_an_invalid_scheduler_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_a_budget_below_the_context_needs_chunked_prefill():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(8, 4), CONTEXT)

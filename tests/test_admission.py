"""Chapter 10: the admission policy (engine/serving/admission.py) on its own: token buckets, queue caps and deadlines,
driven by a clock we set by hand. No HTTP, no threads, no timing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from engine.serving.admission import (
    MAX_TRACKED_BUCKETS,
    SHED_REASON,
    Admission,
    AdmissionLimits,
    Deadlines,
    Degradation,
    Load,
    RateLimit,
    Rejected,
    Served,
    TokenBucket,
    api_keys_from_args,
    prefill_tokens_left,
)

IDLE = Load(num_requests=0, num_queued_tokens=0)


def rejection(admission: Admission, *args) -> Rejected | None:
    try:
        admission.admit(*args)
    except Rejected as e:
        return e
    return None


# ---- the token bucket ---------------------------------------------------------------------------------


def test_a_full_bucket_lets_a_burst_through_then_one_per_refill_interval():
    rate, burst = 2.0, 3
    b = TokenBucket(rate, burst)
    for _ in range(burst):
        assert b.wait_s(1, now=10.0) == 0
        b.take(1, now=10.0)
    assert b.wait_s(1, now=10.0) == pytest.approx(1 / rate)  # empty: one token takes 1/rate seconds
    assert b.wait_s(1, now=10.0 + 1 / rate) == 0


def test_a_bucket_never_holds_more_than_its_burst():
    b = TokenBucket(rate_per_s=5.0, burst=4)
    b.take(4, now=0.0)
    b.refill(now=1000.0)
    assert b.level == 4


def test_a_cost_above_the_burst_can_never_be_paid():
    assert math.isinf(TokenBucket(rate_per_s=100.0, burst=50).wait_s(51, now=0.0))


def test_a_clock_that_steps_back_does_not_mint_tokens():
    b = TokenBucket(rate_per_s=1.0, burst=1)
    b.take(1, now=10.0)
    assert b.wait_s(1, now=5.0) == pytest.approx(1.0)


# ---- the gate: tenants' rates ------------------------------------------------------------------------------


def test_a_tenant_past_its_request_rate_gets_429_with_the_time_to_wait():
    rate = 0.5  # one request per 2 s
    a = Admission(AdmissionLimits(tenant_rate=RateLimit(requests_per_s=rate, request_burst=2)))
    assert rejection(a, "alice", 10, 20, IDLE, 0.0) is None
    assert rejection(a, "alice", 10, 20, IDLE, 0.0) is None
    e = rejection(a, "alice", 10, 20, IDLE, 0.0)
    assert (e.status, e.reason) == (429, "tenant_request_rate")
    assert e.retry_after_s == pytest.approx(1 / rate)
    assert rejection(a, "alice", 10, 20, IDLE, 1 / rate) is None  # after the wait it says, it goes through


def test_one_tenant_at_its_rate_leaves_the_others_untouched():
    a = Admission(AdmissionLimits(tenant_rate=RateLimit(requests_per_s=1.0)))
    assert rejection(a, "alice", 10, 20, IDLE, 0.0) is None
    assert rejection(a, "alice", 10, 20, IDLE, 0.0).status == 429
    assert rejection(a, "bob", 10, 20, IDLE, 0.0) is None
    assert rejection(a, None, 10, 20, IDLE, 0.0) is None  # anonymous requests share a bucket of their own


def test_the_token_rate_charges_prompt_plus_max_tokens():
    a = Admission(AdmissionLimits(tenant_rate=RateLimit(tokens_per_s=10.0, token_burst=100)))
    assert rejection(a, "alice", 30, 60, IDLE, 0.0) is None  # 100 - 60 = 40 left
    e = rejection(a, "alice", 30, 60, IDLE, 0.0)
    assert (e.status, e.reason) == (429, "tenant_token_rate")
    assert e.retry_after_s == pytest.approx((60 - 40) / 10.0)


def test_a_request_larger_than_the_token_burst_is_refused_without_retry_after():
    a = Admission(AdmissionLimits(tenant_rate=RateLimit(tokens_per_s=10.0, token_burst=100)))
    e = rejection(a, "alice", 30, 101, IDLE, 0.0)
    assert e.status == 429 and e.retry_after_s is None and "max_tokens" in e.message


def test_named_tenants_can_have_their_own_rate():
    limits = AdmissionLimits(tenant_rate=RateLimit(requests_per_s=1.0),
                             tenant_rates={"batch": RateLimit(requests_per_s=5.0)})
    a = Admission(limits)
    assert [rejection(a, "batch", 1, 2, IDLE, 0.0) is None for _ in range(6)] == [True] * 5 + [False]


# ---- the gate: the server's load ----------------------------------------------------------------------------


def test_past_max_num_queued_reqs_everybody_gets_503():
    cap = 4
    a = Admission(AdmissionLimits(max_num_queued_reqs=cap))
    assert rejection(a, "alice", 10, 20, Load(cap - 1, 0), 0.0) is None
    e = rejection(a, "bob", 10, 20, Load(cap, 0), 0.0)
    assert (e.status, e.reason) == (503, "max_num_queued_reqs")
    assert e.retry_after_s == AdmissionLimits().retry_after_s


def test_past_max_num_queued_tokens_a_new_prompt_gets_503():
    a = Admission(AdmissionLimits(max_num_queued_tokens=100))
    assert rejection(a, "alice", 40, 50, Load(3, 60), 0.0) is None  # 60 + 40 = 100: at the cap, allowed
    e = rejection(a, "alice", 41, 50, Load(3, 60), 0.0)
    assert (e.status, e.reason) == (503, "max_num_queued_tokens")


def test_a_long_prompt_alone_is_admitted_even_above_the_token_cap():
    """Nothing queued ahead of it: refusing it would refuse it forever, and its TTFT cannot be shorter."""
    a = Admission(AdmissionLimits(max_num_queued_tokens=100))
    assert rejection(a, "alice", 500, 600, Load(2, 0), 0.0) is None


def test_a_request_refused_for_load_costs_its_tenant_nothing():
    a = Admission(AdmissionLimits(max_num_queued_reqs=1, tenant_rate=RateLimit(requests_per_s=1.0)))
    assert rejection(a, "alice", 10, 20, Load(1, 0), 0.0).status == 503
    assert rejection(a, "alice", 10, 20, IDLE, 0.0) is None  # its one request per second is still there


def test_no_limits_admit_everything():
    a = Admission()
    for i in range(100):
        assert rejection(a, f"t{i % 3}", 10**6, 10**7, Load(10**6, 10**9), 0.0) is None


def test_tenants_inventing_names_cannot_grow_the_buckets_without_bound():
    a = Admission(AdmissionLimits(tenant_rate=RateLimit(requests_per_s=1.0)))
    for i in range(3 * MAX_TRACKED_BUCKETS):
        a.admit(f"user-{i}", 1, 2, IDLE, float(i))  # one second apart: the older buckets are full again
    assert a.num_tracked_tenants <= MAX_TRACKED_BUCKETS + 1


def test_prefill_tokens_left_counts_prompts_not_yet_in_the_cache():
    def seq(prompt, outputs, computed, finished=False):
        n = prompt + outputs
        return SimpleNamespace(num_uncomputed_tokens=n - computed, is_decoding=outputs > 0 and n - computed == 1,
                               is_finished=finished)

    waiting = seq(prompt=30, outputs=0, computed=0)
    chunked = seq(prompt=50, outputs=0, computed=20)  # a prefill half done
    decoding = seq(prompt=40, outputs=5, computed=44)
    recompute = seq(prompt=10, outputs=6, computed=0)  # preempted by recompute: prompt and outputs again
    done = seq(prompt=99, outputs=0, computed=0, finished=True)
    assert prefill_tokens_left([waiting, chunked, decoding, recompute, done]) == 30 + 30 + 0 + 16


# ---- deadlines ------------------------------------------------------------------------------------------------


def test_a_request_not_started_by_its_queue_deadline_times_out():
    d = Deadlines.after(arrival=100.0, queue_timeout_s=5.0, request_timeout_s=60.0)
    assert d.expired(104.9, started=False) is None
    assert d.expired(105.1, started=False) == "queue_timeout"
    assert d.expired(105.1, started=True) is None  # it got its seat in time: only the total deadline is left
    assert d.expired(160.1, started=True) == "request_timeout"


def test_a_request_may_shorten_the_servers_timeouts_but_never_lengthen_them():
    a = Admission(AdmissionLimits(queue_timeout_s=10.0, request_timeout_s=60.0))
    assert a.deadlines(0.0) == Deadlines(10.0, 60.0)
    assert a.deadlines(0.0, queue_timeout_s=2.0, request_timeout_s=600.0) == Deadlines(2.0, 60.0)
    assert Admission().deadlines(0.0, request_timeout_s=3.0) == Deadlines(None, 3.0)


@pytest.mark.parametrize("kwargs", [{"max_num_queued_reqs": 0}, {"max_num_queued_tokens": 2.5},
                                    {"queue_timeout_s": -1.0}, {"request_timeout_s": math.inf},
                                    {"tenant_rate": "fast"}])
def test_bad_limits_are_refused_with_the_field_named(kwargs):
    name = next(iter(kwargs))
    with pytest.raises((ValueError, TypeError), match=name if name != "tenant_rate" else "tenant_rate"):
        AdmissionLimits(**kwargs)


def test_bad_rates_and_timeouts_are_refused():
    with pytest.raises(ValueError, match="requests_per_s"):
        RateLimit(requests_per_s=0)
    with pytest.raises(ValueError, match="queue_timeout_s"):
        Deadlines.after(0.0, queue_timeout_s=0.0)


def test_api_keys_map_each_key_to_its_tenant():
    assert api_keys_from_args(["alice=sk-1", "bob=sk=2"]) == {"sk-1": "alice", "sk=2": "bob"}
    assert api_keys_from_args(None) is None
    with pytest.raises(ValueError, match="TENANT=KEY"):
        api_keys_from_args(["sk-no-tenant"])


# ---- degradation ------------------------------------------------------------------------------------------------


def test_the_token_cap_shortens_every_long_request_and_leaves_short_ones_alone():
    d = Degradation(max_tokens_cap=64)
    assert d.apply(200, priority=0, num_waiting=0) == Served(64, capped=True)
    assert d.apply(64, priority=0, num_waiting=100) == Served(64)  # at the cap is not over it
    assert d.apply(10, priority=5, num_waiting=100) == Served(10)  # a cap alone never degrades


def test_a_long_queue_degrades_max_tokens_and_a_short_one_does_not():
    d = Degradation(queue_at=4, degraded_max_tokens=8)
    assert d.apply(32, priority=0, num_waiting=3) == Served(32)
    assert d.apply(32, priority=0, num_waiting=4) == Served(8, degraded=True)  # AT queue_at: degraded
    assert d.apply(6, priority=0, num_waiting=9) == Served(6)  # already short: nothing taken away


def test_degrading_a_capped_request_keeps_both_reasons():
    d = Degradation(max_tokens_cap=64, queue_at=1, degraded_max_tokens=16)
    assert d.apply(500, priority=0, num_waiting=1) == Served(16, capped=True, degraded=True)
    assert d.apply(40, priority=0, num_waiting=1) == Served(16, degraded=True)


def test_while_degraded_low_priority_requests_are_shed_with_503_and_urgent_ones_are_served():
    d = Degradation(queue_at=2, shed_priority_from=1)
    with pytest.raises(Rejected) as e:
        d.apply(32, priority=1, num_waiting=2)
    assert (e.value.status, e.value.reason) == (503, SHED_REASON)
    assert e.value.retry_after_s is not None and e.value.retry_after_s > 0
    assert "shed_priority_from=1" in e.value.message
    assert d.apply(32, priority=0, num_waiting=50) == Served(32)  # urgent: served in full
    assert d.apply(32, priority=3, num_waiting=1) == Served(32)  # a short queue sheds nobody


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens_cap": 0}, "max_tokens_cap"),
    ({"queue_at": 2, "degraded_max_tokens": 1.5}, "degraded_max_tokens"),
    ({"queue_at": True, "degraded_max_tokens": 4}, "queue_at"),
    ({"degraded_max_tokens": 4}, "queue_at"),
    ({"queue_at": 3}, "queue_at"),
    ({"queue_at": 3, "shed_priority_from": "low"}, "shed_priority_from"),
])
def test_a_degradation_that_cannot_work_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Degradation(**kwargs)


def test_no_degradation_serves_every_request_as_asked():
    assert Degradation().apply(4000, priority=9, num_waiting=10_000) == Served(4000)

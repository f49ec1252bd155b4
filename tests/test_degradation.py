"""Chapter 10: token caps and degradation (engine/serving/admission.py's `Degradation`) applied by the step-driven
runner (engine/lab/incidents.py) to one reproducible overload burst. Every claim is counted in engine steps and
tokens, never in seconds: arrivals are tied to steps, so the queues are the same on every machine."""

from __future__ import annotations

import pytest

from engine.companions.metrics import nearest_rank, requests_from_trace
from engine.lab.incidents import (
    BURST_MAX_TOKENS,
    LOW_PRIORITY,
    overload_burst,
    run_scenario,
    usable_vocab,
)
from engine.loading.loader import load_model
from engine.serving.admission import Degradation

NUM_REQUESTS = 24  # half the chapter's burst: the queue still grows past the seats
SLO_STEPS = 24
CAP = 48
SHORT = 8


@pytest.fixture(scope="module")
def lab():
    model, tok = load_model("tinylab")
    return model, tok, overload_burst(usable_vocab(tok), seed=0, n=NUM_REQUESTS)


POLICIES = {"as asked": None, "cap": Degradation(max_tokens_cap=CAP),
            "degrade": Degradation(queue_at=2, degraded_max_tokens=SHORT),
            "shed": Degradation(queue_at=2, shed_priority_from=LOW_PRIORITY)}


@pytest.fixture(scope="module")
def runs(lab):
    """The burst under each of POLICIES, once per module: name -> (trace, its requests' timings)."""
    model, tok, burst = lab
    traces = {name: run_scenario(burst, model, tok, degradation=p) for name, p in POLICIES.items()}
    return {name: (t, requests_from_trace(t)) for name, t in traces.items()}


def test_the_burst_overloads_its_seats_when_served_as_asked(lab, runs):
    trace, served = runs["as asked"]
    assert len(served) == NUM_REQUESTS and all(r.finish_reason == "length" for r in served)
    assert nearest_rank([r.ttft_steps for r in served], 99) > 3 * SLO_STEPS, "the queue must build up"
    assert "degradation" not in trace.config  # no policy, nothing recorded


def test_the_token_cap_bounds_every_answer_and_counts_the_requests_it_shortened(lab, runs):
    _, _, burst = lab
    trace, served = runs["cap"]
    asked_more = sum(a.max_tokens > CAP for a in burst.arrivals)
    assert asked_more > 0, "the burst must hold requests above the cap, or this test shows nothing"
    assert max(r.output_tokens for r in served) == CAP
    assert trace.config["degradation"]["capped"] == asked_more
    assert trace.config["degradation"]["degraded"] == trace.config["degradation"]["shed"] == 0


def test_degrading_while_the_queue_is_long_keeps_more_requests_within_the_slo(lab, runs):
    _, as_asked = runs["as asked"]
    trace, served = runs["degrade"]
    within = [sum(r.ttft_steps <= SLO_STEPS for r in rs) for rs in (as_asked, served)]
    assert within[1] > within[0], within
    shortened = [r for r in served if r.output_tokens < BURST_MAX_TOKENS]
    assert len(shortened) == trace.config["degradation"]["degraded"] > 0
    assert all(r.output_tokens == SHORT for r in shortened)  # degraded answers are exactly the degraded length


def test_shedding_refuses_only_low_priority_requests_and_serves_every_urgent_one(lab, runs):
    _, _, burst = lab
    trace, served = runs["shed"]
    urgent = sum(a.priority < LOW_PRIORITY for a in burst.arrivals)
    assert sum(r.priority < LOW_PRIORITY for r in served) == urgent
    shed = trace.config["degradation"]["shed"]
    assert shed > 0 and len(served) + shed == NUM_REQUESTS
    assert trace.config["degradation"]["degraded"] == 0  # shedding alone shortens nobody's answer

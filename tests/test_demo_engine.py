"""The classroom demo of chapter 05: requests arrive on time, the live view shows each step, a
preemption happens in the bundled model's demo, and the run ends with its summary."""

import re

import pytest
import torch

from engine.lab import demo as demo_engine
from engine.lab.demo import format_step, kv_bar, step_through_demo
from engine.lab.workloads import Arrival, run_arrivals
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine_fixtures import random_model

DEMO_STEPS = 12  # the bundled model's demo preempts at step 8; 12 steps show it and stay quick




def _engine(**options) -> LLMEngine:
    return LLMEngine(random_model(seed=4), None, engine_config(model="random", **options))


def test_kv_bar_has_one_cell_per_block_and_fills_in_proportion():
    assert kv_bar(3, 8) == "███░░░░░"
    assert kv_bar(0, 4) == "░░░░" and kv_bar(4, 4) == "████"
    assert kv_bar(50, 100, width=10) == "█████░░░░░"  # a big pool: 10 blocks per cell
    assert kv_bar(1, 100, width=10) == "█░░░░░░░░░"  # one block in use still shows


def test_run_arrivals_adds_each_request_at_its_step_and_idles_in_between():
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    arrivals = [Arrival(step=5, prompt=[4, 5, 6], params=params, request_id="late"),
                Arrival(step=0, prompt=[7, 8], params=params, request_id="early")]
    trace = run_arrivals(_engine(), arrivals)
    arrived = {e["request_id"]: i for i, r in enumerate(trace.steps) for e in r.events
               if e["type"] == "arrived"}
    assert arrived == {"early": 0, "late": 5}
    assert [r.scheduled for r in trace.steps[2:5]] == [[], [], []]  # early finished at step 1; idle until 5
    assert len(trace) == 7  # late: prefill + first token at 5, second token at 6


def test_run_arrivals_stops_after_max_steps():
    arrivals = [Arrival(step=0, prompt=[4, 5], params=SamplingParams(max_tokens=20, ignore_eos=True))]
    engine = _engine()
    trace = run_arrivals(engine, arrivals, max_steps=3)
    assert len(trace) == 3 and engine.has_unfinished_requests()


def test_the_live_view_names_each_scheduled_request_and_each_event():
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = _engine(block_size=4, num_blocks=16)
    run_arrivals(engine, [Arrival(0, list(range(3, 12)), params, "a"), Arrival(0, [3, 4], params, "b")],
                 max_steps=1)
    text = format_step(engine.trace[0], engine, {"a": "arith"})
    assert text.startswith("── step 0 ─ prefill a [0, 9) + prefill b [0, 2) = 11 tokens")
    assert "  a     arith   prefill  [0, 9) of 9" in text
    assert "+ arrived a (9 prompt tokens)" in text and "> admitted b" in text
    assert "KV  ████░░░░░░░░░░░░  4/16 blocks used" in text  # a: 3 blocks, b: 1 block


def test_the_demo_preempts_and_ends_with_the_summary(capsys, monkeypatch):
    naps = []
    monkeypatch.setattr(demo_engine.time, "sleep", naps.append)  # pause=True off a terminal: a short sleep
    torch.set_num_threads(2)
    trace = step_through_demo("tinylab", steps=DEMO_STEPS, pause=True)
    assert torch.get_num_threads() == 2  # the demo runs on one thread and gives the caller's setting back
    torch.set_num_threads(1)
    out = capsys.readouterr().out
    assert len(trace) == DEMO_STEPS and len(naps) == DEMO_STEPS
    assert len(re.findall(r"^── step \d+ ", out, flags=re.M)) == DEMO_STEPS
    assert re.search(r"! PREEMPTED \S+ \(recompute\): no free KV block", out)
    assert f"stopped after {DEMO_STEPS} steps" in out
    summary = out[out.index("── summary"):]
    for field in ("throughput", "TTFT", "P50", "P99", "TPOT"):
        assert field in summary
    assert re.search(r"preemptions  [1-9]", summary)


def test_the_demo_refuses_a_non_positive_step_count():
    with pytest.raises(ValueError, match="steps must be None"):
        step_through_demo(steps=0, pause=False)

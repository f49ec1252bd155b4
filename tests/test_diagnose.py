"""Chapter 10: each planted incident (engine/lab/incidents.py), run on the engine, is diagnosed as its own
cause by walking the troubleshooting order (engine/diagnose.py), and a healthy run is called healthy."""

from __future__ import annotations

import json

import pytest

from engine.__main__ import main as cli
from engine.diagnose import diagnose, request_splits
from engine.lab.incidents import run_scenario, scenarios, usable_vocab
from engine.loader import load_model
from engine.trace import Trace

EXPECTED = {  # scenario -> the rule that must explain it
    "healthy": "healthy",
    "long_prompts": "traffic_mix_shift",
    "kv_pool_too_small": "preemption_storm",
    "slow_detokenizer": "slow_cpu_outside_forward",
    "tenant_flood": "tenant_flood",
    "prefix_cache_collapse": "prefix_cache_collapse",
}


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    model, tok = load_model("tinylab")
    table = scenarios(usable_vocab(tok), seed=0)
    assert set(table) == set(EXPECTED), "every scenario needs its expected diagnosis here"
    return {name: run_scenario(s, model, tok) for name, s in table.items()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_incident_is_diagnosed_as_its_own_cause(traces, name):
    d = diagnose(traces[name])
    assert d.cause == EXPECTED[name], d.text()
    assert [f.step for f in d.findings] == [1, 2, 3, 4, 5], "the walk visits every step of the order"


def test_the_template_change_is_named_as_the_root_of_the_cache_collapse(traces):
    d = diagnose(traces["prefix_cache_collapse"])
    assert "chat_template 'v1' -> 'v2'" in d.summary


def test_a_flood_is_seen_as_queueing_not_as_slower_steps(traces):
    first, second = (request_splits(traces["tenant_flood"])[:8], request_splits(traces["tenant_flood"])[-8:])
    queued = [sorted(s.queue_s for s in part)[len(part) // 2] for part in (first, second)]
    assert queued[1] > queued[0], "the late requests wait behind the flood"


def test_every_request_is_split_into_queue_prefill_and_decode(traces):
    trace = traces["healthy"]
    splits = request_splits(trace)
    assert len(splits) == len(trace.requests())
    for s, r in zip(splits, sorted(trace.requests().values(), key=lambda r: r.arrival_time), strict=True):
        assert min(s.queue_s, s.prefill_s, s.decode_s) >= 0
        assert s.queue_s + s.prefill_s + s.decode_s == pytest.approx(r.finish_time - r.arrival_time)


def test_the_command_line_diagnoses_a_saved_trace(traces, tmp_path, capsys):
    path = tmp_path / "flood.json"
    traces["tenant_flood"].save(path)
    cli(["diagnose", str(path)])
    out = capsys.readouterr().out
    assert "(1) where the time goes" in out and "(5) changes" in out
    assert out.strip().splitlines()[-1].startswith("finding: tenant_flood")


def test_the_command_line_refuses_a_file_that_is_not_a_trace(tmp_path):
    path = tmp_path / "not_a_trace.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit, match="is not a saved Trace"):
        cli(["diagnose", str(path)])

"""Chapter 10: each planted incident (engine/lab/incidents.py), run on the engine, is diagnosed as its own
cause by walking the troubleshooting order (engine/serving/diagnose.py), and a healthy run is called healthy. Step (6)
compares task scores (a quality record), so a change that is faster but wrong is caught too."""

from __future__ import annotations

import json

import pytest

from engine.__main__ import main as cli
from engine.lab.incidents import run_scenario, scenarios, usable_vocab
from engine.loading.loader import load_model
from engine.serving.diagnose import PERPLEXITY_GROWTH, QUALITY_DROP, diagnose, request_splits
from engine.trace import Trace

EXPECTED = {  # scenario -> the rule that must explain it
    "healthy": "healthy",
    "long_prompts": "traffic_mix_shift",
    "kv_pool_too_small": "preemption_storm",
    "slow_detokenizer": "slow_cpu_outside_forward",
    "tenant_flood": "tenant_flood",
    "prefix_cache_collapse": "prefix_cache_collapse",
    "pruned_model": "quality_regression",
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
    assert [f.step for f in d.findings] == [1, 2, 3, 4, 5, 6], "the walk visits every step of the order"


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


# ---- step (6): quality ------------------------------------------------------------------------------------------


def test_the_pruned_model_passes_every_latency_step_and_is_caught_by_its_task_scores(traces):
    d = diagnose(traces["pruned_model"])
    assert [f.cause for f in d.findings[:5]] == [None] * 5, "faster, so steps (1)-(5) see nothing wrong"
    assert "arith exact" in d.summary and "model 'tinylab' -> " in d.summary, d.summary
    record = traces["pruned_model"].config["quality"]
    (old, before), (new, after) = record.items()
    assert before[0]["value"] - after[0]["value"] > QUALITY_DROP, record


def test_without_its_quality_record_the_pruned_model_looks_healthy(traces):
    trace = traces["pruned_model"]
    blind = Trace(config={k: v for k, v in trace.config.items() if k != "quality"}, steps=trace.steps)
    d = diagnose(blind)
    assert d.cause == "healthy" and "no quality record" in d.findings[5].lines[0]


def test_the_command_line_reads_the_quality_record_from_the_saved_trace(traces, tmp_path, capsys):
    path = tmp_path / "pruned.json"
    traces["pruned_model"].save(path)
    cli(["diagnose", str(path)])
    out = capsys.readouterr().out
    assert "(6) quality" in out
    assert out.strip().splitlines()[-1].startswith("finding: quality_regression")


def scores(metric: str, before: float, after: float) -> dict:
    return {"old": [{"task": "t", "metric": metric, "value": before, "n": 100}],
            "new": [{"task": "t", "metric": metric, "value": after, "n": 100}]}


@pytest.mark.parametrize(("metric", "before", "after", "regressed"), [
    ("exact", 0.9, 0.9 - 2 * QUALITY_DROP, True),
    ("exact", 0.9, 0.9 - QUALITY_DROP / 2, False),  # within the noise of a small eval
    ("exact", 0.5, 0.9, False),  # better
    ("accuracy_by_length[128-255]", 0.9, 0.9 - 2 * QUALITY_DROP, True),
    ("false_refusal_rate", 0.0, 2 * QUALITY_DROP, True),  # lower is better: a rise is the regression
    ("false_refusal_rate", 2 * QUALITY_DROP, 0.0, False),
    ("perplexity", 2.0, 2.0 * PERPLEXITY_GROWTH * 1.1, True),
    ("perplexity", 2.0, 2.0 * (1 + (PERPLEXITY_GROWTH - 1) / 2), False),
])
def test_a_score_that_gets_worse_past_its_threshold_is_a_quality_regression(traces, metric, before, after,
                                                                            regressed):
    d = diagnose(traces["healthy"], quality=scores(metric, before, after))
    assert d.cause == ("quality_regression" if regressed else "healthy"), d.text()


def test_an_earlier_cause_stays_the_finding_and_the_regression_is_still_named(traces):
    d = diagnose(traces["tenant_flood"], quality=scores("exact", 0.9, 0.1))
    assert d.cause == "tenant_flood" and "quality regression" in d.summary and "t exact" in d.summary


def test_a_quality_record_given_to_diagnose_wins_over_the_traces_own(traces):
    assert diagnose(traces["pruned_model"], quality=scores("exact", 0.8, 0.8)).cause == "healthy"


def test_a_malformed_quality_record_is_refused_naming_the_bad_row(traces):
    with pytest.raises(ValueError, match=r"quality\['new'\]\[0\]"):
        diagnose(traces["healthy"], quality={"old": [], "new": [{"task": "t", "metric": "exact", "value": "high"}]})

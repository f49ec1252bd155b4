"""engine/trace.py's TraceRetention: a learner's trace keeps everything, a server's is bounded (a window of
full reports, a ring of summaries, a rotated JSON-lines file), and what it drops is really gone."""

import json

import pytest

from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncLLMEngine
from engine.trace import StepSummary, Trace, TraceRetention
from engine_fixtures import random_model

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(seed=3)


def run(engine, n_requests):
    for i in range(n_requests):
        engine.add_request([5 + i % 7] * 9, PARAMS)
        while engine.has_unfinished_requests():
            engine.step()


def test_an_engine_keeps_every_step_by_default(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    run(engine, 5)
    assert len(engine.trace) == engine.trace.num_recorded >= 5 * 4
    assert [r.step for r in engine.trace.steps] == list(range(len(engine.trace)))


def test_a_window_keeps_the_last_full_reports_and_a_ring_of_summaries(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    engine.trace.retain(TraceRetention(full_steps=3, summary_steps=7))
    run(engine, 5)
    trace, total = engine.trace, engine.trace.num_recorded
    assert total >= 20
    assert [r.step for r in trace.steps] == list(range(total - 3, total))  # the newest 3, in order
    assert [s.step for s in trace.summaries] == list(range(total - 7, total))
    last = trace.steps[-1]
    assert trace.summaries[-1] == StepSummary.of(last)
    assert trace.summaries[-1].blocks_used == last.blocks.used
    assert trace.summaries[-1].decode_tokens == last.num_decode_tokens


def test_retain_trims_what_was_kept_before(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    run(engine, 2)
    before = engine.trace.num_recorded
    engine.trace.retain(TraceRetention(full_steps=2))
    assert [r.step for r in engine.trace.steps] == [before - 2, before - 1]


def test_the_trace_file_holds_every_step_and_loads_back(model, tmp_path):
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    path = tmp_path / "trace.jsonl"
    engine.trace.retain(TraceRetention(full_steps=1, file=path))
    run(engine, 3)
    engine.trace.close()
    loaded = Trace.load(path)
    assert len(loaded) == engine.trace.num_recorded  # the file kept what memory dropped
    assert loaded.config == engine.trace.config
    assert loaded.steps[-1] == engine.trace.steps[-1]
    assert len(loaded.requests()) == 3 and all(r.num_output_tokens == 4 for r in loaded.requests().values())


def test_the_trace_file_rotates_and_keeps_only_its_backups(model, tmp_path):
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    path = tmp_path / "trace.jsonl"
    engine.trace.retain(TraceRetention(full_steps=1, file=path, file_max_bytes=4096, file_backups=2))
    run(engine, 12)
    engine.trace.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["trace.jsonl", "trace.jsonl.1", "trace.jsonl.2"]
    pieces = [Trace.load(tmp_path / name) for name in ("trace.jsonl.2", "trace.jsonl.1", "trace.jsonl")]
    for p in (tmp_path / name for name in files):
        assert p.stat().st_size <= 4096
        assert json.loads(p.read_text().splitlines()[0])["config"] == engine.trace.config
    steps = [r.step for piece in pieces for r in piece.steps]
    assert steps == list(range(steps[0], engine.trace.num_recorded))  # contiguous, newest last
    assert steps[0] > 0  # the oldest file was dropped


def test_a_server_front_bounds_the_engine_trace(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    AsyncLLMEngine(engine)  # switches the trace to the server's window (not started: no thread)
    assert engine.trace.retention == TraceRetention.server()
    assert engine.trace.retention.full_steps is not None and engine.trace.summaries.maxlen


@pytest.mark.parametrize("bad", [dict(full_steps=0), dict(full_steps=2.5), dict(summary_steps=-1),
                                 dict(file_max_bytes=10), dict(file_backups=True)])
def test_bad_retention_names_the_field(bad):
    (field,) = bad
    with pytest.raises(ValueError, match=field):
        TraceRetention(**bad)

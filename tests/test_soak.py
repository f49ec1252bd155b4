"""Issue 32, the short soak: hundreds of requests through the real app (server, dashboard, /metrics) on a loopback
port, and the Python heap stops growing once the trace window is full. benchmarks/soak.py is the long version
(20,000 requests, the server's RSS, in benchmarks/results/soak.md).

tracemalloc counts Python allocations only (not tensors, not glibc's heap): exactly what the trace, the
metrics and the per-request bookkeeping are made of. With a trace that kept every step (the old server),
the second half of this run would add a report per step, far above the bound.
"""

import gc
import http.client
import json
import random
import threading
import tracemalloc

import pytest

from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.serving.dashboard import attach_dashboard
from engine.serving.server import BackgroundServer, build_app
from engine.trace import TraceRetention

MODEL = "tinylab"
CLIENTS = 4
WARMUP_PER_CLIENT = 30  # 120 requests: the trace window (below) is full long before the end of this
MEASURED_PER_CLIENT = 60  # 240 requests measured
WINDOW = TraceRetention(full_steps=40, summary_steps=80)
# Python heap growth allowed over the measured 240 requests: noise (interned strings, a dict that doubled,
# the event loop's free lists). One kept StepReport per step would be well over 1 MB here.
MAX_GROWTH_BYTES = 256 * 1024
SHARED = 64  # tokens of a system prompt some requests share: the prefix cache hits and evicts


@pytest.fixture(scope="module")
def app():
    model, tok = load_model(MODEL)
    engine = LLMEngine(model, tok, engine_config(MODEL, max_num_seqs=CLIENTS, num_blocks=64))
    app = build_app(engine, trace=WINDOW)
    attach_dashboard(app)
    with BackgroundServer(app) as server:
        yield server, engine


def send(port: int, n: int, seed: int) -> None:
    rng = random.Random(seed)
    system = [rng.randrange(3, 200) for _ in range(SHARED)]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for i in range(n):
        prompt = (system if i % 2 else []) + [rng.randrange(3, 200) for _ in range(rng.randint(8, 40))]
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                           "ignore_eos": True, "stream": i % 3 == 0})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        assert response.status == 200


def load(port: int, per_client: int, seed: int) -> None:
    threads = [threading.Thread(target=send, args=(port, per_client, seed + i)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)


def python_heap() -> int:
    gc.collect()
    return sum(stat.size for stat in tracemalloc.take_snapshot().statistics("filename"))


@pytest.mark.timeout(600)
def test_the_python_heap_is_flat_once_the_trace_window_is_full(app):
    server, engine = app
    # tracemalloc sees only what is allocated after it starts, so it starts BEFORE the warm-up: a window
    # entry made before it and dropped during the measurement would otherwise look like growth
    tracemalloc.start()
    try:
        load(server.port, WARMUP_PER_CLIENT, seed=0)
        before = python_heap()
        load(server.port, MEASURED_PER_CLIENT, seed=100)
        growth = python_heap() - before
    finally:
        tracemalloc.stop()
    trace = engine.trace
    assert trace.num_recorded > 4 * WINDOW.full_steps  # the window really dropped steps
    assert growth < MAX_GROWTH_BYTES, f"the Python heap grew {growth / 1024:.0f} KiB over 240 requests"
    assert len(trace.steps) == WINDOW.full_steps and len(trace.summaries) == WINDOW.summary_steps


def test_nothing_is_kept_per_request_after_the_run(app):
    server, engine = app
    load(server.port, 5, seed=200)
    front = server.app.state.front
    state = front.call(lambda e: (len(e.requests), len(front._tracked), len(front._owner),
                                  e.block_manager.usage().used_blocks)).result(60)
    assert state == (0, 0, 0, 0)

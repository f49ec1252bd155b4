"""Issue 16: the classroom dashboard. Its numbers follow the engine's StepReports exactly, the server streams
them as server-sent events, a saved trace replays through the same page, and (where Playwright and a
Chromium exist) a real headless browser shows the numbers changing and saves a screenshot."""

import json
import shutil
import threading
import time

import httpx
import pytest

from engine.llm_engine import LLMEngine, engine_config
from engine.serving.dashboard import CACHED, LiveStats, attach_dashboard, replay_app
from engine.serving.server import BackgroundServer, build_app
from engine.trace import Trace
from engine_fixtures import mixed_workload, random_model


def run_with_stats(**options):
    engine = LLMEngine(random_model(seed=3), None, engine_config("random", **options))
    stats = LiveStats()
    workload = mixed_workload(10, seed=3)
    for prompt, params in workload:
        engine.add_request(prompt, params)
    snapshots = []
    while engine.has_unfinished_requests():
        report = engine.step()
        stats.update(report)
        snapshots.append((report, stats.snapshot()))
    return engine, stats, snapshots, workload


def test_snapshots_follow_the_step_reports():
    engine, stats, snapshots, workload = run_with_stats(block_size=4, num_blocks=40, max_num_seqs=4,
                                                        enable_prefix_caching=True)
    for report, snap in snapshots:
        assert snap["step"] == report.step and snap["running"] == len(report.queues.running)
        assert snap["waiting"] == len(report.queues.waiting)
        owners = snap["grid"]["owners"]
        assert sum(o >= 0 for o in owners) == report.blocks.used  # every used block has its owner drawn
        assert sum(o == CACHED for o in owners) == report.blocks.cached
        for i, rid in enumerate(snap["grid"]["ids"]):
            assert {b for b, o in enumerate(owners) if o == i} == {b for b in report.blocks.tables[rid] if b >= 0}
        assert [b[0] for b in snap["batch"]] == [s.request_id for s in report.scheduled]
    last = snapshots[-1][1]
    assert last["finished"] == len(workload) and engine.block_manager.usage().used_blocks == 0
    assert last["ttft_ms"]["n"] == len(workload)  # one first token per request
    assert last["tpot_ms"]["n"] == sum(1 for _, p in workload if p.max_tokens > 1)


def test_preemptions_and_window_frees_are_counted():
    engine, stats, _, _ = run_with_stats(block_size=4, num_blocks=22, max_num_seqs=5, sliding_window=6)
    events = [e for r in engine.trace for e in r.events]
    assert stats.totals["preempted"] == sum(e["type"] == "preempted" for e in events) > 0
    assert stats.totals["window_freed_blocks"] == sum(len(e["blocks"]) for e in events
                                                      if e["type"] == "window_freed") > 0


@pytest.fixture
def dashboard_server():
    engine = LLMEngine.from_pretrained("tinylab", max_num_seqs=4, block_size=16, num_blocks=64)
    app = build_app(engine)
    stats = attach_dashboard(app)
    with BackgroundServer(app) as server:
        yield server, stats


def send_load(url: str, n: int, max_tokens: int = 40) -> threading.Thread:
    def run():
        with httpx.Client(timeout=120) as client:
            for i in range(n):
                client.post(url + "/v1/completions", json={"model": "tinylab", "prompt": f"Once upon a time {i}",
                                                           "max_tokens": max_tokens, "temperature": 0,
                                                           "ignore_eos": True})

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_server_serves_the_page_and_streams_snapshots(dashboard_server):
    server, stats = dashboard_server
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "EventSource(\"/dashboard/events\")" in page.text
    load = send_load(server.url, 3)
    steps = []
    with httpx.stream("GET", server.url + "/dashboard/events", timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                snap = json.loads(line[len("data: "):])
                steps.append(snap["step"])
                if snap.get("finished") == 3:
                    break
    load.join()
    assert steps == sorted(steps) and steps[-1] > steps[0] >= -1  # newer snapshots only, in order
    assert stats.snapshot()["finished"] == 3


def test_a_saved_trace_replays_through_the_same_page(tmp_path):
    engine, _, snapshots, workload = run_with_stats(block_size=4, num_blocks=40, max_num_seqs=4)
    engine.trace.save(tmp_path / "trace.json")
    trace = Trace.load(tmp_path / "trace.json")
    app, player = replay_app(trace, speed=1000.0, loop=False)
    player.start()
    player.join(timeout=30)
    with BackgroundServer(app) as server:
        with httpx.stream("GET", server.url + "/dashboard/events", timeout=30) as response:
            line = next(li for li in response.iter_lines() if li.startswith("data: "))
    assert json.loads(line[len("data: "):]) == json.loads(json.dumps(snapshots[-1][1]))
    with pytest.raises(ValueError, match="speed must be > 0"):
        replay_app(trace, speed=0)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs a Chromium on PATH (apt-get install chromium)")
def test_the_page_updates_live_in_headless_chromium(dashboard_server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")
    server, _ = dashboard_server
    load = send_load(server.url, 6, max_tokens=60)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 760})
        page.goto(server.url + "/dashboard")
        page.wait_for_function("document.getElementById('step').textContent !== '–'", timeout=30_000)
        first = int(page.text_content("#step"))
        page.wait_for_function(f"Number(document.getElementById('step').textContent) > {first}", timeout=30_000)
        assert page.text_content("#status") == "live"
        time.sleep(0.5)
        page.screenshot(path=str(tmp_path / "dashboard.png"))
        browser.close()
    load.join()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000

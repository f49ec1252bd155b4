"""The classroom dashboard (chapter 10): a live page of what the engine is doing, for a projector.

A teacher opens http://HOST:PORT/dashboard while students send requests from their laptops (or from
`python -m engine bench serve`). The page shows the KV block pool as a grid coloured by owner, the
queues, the running batch, TTFT/TPOT percentiles, request rates, preemptions and prefix-cache hits.

Data flow, one way:

    engine thread: step() -> StepReport -> LiveStats.update(report) -> latest snapshot
                                                                       (a small dict)
    HTTP:          GET /dashboard/events  -> server-sent events, the newest snapshot at most
                                             10 times a second (a slow projector laptop never
                                             backs up the engine)
    browser:       static/dashboard.html  -> EventSource, draws the grid on a canvas,
                                             writes the numbers

`attach_dashboard(app)` adds the two routes to a server made by `engine.serving.server.build_app`
and chains `LiveStats` onto its engine's per-step hook.
`python -m engine dashboard --replay TRACE.json` plays a saved `Trace` (e.g. one a benchmark or an
incident wrote) through the same page, at any speed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse

from engine.companions.metrics import nearest_rank
from engine.trace import StepReport, Trace

PAGE = Path(__file__).parent / "static" / "dashboard.html"
FREE, CACHED = -1, -2  # grid cell codes besides an owner's index
SEND_INTERVAL_S = 0.1  # at most 10 snapshots a second per browser
RATE_WINDOW_S = 10.0  # request rates are counted over the last 10 seconds of engine time
LATENCIES_KEPT = 2000  # percentiles over the most recent finished requests


class LiveStats:
    """Folds StepReports, one by one, into the numbers the page shows; `snapshot()` is JSON-ready.

    `update` runs on the engine thread after every step (it is the engine's `on_step` hook), so it
    only counts: a few dict and deque operations. `snapshot()` does the rest (the block grid, the
    percentiles) when someone asks, at most 10 times a second per page, and keeps the result until
    the next step, so a room full of browsers costs the engine nothing."""

    def __init__(self):
        self._arrival: dict[str, float] = {}
        self._first: dict[str, float] = {}  # request id -> time of its first token
        # request id -> (time of its last token, tokens so far)
        self._last: dict[str, tuple[float, int]] = {}
        self.ttft_s: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.tpot_s: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self._arrivals: deque[float] = deque()
        self._finishes: deque[float] = deque()
        self.totals = {"finished": 0, "preempted": 0, "prefix_hit_tokens": 0,
                       "prompt_tokens_looked_up": 0, "window_freed_blocks": 0, "bytes_moved": 0}
        self._report: StepReport | None = None
        self._cached: tuple[int, dict] = (0, {"step": -1})  # (version, snapshot)
        self.version = 0  # bumped by every update: the event stream sends only new snapshots

    def update(self, report: StepReport) -> None:
        now = report.end_time
        for e in report.events:
            self._count(e, now)
        for s in report.scheduled:
            if s.tokens_out:
                self._first.setdefault(s.request_id, now)
                if s.request_id in self._arrival and s.request_id not in self._last:
                    self.ttft_s.append(now - self._arrival[s.request_id])
                count = self._last.get(s.request_id, (now, 0))[1] + s.tokens_out
                self._last[s.request_id] = (now, count)
        for rid in report.queues.finished:
            self._finish(rid, now)
        for window in (self._arrivals, self._finishes):
            while window and window[0] < now - RATE_WINDOW_S:
                window.popleft()
        self._report = report
        self.version += 1

    def snapshot(self) -> dict:
        version, report = self.version, self._report
        if report is not None and self._cached[0] != version:
            self._cached = (version, self._snapshot(report))
        return self._cached[1]

    # ---- helpers ------------------------------------------------------------------------------
    def _count(self, e: dict, now: float) -> None:
        kind = e["type"]
        if kind == "arrived":
            self._arrival[e["request_id"]] = e.get("arrival_time", now)
            self._arrivals.append(now)
        elif kind == "preempted":
            self.totals["preempted"] += 1
        elif kind == "prefix_hit":
            self.totals["prefix_hit_tokens"] += e["num_tokens"]
            self.totals["prompt_tokens_looked_up"] += e["num_query_tokens"]
        elif kind == "window_freed":
            self.totals["window_freed_blocks"] += len(e["blocks"])
        elif kind == "blocks_moved":
            self.totals["bytes_moved"] += e["bytes"]

    def _finish(self, rid: str, now: float) -> None:
        self.totals["finished"] += 1
        self._finishes.append(now)
        first, (last, count) = self._first.pop(rid, None), self._last.pop(rid, (None, 0))
        if first is not None and count > 1:
            self.tpot_s.append((last - first) / (count - 1))
        self._arrival.pop(rid, None)

    def _snapshot(self, report: StepReport) -> dict:
        q, b = report.queues, report.blocks
        ids = list(b.tables)
        owners = [FREE] * b.total
        for b_id in b.cached_block_ids:
            owners[b_id] = CACHED
        for i, rid in enumerate(ids):
            for block in b.tables[rid]:
                if block >= 0:  # NULL_BLOCK (-1): freed by a sliding window
                    owners[block] = i
        looked_up = self.totals["prompt_tokens_looked_up"]
        return {
            "step": report.step, "time": report.end_time,
            "waiting": len(q.waiting), "running": len(q.running), "swapped": len(q.swapped),
            "batch": [[s.request_id, s.phase, s.tokens_in] for s in report.scheduled],
            "grid": {"owners": owners, "ids": ids, "block_size": b.block_size},
            "kv_used_pct": 100.0 * b.used / b.total if b.total else 0.0,
            "ttft_ms": _percentiles(self.ttft_s), "tpot_ms": _percentiles(self.tpot_s),
            "arrivals_per_s": len(self._arrivals) / RATE_WINDOW_S,
            "finished_per_s": len(self._finishes) / RATE_WINDOW_S,
            "prefix_hit_pct": (100.0 * self.totals["prefix_hit_tokens"] / looked_up
                               if looked_up else None),
            **self.totals,
        }


def _percentiles(values: Iterable[float]) -> dict:
    values = list(values)
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    return {"p50": 1e3 * nearest_rank(values, 50), "p99": 1e3 * nearest_rank(values, 99),
            "n": len(values)}


def dashboard_router(stats: LiveStats) -> APIRouter:
    """GET /dashboard (the page) and GET /dashboard/events (server-sent events of snapshots)."""
    router = APIRouter()

    @router.get("/dashboard", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @router.get("/dashboard/events")
    async def events() -> StreamingResponse:
        return StreamingResponse(_stream(stats), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return router


async def _stream(stats: LiveStats):
    sent = -1
    while True:
        if stats.version != sent:
            sent = stats.version
            yield f"data: {json.dumps(stats.snapshot())}\n\n"
        await asyncio.sleep(SEND_INTERVAL_S)


def chain(*hooks: Callable | None) -> Callable:
    """One hook that calls each non-None hook in turn."""
    live = [h for h in hooks if h is not None]

    def call(*args):
        for hook in live:
            hook(*args)

    return call


def attach_dashboard(app: FastAPI) -> LiveStats:
    """Add /dashboard to a server made by `build_app`, fed by its engine's steps;
    returns the stats."""
    stats = LiveStats()
    front = app.state.front
    front.on_step = chain(front.on_step, stats.update)
    app.include_router(dashboard_router(stats))
    return stats


def replay_app(trace: Trace, speed: float = 1.0,
               loop: bool = True) -> tuple[FastAPI, threading.Thread]:
    """An app that serves the dashboard for a saved trace,
    played back at `speed` times real time."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0 (1 = real time, 10 = ten times faster), got {speed!r}")
    if not trace.steps:
        raise ValueError("the trace has no steps to replay")
    app, stats = FastAPI(title="servelab dashboard (replay)"), LiveStats()
    app.include_router(dashboard_router(stats))

    def play() -> None:
        while True:
            t0 = trace.steps[0].start_time
            started = time.monotonic()
            for report in trace.steps:
                delay = (report.end_time - t0) / speed - (time.monotonic() - started)
                if delay > 0:
                    time.sleep(delay)
                stats.update(report)
            if not loop:
                return
            stats.__init__()  # start over with empty numbers

    player = threading.Thread(target=play, name="servelab-replay", daemon=True)
    return app, player

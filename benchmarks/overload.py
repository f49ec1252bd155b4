"""Overload: what the server does when more requests arrive than it can serve, with and without protection.

We start the OpenAI-compatible server (engine/serving/server.py) twice, in a process of its own each time, over
tinylab with the capacity curve's workload (random prompts of 64 +- 50 % tokens, 32 output tokens, EOS
ignored, max_num_seqs 8; benchmarks/capacity_curve.py), and load it from this process:

    1. capacity: a short saturating run (every request at once) on the unprotected server -> C req/s
    2. for each offered load L x C (L from 0.5 to 3), Poisson arrivals for WINDOW seconds, against
         unprotected   everything is admitted; the queue holds whatever arrives
         protected     --max-num-queued-reqs = max_num_seqs + C x TTFT target (Little's law: the
                       queue the server clears within the target) and --queue-timeout-s = TTFT target
       Clients give up on a request GRACE seconds after the window ends (a real user does not wait
       forever either); what they gave up on is "abandoned".

What we report per run: goodput (requests per second of the window that finished within the SLO: TTFT <= 1 s
and TPOT <= 100 ms, the capacity curve's, or 2 x the TPOT at capacity where that is longer), P50/P99 TTFT of
the requests that got a first token, the share rejected (503 at the door or a queue timeout), the abandoned
ones, and, sampled from /metrics every SAMPLE_EVERY_S, the queue (vllm:num_requests_waiting), the KV usage and
the server's resident memory over time (in the JSON's "series"). Latencies are measured by the client,
computed by engine/companions/metrics.py. The machine is shared with other jobs: its load averages are in the settings.

Expected shape: without protection, past 1x the queue grows for as long as the overload lasts, every
request waits behind it, and goodput collapses towards zero although the server is busy all the time;
with protection the extra requests are turned away at once, the queue stays short, and goodput holds
near capacity. Speeds are reported, never asserted.

    python benchmarks/overload.py            # loads 0.5, 1, 1.5, 2, 3 x capacity, 30 s each (about 7 min)
    python benchmarks/overload.py --quick    # 0.5, 1, 3 x, 5 s each (about 2 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks._common import REPO_ROOT, RESULTS_DIR, write_results  # noqa: E402
from engine.companions.metrics import SLO, RequestTiming, nearest_rank  # noqa: E402
from engine.serving.bench_serve import arrival_offsets, payload, random_requests  # noqa: E402

MODEL = "tinylab"
INPUT_LEN, OUTPUT_LEN, RANGE_RATIO = 64, 32, 0.5  # the capacity curve's workload, so the two compare
MAX_NUM_SEQS = 8
TTFT_TARGET_S, TPOT_TARGET_S = 1.0, 0.1  # the capacity curve's --goodput ttft:1000 tpot:100 ...
# ... but a full batch on a slow (or busy) CPU may need more than 100 ms per token even at capacity, and an
# SLO the server misses at its own capacity measures the machine, not overload: the TPOT target is at least
# this many times the median TPOT of the capacity run.
TPOT_HEADROOM = 2.0
CAPACITY_REQUESTS, QUICK_CAPACITY_REQUESTS = 24, 16  # three (two) full batches at once: the steady pace
LOADS, QUICK_LOADS = (0.5, 1.0, 1.5, 2.0, 3.0), (0.5, 1.0, 3.0)
WINDOW_S, QUICK_WINDOW_S = 30.0, 5.0
# Clients wait up to half a window (at least GRACE_MIN_S: a few requests' end-to-end time) after it ends,
# then give up.
GRACE_FRACTION, GRACE_MIN_S = 0.5, 8.0
SAMPLE_EVERY_S = 0.5
SERVER_START_S = 180.0  # importing torch on a busy 2-core machine can take a while
DRAIN_WAIT_S = 60.0


# ---- the server, in a process of its own -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m engine serve ...` in a child process (so the client does not share its GIL)."""

    def __init__(self, flags: list[str]):
        self.port, self.flags = free_port(), flags
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="overload-server-", suffix=".log", delete=False)

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "engine", "serve", "--model", MODEL, "--port", str(self.port),
               "--max-num-seqs", str(MAX_NUM_SEQS), *self.flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the server did not start; its log: {self.log.name}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return math.nan


# ---- the client -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as the client saw it (perf_counter seconds)."""

    sent: float
    status: int | None = None
    code: str | None = None  # the OpenAI error's code: "max_num_queued_reqs", "queue_timeout", ...
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    finish_reason: str | None = None
    abandoned: bool = False

    @property
    def rejected(self) -> bool:
        return self.status == 503 or self.code in ("queue_timeout", "max_num_queued_reqs", "max_num_queued_tokens")

    def timing(self) -> RequestTiming:
        return RequestTiming("", self.sent, self.token_times, finish_time=self.end,
                             finish_reason=self.finish_reason if self.code is None else "abort")


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, out: Outcome) -> None:
    async with client.stream("POST", url, json=body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.code = json.loads(await resp.aread())["error"]["code"]
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk, now = json.loads(line[len("data: "):]), time.perf_counter()
            if "error" in chunk:
                out.code = chunk["error"]["code"]
            for c in chunk.get("choices", []):
                out.token_times += [now] * len(c.get("token_ids", []))
                out.finish_reason = c.get("finish_reason") or out.finish_reason
    out.end = time.perf_counter()


async def one_request(client, url: str, body: dict, due: float, give_up: float) -> Outcome:
    await asyncio.sleep(max(0.0, due - time.perf_counter()))
    out = Outcome(sent=time.perf_counter())
    try:
        timeout = None if math.isinf(give_up) else max(0.0, give_up - out.sent)
        await asyncio.wait_for(stream_one(client, url, body, out), timeout=timeout)
    except TimeoutError:
        out.abandoned = True  # the connection closes: the server aborts the request
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.code = f"client_error: {type(e).__name__}"
    return out


async def sample_server(server: ServerProcess, client: httpx.AsyncClient, start: float, series: list,
                        stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            text = (await client.get(server.url + "/metrics")).text
            values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            series.append({"t_s": round(time.perf_counter() - start, 2),
                           "waiting": int(values.get("vllm:num_requests_waiting", 0)),
                           "running": int(values.get("vllm:num_requests_running", 0)),
                           "kv_usage": round(values.get("vllm:kv_cache_usage_perc", 0.0), 3),
                           "rss_mb": round(server.rss_mb(), 1)})
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


async def run_load(server: ServerProcess, bodies: list[dict], offsets: list[float], give_up_s: float):
    """Send bodies[i] at offsets[i]; returns (outcomes, series, start)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client, \
            httpx.AsyncClient(timeout=10.0) as probe:
        start, series, stop = time.perf_counter(), [], asyncio.Event()
        sampler = asyncio.create_task(sample_server(server, probe, start, series, stop))
        url = server.url + "/v1/completions"
        outcomes = await asyncio.gather(*(one_request(client, url, b, start + t, start + give_up_s)
                                          for b, t in zip(bodies, offsets, strict=True)))
        stop.set()
        await sampler
    return list(outcomes), series, start


def wait_until_idle(server: ServerProcess) -> None:
    deadline = time.monotonic() + DRAIN_WAIT_S
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=10.0).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        if values.get("vllm:num_requests_waiting", 0) + values.get("vllm:num_requests_running", 0) == 0:
            return
        time.sleep(0.2)


# ---- the experiment ---------------------------------------------------------------------------------------


def load_tokenizer():
    from engine.loading.loader import resolve_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_path(MODEL))


def workload(tok, n: int, seed: int) -> list[dict]:
    """n request bodies of the capacity curve's random workload (seeded: every run sends the same ones)."""
    special = [i for i in (tok.bos_token_id, tok.pad_token_id, *tok.eos_token_ids) if i is not None]
    reqs = random_requests(n, INPUT_LEN, OUTPUT_LEN, RANGE_RATIO, tok.vocab_size, seed, special)
    return [payload(r, MODEL, chat=False, ignore_eos=True, temperature=0.0) for r in reqs]


def measure_capacity(server: ServerProcess, bodies: list[dict]) -> tuple[float, SLO]:
    """Requests per second with every request sent at once (the queue is never empty), and the SLO we
    hold the runs to (TTFT_TARGET_S; TPOT_TARGET_S, or TPOT_HEADROOM x the TPOT seen at capacity)."""
    asyncio.run(run_load(server, bodies[:1], [0.0], math.inf))  # warm up
    outcomes, _, start = asyncio.run(run_load(server, bodies, [0.0] * len(bodies), math.inf))
    done = [o for o in outcomes if o.end is not None and o.code is None]
    tpot = nearest_rank([o.timing().tpot_s for o in done], 50)
    slo = SLO(TTFT_TARGET_S, max(TPOT_TARGET_S, math.ceil(TPOT_HEADROOM * tpot * 100) / 100))
    return len(done) / (max(o.end for o in done) - start), slo


def give_up_after(window: float) -> float:
    return window + max(GRACE_FRACTION * window, GRACE_MIN_S)


def summarize_run(protection: str, load: float, capacity: float, slo: SLO, window: float,
                  outcomes: list[Outcome], series: list[dict], start: float) -> dict:
    """One row. Goodput is per second of the run: the window, or until the last served request ended."""
    served = [o for o in outcomes if o.code is None and not o.abandoned and o.end is not None]
    duration = max([window] + [o.end - start for o in served])
    answered = [o.timing().ttft_s for o in outcomes if o.token_times]
    in_window = [s for s in series if s["t_s"] <= window]
    met = sum(slo.met_by(o.timing()) for o in served)
    return {
        "protection": protection, "load_x": load, "offered_req_s": round(load * capacity, 3), "sent": len(outcomes),
        "served": len(served), "rejected_share": round(sum(o.rejected for o in outcomes) / max(1, len(outcomes)), 3),
        "abandoned": sum(o.abandoned for o in outcomes),
        "duration_s": round(duration, 2),
        "goodput_req_s": round(met / duration, 3), "goodput_x_capacity": round(met / duration / capacity, 3),
        "p50_ttft_s": _round(nearest_rank(answered, 50)), "p99_ttft_s": _round(nearest_rank(answered, 99)),
        "max_waiting": max((s["waiting"] for s in series), default=0),
        "waiting_at_window_end": in_window[-1]["waiting"] if in_window else 0,
        "max_kv_usage": max((s["kv_usage"] for s in series), default=0.0),
        "max_rss_mb": max((s["rss_mb"] for s in series), default=math.nan),
    }


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 3)


def sweep(flags: list[str], protection: str, loads, capacity: float | None, slo: SLO | None, window: float,
          tok, seed: int, capacity_requests: int = CAPACITY_REQUESTS):
    """One server with `flags`, one run per load; capacity None: measure it (and the SLO) first, here."""
    rows, series_out = [], {}
    with ServerProcess(flags) as server:
        if capacity is None:
            capacity, slo = measure_capacity(server, workload(tok, capacity_requests, seed + 1))
            print(f"capacity: {capacity:.2f} req/s; SLO {slo}")
        for load in loads:
            rate = load * capacity
            enough = math.ceil(2 * rate * window) + 10  # Poisson arrivals: far more than the window can hold
            offsets = [t for t in arrival_offsets(enough, rate, 1.0, seed) if t < window]
            bodies = workload(tok, len(offsets), seed)
            outcomes, series, start = asyncio.run(run_load(server, bodies, offsets, give_up_after(window)))
            wait_until_idle(server)
            row = summarize_run(protection, load, capacity, slo, window, outcomes, series, start)
            print(json.dumps(row))
            rows.append(row)
            series_out[f"{protection}@{load}x"] = series
    return rows, series_out, capacity, slo


def protection_flags(capacity: float, slo: SLO) -> tuple[list[str], dict]:
    backlog = max(1, math.ceil(capacity * slo.ttft_s))
    settings = {"max_num_queued_reqs": MAX_NUM_SEQS + backlog, "queue_timeout_s": slo.ttft_s}
    return ["--max-num-queued-reqs", str(settings["max_num_queued_reqs"]),
            "--queue-timeout-s", str(settings["queue_timeout_s"])], settings


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer loads, shorter windows (about 2 minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=None, help=f"where to write overload.json/.md (default {RESULTS_DIR})")
    args = p.parse_args(argv)
    loads, window = (QUICK_LOADS, QUICK_WINDOW_S) if args.quick else (LOADS, WINDOW_S)
    t0, load_before = time.perf_counter(), os.getloadavg()
    tok = load_tokenizer()
    n_capacity = QUICK_CAPACITY_REQUESTS if args.quick else CAPACITY_REQUESTS
    rows, series, capacity, slo = sweep([], "none", loads, None, None, window, tok, args.seed, n_capacity)
    flags, protected = protection_flags(capacity, slo)
    more_rows, more_series, *_ = sweep(flags, "protected", loads, capacity, slo, window, tok, args.seed)
    settings = {"quick": args.quick, "model": MODEL, "random_input_len": INPUT_LEN, "random_output_len": OUTPUT_LEN,
                "random_range_ratio": RANGE_RATIO, "ignore_eos": True, "max_num_seqs": MAX_NUM_SEQS,
                "arrivals": "Poisson", "window_s": window, "client_gives_up_after_s": give_up_after(window),
                "slo": f"ttft <= {slo.ttft_s} s, tpot <= {slo.tpot_s} s",
                "capacity_req_s": round(capacity, 3), "capacity_from": f"{n_capacity} requests at once",
                "protected_flags": " ".join(flags), **protected,
                "server": "a child process (python -m engine serve), 1 torch thread; the client in this one",
                "wall_s": round(time.perf_counter() - t0), "load_avg_1min_before": round(load_before[0], 2),
                "load_avg_1min_after": round(os.getloadavg()[0], 2)}
    json_path, _ = write_results("overload", rows + more_rows, settings, NOTES, args.results_dir)
    data = json.loads(json_path.read_text())
    data["series"] = {**series, **more_series}  # queue, KV usage and memory over time, per run
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {json_path}")


NOTES = """Offered load from 0.5x to 3x the capacity measured at the start, with no protection and with a queue cap
(max_num_seqs + capacity x TTFT target) plus a queue timeout (the TTFT target). goodput_req_s counts requests
that finished within the SLO per second of the run (the load window, or until the last served request ended);
rejected_share is 503s at the door plus queue timeouts; abandoned requests are those the client gave up on
(client_gives_up_after_s after the start); p50/p99 TTFT are over the requests that got a first token.
max_waiting and waiting_at_window_end are the server's waiting queue sampled from /metrics; the JSON's
"series" has it over time, with KV usage and the server's resident memory. The machine is shared with other
jobs (load averages in the settings): single runs, noisy; reported, never asserted."""


if __name__ == "__main__":
    main()

"""A soak test: tens of thousands of requests through `python -m engine serve`; is its memory flat?

A server runs for weeks, so whatever it keeps per request or per step must be bounded in bytes. We start the
real server (a subprocess, prefix caching on, its default trace window), send REQUESTS completions over
keep-alive connections from CLIENTS threads, and read the server's resident memory (VmRSS, /proc/PID/status)
every SAMPLE_EVERY requests. Prompts are long (a system prompt from a small set, so the prefix cache hits and
evicts, then a fresh user turn) and answers short, so requests, not tokens, dominate: the per-request state
is what we are testing.

    python benchmarks/soak.py                     # 20,000 requests, tinylab (about 10 minutes on 2 cores)
    python benchmarks/soak.py --compare           # the same without pinned malloc thresholds first
    python benchmarks/soak.py --requests 3000 --results-dir /tmp/soak      # a smoke run

The verdict (flat = after the warm-up, the largest RSS sample is within FLAT_TOLERANCE of the smallest) is
reported, never asserted; tests/test_soak.py runs a short in-process version that asserts the bounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from benchmarks._common import REPO_ROOT, markdown_table, write_results  # noqa: E402

REQUESTS = 20_000
CLIENTS = 8  # concurrent keep-alive connections
SAMPLE_EVERY = 1_000
WARMUP_REQUESTS = 2_000  # the first samples: caches, allocator arenas and the trace window fill up
FLAT_TOLERANCE = 0.10  # the bar: RSS flat within 10 % after warm-up
SYSTEM_PROMPTS = 24  # distinct system prompts: the prefix cache hits, fills and evicts
SYSTEM_TOKENS = 256
USER_TOKENS = (24, 96)
MAX_TOKENS = 4
FIRST_TOKEN_ID = 3  # 0-2 are pad / bos / eos
VOCAB = 101  # prompt ids come from [FIRST_TOKEN_ID, VOCAB): inside tinylab's vocabulary (1024)
SEED = 0
STARTUP_S = 120.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, model: str, trace_steps: int | None, pin_malloc: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine", "serve", "--model", model, "--port", str(port), "--no-dashboard",
           "--max-num-seqs", str(CLIENTS), "--shutdown-timeout", "5",
           "--pin-malloc" if pin_malloc else "--no-pin-malloc"]
    if trace_steps is not None:
        cmd += ["--trace-steps", str(trace_steps)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited at start:\n{proc.stderr.read()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


class Clients:
    """CLIENTS threads, each a keep-alive connection sending completions until `total` were sent."""

    def __init__(self, port: int, total: int, model: str):
        self.port, self.total, self.model = port, total, model
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        rng = random.Random(SEED)
        self.systems = [[rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(SYSTEM_TOKENS)]
                        for _ in range(SYSTEM_PROMPTS)]

    def _next(self) -> int | None:
        with self.lock:
            if self.sent >= self.total:
                return None
            self.sent += 1
            return self.sent

    def client(self, index: int) -> None:
        rng = random.Random(SEED + 1 + index)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while (i := self._next()) is not None:
            prompt = rng.choice(self.systems) + [rng.randrange(FIRST_TOKEN_ID, VOCAB)
                                                 for _ in range(rng.randint(*USER_TOKENS))]
            body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                               "temperature": 0, "ignore_eos": True, "stream": i % 4 == 0})
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                with self.lock:
                    self.ok += response.status == 200
                    if response.status != 200:
                        self.errors.append(f"{response.status}")
            except (OSError, http.client.HTTPException) as e:
                with self.lock:
                    self.errors.append(repr(e))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)


def soak(requests: int, model: str, trace_steps: int | None, pin_malloc: bool) -> tuple[list[dict], dict]:
    port = free_port()
    proc = start_server(port, model, trace_steps, pin_malloc)
    load = Clients(port, requests, model)
    threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(CLIENTS)]
    def row(n: int) -> dict:
        return {"pin_malloc": pin_malloc, "requests": n, "rss_mib": round(rss_bytes(proc.pid) / 2**20, 1),
                "elapsed_s": round(time.time() - t0, 1)}

    t0 = time.time()
    rows = [row(0)]
    for t in threads:
        t.start()
    next_sample = SAMPLE_EVERY
    while any(t.is_alive() for t in threads):
        time.sleep(0.2)
        if load.ok + len(load.errors) >= next_sample:
            rows.append(row(next_sample))
            print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
            next_sample += SAMPLE_EVERY
    if rows[-1]["requests"] != load.ok + len(load.errors):
        rows.append(row(load.ok + len(load.errors)))
    proc.send_signal(signal.SIGTERM)
    exit_code = proc.wait(30)
    stderr = proc.stderr.read()
    held = [line for line in stderr.splitlines() if "still held" in line]
    return rows, {"ok": load.ok, "errors": len(load.errors), "first_errors": load.errors[:5], "exit_code": exit_code,
                  "at_exit": held[-1].split("INFO:", 1)[-1].strip() if held else "(no exit line)"}


def verdict(rows: list[dict]) -> dict:
    after = [r["rss_mib"] for r in rows if r["requests"] >= WARMUP_REQUESTS]
    if len(after) < 2:
        return {"flat": None, "spread_pct": None}
    spread = max(after) / min(after) - 1
    return {"flat": spread <= FLAT_TOLERANCE, "spread_pct": round(100 * spread, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--model", default="tinylab", choices=["tinylab"],
                        help="tinylab only: its vocabulary sizes the random prompts")
    parser.add_argument("--trace-steps", type=int, default=None, help="the server's --trace-steps (default its own)")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--compare", action="store_true",
                        help="first a server started with --no-pin-malloc, then the default one")
    args = parser.parse_args(argv)
    rows, outcomes = [], {}
    for pin in ((False, True) if args.compare else (True,)):
        part, outcome = soak(args.requests, args.model, args.trace_steps, pin)
        outcomes["pinned" if pin else "unpinned"] = {**verdict(part), **outcome}
        print(json.dumps(outcomes), flush=True)
        rows += part
    print("\n" + markdown_table(rows))
    settings = dict(model=args.model, requests=args.requests, clients=CLIENTS, system_prompts=SYSTEM_PROMPTS,
                    system_tokens=SYSTEM_TOKENS, user_tokens=f"{USER_TOKENS[0]}-{USER_TOKENS[1]}",
                    max_tokens=MAX_TOKENS, prefix_caching="on (default)",
                    trace_steps=args.trace_steps or "server default", warmup_requests=WARMUP_REQUESTS,
                    **{f"{k}_{field}": v for k, o in outcomes.items() for field, v in o.items()})
    notes = (f"Server RSS (VmRSS of the `python -m engine serve` process) every {SAMPLE_EVERY} requests; 1 in 4 "
             f"requests streamed. Flat = after {WARMUP_REQUESTS} requests of warm-up, the largest sample is within "
             f"{100 * FLAT_TOLERANCE:.0f} % of the smallest (spread_pct). Ends with SIGTERM: exit_code and the "
             "server's last line (KV blocks still held). pin_malloc: the server's --pin-malloc (default on: "
             "glibc's mmap/trim thresholds pinned, engine/serving/lifecycle.py) or --no-pin-malloc.")
    write_results("soak", rows, settings, notes=notes, results_dir=args.results_dir)


if __name__ == "__main__":
    main()

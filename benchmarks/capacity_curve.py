"""The capacity curve: sweep the offered request rate against the HTTP server, find the knee.

We start the OpenAI-compatible server in this process (`engine.serving.server.BackgroundServer`, a free loopback
port) over tinylab, and for each request rate run `engine.serving.bench_serve.benchmark` (vLLM's `bench serve`):
the same seeded requests each time, Poisson arrivals at that rate (inf: all at once), streamed, timed by
the client. Per rate we record what a capacity plan needs:

    request throughput   requests served per second (the run: first send -> last token)
    goodput              requests per second that met the SLO (TTFT and TPOT limits below)
    TTFT, TPOT           P50 and P99 (nearest rank, engine/companions/metrics.py)

The knee (`engine.viz.serving.capacity_knee`): going up in rate, the last rate at which at least 90 % of
the served requests met the SLO, every lower rate passing too. Past it, throughput still grows a little
while goodput falls: the server is busy, and late. We also report the first rate whose P99 TTFT leaves
the SLO. Reported, never asserted.

    python benchmarks/capacity_curve.py            # 32 requests per rate, 0.5 ... 8 req/s and inf (~4 min)
    python benchmarks/capacity_curve.py --quick    # 8 shorter requests at 1, 4 and inf (a smoke run)
    python benchmarks/capacity_curve.py --quick --results-dir /tmp/capacity
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from benchmarks._common import markdown_table, model_provenance, write_results  # noqa: E402
from benchmarks.prefix_cache import cpu_simd_flags  # noqa: E402
from engine.companions.metrics import SLO  # noqa: E402
from engine.serving.bench_serve import benchmark, random_requests  # noqa: E402
from engine.threads import use_threads  # noqa: E402
from engine.viz.serving import KNEE_FRACTION, capacity_knee  # noqa: E402

MODEL = "tinylab"
THREADS = 1  # one torch thread: steadier on a shared machine (engine/threads.py)
MAX_NUM_SEQS = 8  # the server's batch: enough to show batching, small enough to saturate on a CPU
# The SLO a chat user would accept from this small model on a CPU: the first token within a second, then
# at least 10 tokens per second. Fixed before measuring, so the knee is where THIS promise breaks.
SLO_TTFT_MS, SLO_TPOT_MS = 1000.0, 100.0
RANGE_RATIO = 0.5  # lengths uniform in [L / 2, 3L / 2]: a mix, not one size
FIRST_TOKEN_ID = 3  # random prompts use ids from here up: 0-2 are pad / bos / eos
SEED = 0
FULL = dict(requests=32, input_len=64, output_len=32, rates=(0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, math.inf))
QUICK = dict(requests=8, input_len=32, output_len=16, rates=(1.0, 4.0, math.inf))
WARMUP_REQUESTS = 2


def start_server():
    """tinylab behind the HTTP server on a free loopback port; returns (server, vocab size, model folder)."""
    from engine.llm_engine import LLMEngine, engine_config
    from engine.loading.loader import load_model, resolve_model_path
    from engine.serving.server import BackgroundServer, build_app

    folder = resolve_model_path(MODEL)
    model, tokenizer = load_model(folder)
    engine = LLMEngine(model, tokenizer, engine_config(MODEL, max_num_seqs=MAX_NUM_SEQS, num_threads=THREADS))
    return BackgroundServer(build_app(engine, MODEL)).start(), model.config.vocab_size, folder


def sweep(url: str, vocab: int, cfg: dict, slo: SLO) -> list[dict]:
    """One bench run per rate, the same requests each time; vLLM's result dict per rate."""
    requests = random_requests(cfg["requests"], cfg["input_len"], cfg["output_len"], RANGE_RATIO, vocab, SEED,
                               avoid_ids=range(FIRST_TOKEN_ID))
    warmup = requests[:WARMUP_REQUESTS]
    asyncio.run(benchmark(url, MODEL, warmup, ignore_eos=True, disable_tqdm=True))
    results = []
    for rate in cfg["rates"]:
        run = asyncio.run(benchmark(url, MODEL, requests, rate, burstiness=1.0, seed=SEED, ignore_eos=True,
                                    slo=slo, percentile_metrics=("ttft", "tpot", "itl", "e2el"),
                                    percentiles=(50, 99), disable_tqdm=True))
        results.append(run.result)
        print(f"rate {rate:g} req/s: {run.result['request_throughput']:.2f} served/s, goodput "
              f"{run.result['request_goodput']:.2f}/s, P99 TTFT {run.result['p99_ttft_ms']:.0f} ms", flush=True)
    return results


def rows_of(results: list[dict], slo: SLO) -> list[dict]:
    """The table: one row per rate, the knee and the first P99-TTFT violation marked."""
    knee = capacity_knee(results)
    broken = next((r["request_rate"] for r in results if r["p99_ttft_ms"] > slo.ttft_s * 1e3), None)
    rows = []
    for r in results:
        rate = r["request_rate"]
        marks = [m for m, hit in (("knee", rate == knee), ("P99 TTFT > SLO from here", rate == broken)) if hit]
        rows.append({
            "request_rate": "inf" if math.isinf(rate) else rate, "completed": r["completed"],
            "failed": r["failed"], "duration_s": round(r["duration"], 2),
            "request_throughput": round(r["request_throughput"], 3),
            "request_goodput": round(r["request_goodput"], 3),
            "goodput_fraction": round(r["request_goodput"] / r["request_throughput"], 3),
            "output_throughput": round(r["output_throughput"], 1),
            **{f"p{q}_{m}_ms": round(r[f"p{q}_{m}_ms"], 1) for m in ("ttft", "tpot") for q in (50, 99)},
            "p99_e2el_ms": round(r["p99_e2el_ms"], 1), "mark": ", ".join(marks) or "-"})
    return rows


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 shorter requests at 3 rates (a smoke run)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where to write capacity_curve.json/.md (default benchmarks/results/)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    use_threads(THREADS)
    slo = SLO(ttft_s=SLO_TTFT_MS / 1e3, tpot_s=SLO_TPOT_MS / 1e3)
    load_before, start = round(os.getloadavg()[0], 2), time.perf_counter()
    server, vocab, folder = start_server()
    try:
        results = sweep(server.url, vocab, cfg, slo)
    finally:
        server.stop()
    rows = rows_of(results, slo)
    knee = capacity_knee(results)
    print("\n" + markdown_table(rows))
    settings = dict(quick=args.quick, model=MODEL, num_prompts=cfg["requests"],
                    random_input_len=cfg["input_len"], random_output_len=cfg["output_len"],
                    random_range_ratio=RANGE_RATIO, ignore_eos=True, arrivals="Poisson (burstiness 1)",
                    goodput=f"ttft:{SLO_TTFT_MS:g} tpot:{SLO_TPOT_MS:g}", max_num_seqs=MAX_NUM_SEQS,
                    knee_rule=f"goodput >= {KNEE_FRACTION:g} x throughput", knee_req_s=knee,
                    torch_threads=torch.get_num_threads(), engine_threads=THREADS,
                    cpu_flags=" ".join(cpu_simd_flags()) or "unknown", wall_s=round(time.perf_counter() - start),
                    load_avg_1min_before=load_before, load_avg_1min_after=round(os.getloadavg()[0], 2),
                    model_weights=model_provenance(folder))
    write_results("capacity_curve", rows, settings, notes=_notes(knee, max(cfg["rates"])), results_dir=args.results_dir)


def _notes(knee: float | None, top: float) -> str:
    where = (f"The knee is at {knee:g} req/s." if knee is not None and knee != top else
             "Every rate met the SLO: the knee lies beyond this sweep." if knee == top else
             "Even the lowest rate missed the SLO: no knee in this sweep.")
    return ("The OpenAI-compatible server (engine/serving/server.py) over tinylab, in the benchmark's own process on a "
            "loopback port, loaded by engine/serving/bench_serve.py (vLLM's bench serve): the same seeded random "
            "requests at each rate, Poisson arrivals, streamed, EOS ignored so every request writes its drawn "
            "length. Latencies are client-side (HTTP and the client's event loop included); client, server and "
            "engine share this process (and Python's GIL) and the machine's cores with other jobs: the load "
            "averages before and after are in the settings. Knee: the last rate, going up, at which >= 90 % of "
            f"the served requests met the SLO (goodput >= 0.9 x throughput). {where} Reported, never asserted.")


if __name__ == "__main__":
    main()

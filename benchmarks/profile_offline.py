"""Where an offline run's time goes, with the linear weights as loaded and with packed weights: a profile of each.

One process, SmolLM2-135M-Instruct in fp32 (the real weights, converted once from the registry package's GGUF
file), the same random token-id prompts, greedy, EOS ignored. The same workload runs twice through
`LLM.generate`, once with `weight_layout="linear"` (nn.Linear's [N, K] weights, what the engine ran before
engine/fast/packed_linear.py) and once with `"packed"` (the default on a CPU), each under torch's profiler. For each
we write the wall time, the share of each part of a step (from the engine's own `StepReport.time_s`), and the
ops that took the most time. Then, without the profiler, pure decode steps at batch 1 and 16: the share of a
step spent outside the forward (scheduling, sampling, bookkeeping), the per-step overhead the issue asks about.

    python benchmarks/profile_offline.py            # 32 prompts x 32 new tokens, ~3 minutes on 2 cores
    python benchmarks/profile_offline.py --quick    # 8 prompts x 8 tokens
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import torch  # noqa: E402
from torch.profiler import profile  # noqa: E402

from benchmarks._common import REAL_MODEL, RESULTS_DIR, markdown_table, write_results  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.loader import load_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

FULL = dict(prompts=32, new_tokens=32)
QUICK = dict(prompts=8, new_tokens=8)
PROMPT_LENGTHS = (32, 256)  # as benchmarks/vs_vllm.py's offline prompts
TOP_OPS = 10
DECODE_CONTEXT = 128  # prompt tokens of the pure-decode measurement
DECODE_STEPS = 16
SEED = 0


def offline_prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_LENGTHS))] for _ in range(n)]


def step_shares(reports) -> dict:
    """Percent of all steps' time in each part of `TimeSplit`."""
    parts = ("schedule", "prefill", "decode", "sample", "other")
    totals = {p: sum(getattr(r.time_s, p) for r in reports) for p in parts}
    whole = sum(totals.values())
    return {f"{p}_pct": round(100 * t / whole, 1) for p, t in totals.items()}


def profiled_run(llm: LLM, prompts, new_tokens: int) -> tuple[dict, str]:
    """One offline run under the profiler: its numbers, and the top ops as a markdown table."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    first = len(llm.engine.trace.steps)
    start = time.perf_counter()
    with profile() as prof:
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    reports = llm.engine.trace.steps[first:]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    table = markdown_table([{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 1),
                             "self_pct": round(100 * e.self_cpu_time_total / total, 1)} for e in ops])
    row = {"wall_s_profiled": round(wall, 2), "tok_s_profiled": round(len(prompts) * new_tokens / wall, 1),
           "steps": len(reports), **step_shares(reports)}
    return row, table


def decode_overhead(llm: LLM, batch: int, vocab: int) -> dict:
    """Pure decode steps of `batch` sequences (no profiler): step time and the share outside the forward."""
    engine, rng = llm.engine, random.Random(SEED + batch)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(DECODE_CONTEXT)], params)
    reports = []
    while engine.has_unfinished_requests():
        reports.append(engine.step())
    decodes = [r for r in reports if r.time_s.prefill == 0 and r.time_s.decode > 0]
    step = statistics.median(r.time_s.total for r in decodes)
    outside = statistics.median((r.time_s.schedule + r.time_s.sample + r.time_s.other) / r.time_s.total
                                for r in decodes)
    return {f"decode_b{batch}_step_ms": round(1e3 * step, 1),
            f"decode_b{batch}_outside_forward_pct": round(100 * outside, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine (default 2)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    model, _ = load_model(REAL_MODEL)
    vocab = model.config.vocab_size
    prompts = offline_prompts(cfg["prompts"], vocab)
    load_before = [round(x, 2) for x in os.getloadavg()]
    rows, tables = [], []
    for layout in ("linear", "packed"):
        llm = LLM(model, None, num_threads=args.threads, max_num_seqs=64, weight_layout=layout)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        row, table = profiled_run(llm, prompts, cfg["new_tokens"])
        for batch in (1, 16):
            row.update(decode_overhead(llm, batch, vocab))
        rows.append({"weight_layout": layout, "threads": args.threads, **row})
        tables.append(f"### Top {TOP_OPS} ops, weight_layout = {layout}\n\n{table}")
        print(markdown_table(rows[-1:]), flush=True)
        del llm
    settings = dict(quick=args.quick, model=REAL_MODEL, dtype="float32", **cfg, prompt_lengths=list(PROMPT_LENGTHS),
                    decode_context=DECODE_CONTEXT, decode_steps=DECODE_STEPS, torch=torch.__version__,
                    load_avg_before=load_before, load_avg_after=[round(x, 2) for x in os.getloadavg()])
    notes = (__doc__.split("\n\n")[1] + "\n\n*_pct: share of the offline run's step time (StepReport.time_s); "
             "decode_bN_outside_forward_pct: median share of a pure decode step at batch N spent in scheduling, "
             "sampling and bookkeeping. Timings under the profiler are slower than without it: compare the two "
             "rows with each other. The engine's C kernels (decode and prefill attention, the layer ops, gemv: "
             "kernels/*/cpu_native.c, called through ctypes) do not appear in torch's profiler: their time is the "
             "part of the step that the listed ops leave.\n\n" + "\n\n".join(tables))
    write_results("profile_offline", rows, settings, notes=notes, results_dir=args.results_dir)


if __name__ == "__main__":
    main()

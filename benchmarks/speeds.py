"""The one switch, measured: `speed="reference"` (the spine alone) against `speed="fast"` (the fast wing).

Both engines run the same model, the same random token ids and the same greedy requests, side by side in
one process, interleaved (reference, fast, reference, fast, ... after one warm-up each), so a slow patch of a
shared machine falls on both; every number is a median over the repeats.

    batch-1 decode   tokens per second of one sequence: (time for 1 + N tokens - time for 1 token) / N
    offline          tokens per second of a batch of prompts generated together (prefill and decode)

The greedy tokens of both speeds are compared too (they must be equal: the tests check it on every policy).

    python benchmarks/speeds.py                 # tinylab and the real model, 1 thread
    python benchmarks/speeds.py --quick         # a smoke run
    python benchmarks/speeds.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from benchmarks._common import write_results  # noqa: E402
from benchmarks.prefix_cache import cpu_simd_flags  # noqa: E402
from engine import LLM, SamplingParams, load_model  # noqa: E402

SPEEDS = ("reference", "fast")
QUICK_ENV = "SERVELAB_FAST"
FULL = {"decode_tokens": 32, "offline_prompts": 16, "offline_tokens": 32, "prompt_len": 64, "repeats": 5}
QUICK = {"decode_tokens": 4, "offline_prompts": 4, "offline_tokens": 4, "prompt_len": 16, "repeats": 1}
MODELS = ("tinylab", "smollm2-135m-instruct")


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def timed(llm: LLM, batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def bench_model(name: str, cfg: dict, threads: int) -> list[dict]:
    model, tok = load_model(name)
    engines = {s: LLM(model, tok, speed=s, num_threads=threads, max_num_seqs=cfg["offline_prompts"])
               for s in SPEEDS}
    one = prompts(model.config.vocab_size, 1, cfg["prompt_len"], seed=1)
    batch = prompts(model.config.vocab_size, cfg["offline_prompts"], cfg["prompt_len"], seed=2)
    times = {s: {"first": [], "decode": [], "offline": []} for s in SPEEDS}
    tokens = {}
    for llm in engines.values():  # warm-up: the fast wing compiles its C kernels on first use
        timed(llm, one, 1 + cfg["decode_tokens"])
    for _ in range(cfg["repeats"]):
        for s, llm in engines.items():
            times[s]["first"].append(timed(llm, one, 1)[0])
            times[s]["decode"].append(timed(llm, one, 1 + cfg["decode_tokens"])[0])
            seconds, tokens[s] = timed(llm, batch, cfg["offline_tokens"])
            times[s]["offline"].append(seconds)
    rows = []
    for s in SPEEDS:
        per_token = (statistics.median(times[s]["decode"]) - statistics.median(times[s]["first"]))
        per_token /= cfg["decode_tokens"]
        offline = cfg["offline_prompts"] * cfg["offline_tokens"] / statistics.median(times[s]["offline"])
        rows.append({"model": name, "speed": s, "threads": threads,
                     "decode_tok_s": round(1 / per_token, 1), "offline_tok_s": round(offline, 1)})
    ref, fast = rows
    for key in ("decode_tok_s", "offline_tok_s"):  # the reference is the unit
        ref["x_" + key.removesuffix("_tok_s")] = 1.0
        fast["x_" + key.removesuffix("_tok_s")] = round(fast[key] / ref[key], 2)
    fast["tokens_equal"] = ref["tokens_equal"] = tokens["reference"] == tokens["fast"]
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} (or {QUICK_ENV}=1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both engines (default 1)")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--results-dir", default=None, help="write here instead of benchmarks/results/")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick or os.environ.get(QUICK_ENV) == "1" else FULL
    rows = []
    for name in args.models:
        try:
            rows += bench_model(name, cfg, args.threads)
        except FileNotFoundError as err:  # the real model's package is missing: say so, go on
            print(f"{name}: skipped ({err})")
        print("\n".join(str(r) for r in rows[-2:]))
    notes = ("x_decode / x_offline: the fast engine's tokens/s over the reference engine's, measured in the "
             "same run. tokens_equal: both speeds generated the same greedy tokens for the offline batch.")
    flags = " ".join(cpu_simd_flags()) or "unknown"
    write_results("speeds", rows, {**cfg, "threads": args.threads, "cpu_flags": flags}, notes=notes,
                  results_dir=args.results_dir)


if __name__ == "__main__":
    main()

"""Tensor parallel, pipeline parallel and replicas on this machine: step time, throughput, communication.

One workload for every configuration: NUM_PROMPTS prompts of random token ids (PROMPT_TOKENS long),
OUTPUT_TOKENS new tokens each (greedy, EOS ignored), all added at once (offline), one torch thread per
process. The configurations (chapter 08):

    TP=1          the single-process engine: the baseline
    TP=2          every layer's matmuls split over 2 ranks, 2 L + 1 all-reduces per step (+ a logits gather)
    PP=2 M=m      the layers split into 2 stages, each step's requests cut into m micro-batches
    replicas=n    n whole engines in their own processes behind a router (engine/replicas/replicas.py)

For each we report the median step time of prefill-heavy steps (a prompt in the batch) and of decode
steps, the offline tokens/s, and what rank 0 measured of its own communication (`engine.runner.comm_stats`):
the seconds it spent inside collectives per step and as a share of the step, and the bytes it handed to
them per generated token (the step plan's broadcast apart). Pipelines also give the bubble of each step,
measured from `engine.runner.timeline` (the stages' busy spans) beside the formula (P - 1) / (M + P - 1).
Every configuration's greedy tokens are compared with TP=1's (recorded, not asserted: a split model adds
its partial sums in another order). Configurations take turns, round after round, so a busy moment of
this shared machine hits all of them; each engine is started fresh for its turn and shut down after it.

    python benchmarks/parallelism.py                    # tinylab and SmolLM2-135M, 2 rounds
    python benchmarks/parallelism.py --models tinylab
    python benchmarks/parallelism.py --quick            # or SERVELAB_BENCH_QUICK=1: a smoke run, to a temp dir
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from benchmarks._common import REAL_MODEL, markdown_table, model_provenance, write_results  # noqa: E402
from engine.llm_engine import LLMEngine, engine_config  # noqa: E402
from engine.replicas.replicas import ReplicaPool  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.threads import use_threads  # noqa: E402
from engine.trace import StepReport  # noqa: E402

THREADS = 1  # torch threads per process (per rank, per replica): the same for every configuration
FIRST_TOKEN_ID = 3  # prompts are random ids from here up: 0-2 are pad / bos / eos
SEED = 0
ROUTER = "least_outstanding"  # all prompts arrive at once: it alternates between the replicas
QUICK_ENV = "SERVELAB_BENCH_QUICK"  # set to 1 for the quick run without the flag
FULL = dict(prompts=16, prompt_tokens=(32, 128), output_tokens=32, rounds=2)
QUICK = dict(prompts=4, prompt_tokens=(16, 32), output_tokens=8, rounds=1)
WARMUP = dict(prompts=2, prompt_tokens=8, output_tokens=4)  # first-call costs out of the timed run
PLAN = "broadcast_object"  # rank 0's per-step plan: the scheduling decision, not the model's data
# Words for the "why" paragraph, each with its reason. Collectives that move bytes slower than this are
# paying per-call latency (a wake-up, a socket round trip), not bandwidth: a RAM copy runs at ~10 GB/s.
LATENCY_BOUND_BYTES_PER_S = 1e9
SCALES_WELL = 1.5  # replicas=2 at >= 1.5x replicas=1's tokens/s: most of a second core's worth
BUBBLE_TOLERANCE = 0.05  # bubbles closer than this (step to step noise) count as "no change"
# SmolLM2-135M has 9 query heads and 3 KV heads: TP=2 is refused, TP=3 works (3 ranks on 2 cores).
SETUPS = {
    "tinylab": [("TP=1", {}), ("TP=2", dict(tensor_parallel_size=2)),
                ("PP=2 M=1", dict(pipeline_parallel_size=2, num_micro_batches=1)),
                ("PP=2 M=2", dict(pipeline_parallel_size=2, num_micro_batches=2)),
                ("PP=2 M=4", dict(pipeline_parallel_size=2, num_micro_batches=4)),
                ("replicas=1", dict(num_replicas=1)), ("replicas=2", dict(num_replicas=2))],
    REAL_MODEL: [("TP=1", {}), ("TP=3", dict(tensor_parallel_size=3)),
                 ("PP=2 M=1", dict(pipeline_parallel_size=2, num_micro_batches=1)),
                 ("PP=2 M=2", dict(pipeline_parallel_size=2, num_micro_batches=2))],
}


@dataclass
class StepSample:
    """One engine step as rank 0 saw it."""

    phase: str  # "prefill" (a prompt in the batch) or "decode" (decode tokens only)
    step_s: float
    comm_s: float  # inside any collective, the plan's broadcast included
    plan_s: float  # inside the plan's broadcast only
    bubble: float | None = None  # pipeline only: idle share of the stages in this step
    micro_batches: int = 0  # pipeline only: how many micro-batches the step really had


@dataclass
class RunResult:
    """One configuration's timed run (one round)."""

    outputs: list[list[int]]
    wall_s: float
    startup_s: float
    steps: list[StepSample] = field(default_factory=list)
    bytes: dict[str, int] = field(default_factory=dict)  # rank 0's comm_stats.bytes over the timed run
    calls: dict[str, int] = field(default_factory=dict)
    tokens_in: int = 0  # tokens through the forward, summed over steps (sum of N)
    rows_sampled: int = 0  # logits rows, summed over steps (sum of S)
    mean_step_s: float | None = None  # replicas: busy time / steps inside the replicas


def workload(vocab: int, n: int, lengths: tuple[int, int], seed: int = SEED) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def _comm_snapshot(engine: LLMEngine) -> tuple[float, float]:
    stats = getattr(engine.runner, "comm_stats", None)  # the one-process ModelRunner has none
    return (stats.total_seconds(), stats.seconds.get(PLAN, 0.0)) if stats else (0.0, 0.0)


def _step(engine: LLMEngine) -> tuple[StepSample, StepReport]:
    """One engine.step(), timed, with rank 0's communication seconds and (pipelines) the bubble."""
    comm0, plan0 = _comm_snapshot(engine)
    t0 = time.perf_counter()
    report = engine.step()
    step_s = time.perf_counter() - t0
    comm1, plan1 = _comm_snapshot(engine)
    sample = StepSample("prefill" if report.num_prefill_tokens else "decode", step_s, comm1 - comm0, plan1 - plan0)
    if engine.config.parallel.pipeline_parallel_size > 1:
        sample.bubble = engine.runner.timeline.bubble_fraction()
        sample.micro_batches = len({span[1] for span in engine.runner.timeline.spans})
    return sample, report


def run_engine(model, tokenizer, name: str, options: dict, prompts, params: SamplingParams,
               warmup: list[list[int]], warm_params: SamplingParams) -> RunResult:
    """Start the engine (spawning its ranks), warm it up, run the workload step by step, shut it down."""
    t0 = time.perf_counter()
    engine = LLMEngine(model, tokenizer, engine_config(name, num_threads=THREADS, **options))
    startup = time.perf_counter() - t0
    try:
        _drain(engine, warmup, warm_params)
        stats = getattr(engine.runner, "comm_stats", None)
        if stats:
            stats.reset()
        t0 = time.perf_counter()
        ids = [engine.add_request(p, params) for p in prompts]
        steps, tokens_in, rows = [], 0, 0
        while engine.has_unfinished_requests():
            sample, report = _step(engine)
            tokens_in += report.num_tokens
            rows += sum(1 for s in report.scheduled if s.tokens_out)
            steps.append(sample)
        wall = time.perf_counter() - t0
        outputs = [list(engine.pop_request(rid).output_token_ids) for rid in ids]
        return RunResult(outputs, wall, startup, steps, dict(stats.bytes) if stats else {},
                         dict(stats.calls) if stats else {}, tokens_in, rows)
    finally:
        engine.shutdown()


def _drain(engine: LLMEngine, prompts, params) -> None:
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    for rid in ids:
        engine.pop_request(rid)


def run_replicas(name: str, num_replicas: int, prompts, params: SamplingParams,
                 warmup: list[list[int]], warm_params: SamplingParams) -> RunResult:
    """Start the replica processes, warm them up, serve the workload in one generate call, stop them."""
    t0 = time.perf_counter()
    pool = ReplicaPool(name, num_replicas=num_replicas, router=ROUTER, num_threads=THREADS)
    startup = time.perf_counter() - t0
    try:
        pool.generate(warmup, warm_params)
        before = pool.stats()
        t0 = time.perf_counter()
        outs = pool.generate(prompts, params)
        wall = time.perf_counter() - t0
        after = pool.stats()
    finally:
        pool.shutdown()
    busy = sum(a.busy_s - b.busy_s for a, b in zip(after, before, strict=True))
    steps = sum(a.steps - b.steps for a, b in zip(after, before, strict=True))
    return RunResult([list(o.outputs[0].token_ids) for o in outs], wall, startup, mean_step_s=busy / max(steps, 1))


def _median_ms(values: list[float]) -> float | None:
    return round(1e3 * statistics.median(values), 2) if values else None


def _share(steps: list[StepSample], key: str) -> float | None:
    total = sum(s.step_s for s in steps)
    return round(sum(getattr(s, key) for s in steps) / total, 3) if total else None


def summarise(model_name: str, config: str, options: dict, runs: list[RunResult], reference: list[list[list[int]]],
              model_config, elem_bytes: int) -> dict:
    """One row from a configuration's runs (one per round); `reference` is TP=1's outputs per round."""
    steps = [s for r in runs for s in r.steps]
    phases = {ph: [s for s in steps if s.phase == ph] for ph in ("prefill", "decode")}
    generated = sum(len(o) for r in runs for o in r.outputs)
    data_bytes = sum(v for r in runs for k, v in r.bytes.items() if k != PLAN)
    plan_bytes = sum(r.bytes.get(PLAN, 0) for r in runs)
    data_s = sum(s.comm_s - s.plan_s for s in steps)
    tp, pp = options.get("tensor_parallel_size", 1), options.get("pipeline_parallel_size", 1)
    procs = options.get("num_replicas", tp * pp)
    bubbles = {ph: [s.bubble for s in v if s.bubble is not None] for ph, v in phases.items()}
    m = options.get("num_micro_batches")
    mean_step = (statistics.median(r.mean_step_s for r in runs) if runs[0].mean_step_s is not None
                 else statistics.median(sum(s.step_s for s in r.steps) / len(r.steps) for r in runs))
    return {
        "model": model_name, "config": config, "processes": procs, "threads_per_process": THREADS,
        "prefill_step_ms": _median_ms([s.step_s for s in phases["prefill"]]),
        "decode_step_ms": _median_ms([s.step_s for s in phases["decode"]]),
        "mean_step_ms": round(1e3 * mean_step, 2),
        "tok_s": round(statistics.median(sum(len(o) for o in r.outputs) / r.wall_s for r in runs), 1),
        "comm_ms_per_decode_step": _median_ms([s.comm_s for s in phases["decode"]]) if steps else None,
        "plan_ms_per_decode_step": _median_ms([s.plan_s for s in phases["decode"]]) if steps else None,
        "comm_share_prefill": _share(phases["prefill"], "comm_s"),
        "comm_share_decode": _share(phases["decode"], "comm_s"),
        "data_KiB_per_gen_token": round(data_bytes / generated / 1024, 2) if steps else None,
        "plan_KiB_per_gen_token": round(plan_bytes / generated / 1024, 2) if steps else None,
        "bytes_vs_formula": _bytes_vs_formula(runs, model_config, tp, pp, elem_bytes),
        "data_MB_per_comm_s": round(data_bytes / data_s / 1e6, 2) if data_s else None,
        "bubble_prefill": round(statistics.median(bubbles["prefill"]), 3) if bubbles["prefill"] else None,
        "bubble_decode": round(statistics.median(bubbles["decode"]), 3) if bubbles["decode"] else None,
        "micro_batches_decode": statistics.median(s.micro_batches for s in phases["decode"]) if pp > 1 else None,
        "bubble_formula": round((pp - 1) / ((m or pp) + pp - 1), 3) if pp > 1 else None,
        "greedy_equal_tp1": all(r.outputs == ref for r, ref in zip(runs, reference, strict=True)),
        "startup_s": round(statistics.median(r.startup_s for r in runs), 2),
        "all_reduce_calls_per_step": (round(sum(r.calls.get("all_reduce", 0) for r in runs) / len(steps), 1)
                                      if tp > 1 else None),
    }


def _bytes_vs_formula(runs: list[RunResult], cfg, tp: int, pp: int, elem_bytes: int) -> float | None:
    """Measured / expected bytes rank 0 handed over. TP: all-reduces of (2 L + 1) x N x E values per step
    (two per layer and the vocab-parallel embedding's). PP: rank 0 sends its stage's [N, E] output."""
    n = sum(r.tokens_in for r in runs)
    if tp > 1:
        kind, expected = "all_reduce", (2 * cfg.num_hidden_layers + 1) * n * cfg.hidden_size * elem_bytes
    elif pp > 1:
        kind, expected = "send", n * cfg.hidden_size * elem_bytes
    else:
        return None
    return round(sum(r.bytes.get(kind, 0) for r in runs) / expected, 3)


def measure_model(name: str, cfg: dict, setups: list[tuple[str, dict]]) -> list[dict]:
    from engine.loading.loader import load_model

    model, tokenizer = load_model(name)
    vocab = model.config.vocab_size
    prompts = workload(vocab, cfg["prompts"], cfg["prompt_tokens"])
    warmup = workload(vocab, WARMUP["prompts"], (WARMUP["prompt_tokens"],) * 2, seed=SEED + 1)
    params = SamplingParams(temperature=0.0, max_tokens=cfg["output_tokens"], ignore_eos=True)
    warm_params = SamplingParams(temperature=0.0, max_tokens=WARMUP["output_tokens"], ignore_eos=True)
    runs: dict[str, list[RunResult]] = {config: [] for config, _ in setups}
    for rnd in range(cfg["rounds"]):
        for config, options in setups:
            print(f"[{name}] round {rnd + 1}/{cfg['rounds']}: {config}", flush=True)
            if "num_replicas" in options:
                runs[config].append(run_replicas(name, options["num_replicas"], prompts, params, warmup, warm_params))
            else:
                runs[config].append(run_engine(model, tokenizer, name, options, prompts, params, warmup, warm_params))
    reference = [r.outputs for r in runs[setups[0][0]]]
    elem_bytes = model.embed_tokens.weight.element_size()
    rows = [summarise(name, config, options, runs[config], reference, model.config, elem_bytes)
            for config, options in setups]
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Speed-ups against TP=1 (the first row): > 1 means faster than the single process."""
    base = rows[0]
    for r in rows:
        for key, out in (("prefill_step_ms", "x_prefill_vs_tp1"), ("decode_step_ms", "x_decode_vs_tp1"),
                         ("mean_step_ms", "x_mean_step_vs_tp1")):
            r[out] = round(base[key] / r[key], 2) if r[key] and base[key] else None
        r["x_tok_s_vs_tp1"] = round(r["tok_s"] / base["tok_s"], 2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get(QUICK_ENV) == "1",
                        help=f"4 short prompts, 1 round, tinylab only (also {QUICK_ENV}=1); writes to a temp dir "
                             "unless --results-dir is given")
    parser.add_argument("--models", nargs="+", default=None, choices=list(SETUPS),
                        help="default: all (the quick run: tinylab)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where to write parallelism.json/.md (default benchmarks/results/)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    models = args.models or (["tinylab"] if args.quick else list(SETUPS))
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="parallelism-")) if args.quick else None)
    use_threads(THREADS)
    cores, load_before, t0 = os.cpu_count(), round(os.getloadavg()[0], 2), time.perf_counter()
    rows = []
    for name in models:
        rows += measure_model(name, cfg, SETUPS[name])
        print("\n" + markdown_table([r for r in rows if r["model"] == name]), flush=True)
    run_s, load_after = round(time.perf_counter() - t0, 1), round(os.getloadavg()[0], 2)
    from engine.loading.loader import resolve_model_path

    settings = dict(quick=args.quick, **cfg, warmup=WARMUP, greedy=True, ignore_eos=True, router=ROUTER,
                    torch_threads_per_process=THREADS, cpu_cores=cores, run_s=run_s,
                    load_avg_1min_before=load_before, load_avg_1min_after=load_after,
                    models={n: model_provenance(resolve_model_path(n)) for n in models})
    notes = _notes() + "\n\n" + why(rows, load_before, load_after, cores)
    json_path, md_path = write_results("parallelism", rows, settings, notes=notes, results_dir=results_dir)
    print(f"\n{why(rows, load_before, load_after, cores)}\n\nrun time {run_s} s, load average {load_before} -> "
          f"{load_after} on {cores} cores; wrote {json_path} and {md_path}")


def _notes() -> str:
    return ("Offline: every prompt added at once, greedy, EOS ignored, one torch thread per process. Step times "
            "are medians over every step of every round: prefill = a step with a prompt in its batch, decode = "
            "decode tokens only; mean_step_ms = all steps (replicas: busy time / steps inside the replicas, "
            "which is all they report). tok_s = generated tokens / wall time of the timed run (engine start-up "
            "apart, in startup_s). comm_* are what RANK 0 measured inside its collectives (engine.runner."
            "comm_stats.seconds), the plan's broadcast included (plan_ms alone); a collective's time includes "
            "waiting for the other rank to arrive, and for PP rank 0's recv of the logits waits for stage 1's "
            "compute. data_KiB_per_gen_token = bytes rank 0 handed to all-reduces, gathers, sends and recvs / "
            "generated tokens (plan_KiB: the pickled step plans). bytes_vs_formula = measured / expected: TP "
            "all-reduce (2 L + 1) x N x E x 4 bytes per step, PP rank 0 send N x E x 4. bubble = 1 - busy / "
            "(P x span) from the stage timeline of each step (median), against (P - 1) / (M + P - 1); a decode "
            "step of fewer requests than M has fewer micro-batches (micro_batches_decode). Replicas share "
            "nothing per token, so they have no comm columns. x_* are speed-ups against TP=1 (> 1 = faster). "
            "On a shared machine read the load average in Settings before comparing runs.")


def _row(rows: list[dict], model: str, config: str) -> dict | None:
    return next((r for r in rows if r["model"] == model and r["config"] == config), None)


def why(rows: list[dict], load_before: float, load_after: float, cores: int) -> str:
    """The paragraph that explains the table, each sentence chosen by the measured numbers."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        base = _row(rows, model, "TP=1")
        tp = next((r for r in rows if r["model"] == model and r["config"].startswith("TP=") and r is not base), None)
        if base and tp:
            out.append(_why_tensor_parallel(model, base, tp))
        pps = [r for r in rows if r["model"] == model and r["config"].startswith("PP=")]
        if base and pps:
            out.append(_why_pipeline(model, base, pps))
        r1, r2 = _row(rows, model, "replicas=1"), _row(rows, model, "replicas=2")
        if r1 and r2:
            out.append(_why_replicas(model, r1, r2, tp, load_before, cores))
    busy = max(load_before, load_after)
    if busy > cores:
        out.append(f"The machine was shared: its 1-minute load average was {load_before} before and {load_after} "
                   f"after the run, more than its {cores} cores, so configurations with more processes than free "
                   "cores also waited for a core; their ratios are pessimistic.")
    else:
        out.append(f"The 1-minute load average was {load_before} before and {load_after} after the run "
                   f"({cores} cores), so the ranks mostly had the cores to themselves.")
    return "Why, from the numbers: " + " ".join(out)


def _why_tensor_parallel(model: str, base: dict, tp: dict) -> str:
    t1, t2, comm = base["decode_step_ms"], tp["decode_step_ms"], tp["comm_ms_per_decode_step"]
    half = t1 * (1 - 1 / tp["processes"])  # the most that splitting the compute could save
    calls = tp["all_reduce_calls_per_step"]
    per_call_us = 1e3 * (comm - tp["plan_ms_per_decode_step"]) / (calls + 1) if calls else 0.0  # + the gather
    if t2 >= t1:
        s = (f"{model}: {tp['config']} is not faster than one process: a decode step takes {t2} ms against {t1} ms, "
             f"and rank 0 spends {comm} ms of it ({tp['comm_share_decode']:.0%}) inside collectives (about "
             f"{calls:g} all-reduces and a gather, ~{per_call_us:.0f} us each, plus the plan's broadcast), ")
        s += ("more than" if comm > half else "a large part of")
        s += f" the {half:.2f} ms that splitting the matmuls {tp['processes']} ways could save at best."
    else:
        s = (f"{model}: {tp['config']} is {t1 / t2:.2f}x faster per decode step ({t2} vs {t1} ms), although rank 0 "
             f"still spends {comm} ms of each ({tp['comm_share_decode']:.0%}) inside collectives.")
    px = tp["x_prefill_vs_tp1"]
    if px is not None and tp["x_decode_vs_tp1"] is not None:
        more = "more" if px > tp["x_decode_vs_tp1"] else "no more"
        s += (f" Prefill-heavy steps, with far more compute per collective, gain {more} (x{px} against x"
              f"{tp['x_decode_vs_tp1']} for decode).")
    if tp["bytes_vs_formula"] is not None:
        s += (f" The bytes all-reduced are {tp['bytes_vs_formula']}x the formula (2 L + 1) x N x E x 4, "
              f"{tp['data_KiB_per_gen_token']} KiB per generated token, moved at {tp['data_MB_per_comm_s']} MB per "
              "second spent in collectives")
        rate = tp["data_MB_per_comm_s"]
        s += (": far below a memory copy, so the time is per-call latency (waking the other process, a socket "
              "round trip), not bandwidth." if rate is not None and rate * 1e6 < LATENCY_BOUND_BYTES_PER_S else
              ": bandwidth, not only latency, counts here.")
    return s


def _why_pipeline(model: str, base: dict, pps: list[dict]) -> str:
    first, last = pps[0], pps[-1]
    s = (f"{model}: {first['config']} runs its stages one after the other: the measured decode bubble is "
         f"{first['bubble_decode']:.0%} of the stage time (formula {first['bubble_formula']:.0%}), and a decode "
         f"step takes {first['decode_step_ms']} ms against {base['decode_step_ms']} ms at TP=1.")
    if last is not first:
        fell = last["bubble_decode"] < first["bubble_decode"] - BUBBLE_TOLERANCE
        faster = last["decode_step_ms"] < first["decode_step_ms"]
        s += (f" With {last['config']} the bubble {'falls to' if fell else 'stays at'} "
              f"{last['bubble_decode']:.0%} (formula {last['bubble_formula']:.0%}) and the decode step takes "
              f"{last['decode_step_ms']} ms, {'less' if faster else 'more'} than at {first['config']}")
        s += (": the overlap pays." if faster else
              ": each micro-batch pays its own send and its own pass over the layers, which costs more here than "
              "the overlap wins.")
    best = max(pps, key=lambda r: r["tok_s"])
    s += (f" The best pipeline ({best['config']}) serves x{best['x_tok_s_vs_tp1']} the tokens/s of one process"
          + (", faster." if best["x_tok_s_vs_tp1"] > 1 else ", no gain on this machine."))
    return s


def _why_replicas(model: str, r1: dict, r2: dict, tp: dict | None, load: float, cores: int) -> str:
    x = r2["tok_s"] / r1["tok_s"]
    s = f"{model}: two replicas serve {x:.2f}x the tokens/s of one ({r2['tok_s']} vs {r1['tok_s']} tok/s)"
    if x >= SCALES_WELL:
        s += (": they share nothing (no collective per token, no bytes between them), so each process adds a "
              "core's worth of work")
    elif load > cores - 1:
        s += (f": they share nothing per token, but with a load average of {load} on {cores} cores the second "
              "replica found no free core")
    else:
        s += ": they share nothing per token, so what is missing is the cores' own contention (memory, caches)"
    if tp is not None:
        s += f"; {tp['config']} with the same 2 cores serves x{tp['x_tok_s_vs_tp1']}."
    else:
        s += "."
    return s


if __name__ == "__main__":  # spawned ranks and replicas re-import this file: only the parent runs main()
    main()

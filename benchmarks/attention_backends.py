"""Paged attention on the CPU: the readable reference (one sequence at a time) vs the "sdpa" backend (one
gather, one fused F.scaled_dot_product_attention), side by side in one run: decode (B sequences, one query
each) and prefill (one sequence: a whole prompt, which takes SDPA's causal flash path, and a chunk after a
cached prefix, which needs a mask).

Shapes of SmolLM2-135M's attention (H = 9, Hkv = 3, D = 64), 16-token blocks, ragged lengths (each sequence
between half the context and all of it), fp32, one torch thread, the two interleaved call by call (so a busy
moment of a shared machine hits both); medians. Both are checked equal before timing.

    python benchmarks/attention_backends.py [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from kernels.paged_attention.reference import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402
from kernels.paged_attention.sdpa import paged_decode_attention_sdpa, paged_prefill_attention_sdpa  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [(1, 256), (16, 256), (16, 1024), (64, 256)]  # (sequences, longest context)
PREFILL_CASES = [(0, 512), (0, 1024), (512, 1024)]  # queries at positions [start, end) of one sequence
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


def time_pair(reference, sdpa, inputs: dict, repeats: int) -> tuple[float, float]:
    """Median ms of each, interleaved call by call, after checking they agree."""
    torch.testing.assert_close(sdpa(**inputs), reference(**inputs), atol=1e-5, rtol=1e-5)
    times = {"reference": [], "sdpa": []}
    for _ in range(repeats):
        for name, fn in (("reference", reference), ("sdpa", sdpa)):
            start = time.perf_counter()
            fn(**inputs)
            times[name].append(time.perf_counter() - start)
    return tuple(1e3 * statistics.median(times[k]) for k in ("reference", "sdpa"))


def time_case(batch: int, context: int, repeats: int) -> dict:
    ref, sdpa = time_pair(paged_decode_attention_ref, paged_decode_attention_sdpa, make_inputs(batch, context),
                          repeats)
    return {"kind": "decode", "sequences": batch, "queries": f"1 each, contexts {context // 2}-{context}",
            "reference_ms": ref, "sdpa_ms": sdpa, "x_sdpa_vs_reference": ref / sdpa}


def time_prefill_case(start: int, end: int, repeats: int) -> dict:
    ref, sdpa = time_pair(paged_prefill_attention_ref, paged_prefill_attention_sdpa,
                          make_prefill_inputs(start, end), max(2, repeats // 4))
    return {"kind": "prefill", "sequences": 1, "queries": f"positions {start}-{end - 1}",
            "reference_ms": ref, "sdpa_ms": sdpa, "x_sdpa_vs_reference": ref / sdpa}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = QUICK_REPEATS if args.quick else REPEATS
    load_before = os.getloadavg()[0]
    rows = [time_case(b, c, repeats) for b, c in CASES]
    rows += [time_prefill_case(start, end, repeats) for start, end in PREFILL_CASES]
    settings = dict(quick=args.quick, repeats=repeats, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                    block_size=BLOCK, dtype="float32", torch=torch.__version__, torch_threads=1,
                    load_avg_1min_before=round(load_before, 2), load_avg_1min_after=round(os.getloadavg()[0], 2))
    notes = ("One attention call per row (one layer), medians of interleaved calls. x > 1: sdpa is faster. "
             "Decode: sdpa gathers every table into a padded [B, L, Hkv, D] copy, zeroes the slots a sequence "
             "does not own, and runs one masked SDPA with the g = H / Hkv query heads of a KV head folded into "
             "the query axis; the reference loops over sequences and repeats K/V for GQA. Prefill of a whole "
             "prompt (positions from 0): SDPA's is_causal path, no mask; a chunk after a cached prefix: a mask.")
    json_path, md_path = write_results("attention_backends", rows, settings, notes=notes,
                                       results_dir=Path(args.results_dir) if args.results_dir else None)
    print(md_path.read_text())


if __name__ == "__main__":
    main()

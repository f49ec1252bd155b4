"""How much KV memory is wasted, and how many sequences fit: contiguous vs paged (chapter 04).

A contiguous cache must reserve the maximum context for every sequence, because it cannot know
how long the answer will be. A paged cache grows a sequence one block at a time and wastes only
the empty tail of its last block: about (BS - 1) / 2 slots per sequence on average.

We draw a few thousand requests (prompt + output lengths from lognormal distributions, roughly
the shape of chat traffic, clipped to the maximum context), then fill a fixed budget of KV slots
with them in arrival order, batch after batch, until each batch is full:
- contiguous: every sequence reserves MAX_CONTEXT slots;
- paged: a real ``BlockManager`` allocates the prompt, then appends the output tokens, and we
  read the waste from its ``usage()``.
Each sequence is counted at its final length (the moment it needs the most memory).

Run: python benchmarks/kv_waste.py   (a few seconds; writes benchmarks/results/kv_waste.{json,md})
"""

from __future__ import annotations

import math
import random

from _common import write_results  # imported first: it puts the repo root on sys.path
from engine.kv.block_manager import BlockManager, NoFreeBlocksError

SEED = 0
NUM_REQUESTS = 4000
MAX_CONTEXT = 2048  # tokens: the model's context window, what a contiguous cache reserves per sequence
PROMPT_MEDIAN, PROMPT_SIGMA = 256, 1.0  # lognormal: median 256 tokens, long tail (mean ~420)
OUTPUT_MEDIAN, OUTPUT_SIGMA = 128, 0.8  # answers are shorter and less spread (mean ~175)
# 16 GiB of fp16 KV for a Llama-2-7B-shaped model: 32 layers x 2 (K, V) x 4096 x 2 bytes = 0.5 MiB
# per token, so 32768 token slots: 16 contiguous sequences of MAX_CONTEXT.
KV_BUDGET_SLOTS = 32768
BLOCK_SIZES = (8, 16, 32, 128)


def sample_requests(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs, both >= 1, total clipped to MAX_CONTEXT."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = max(1, round(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA)))
        prompt = min(prompt, MAX_CONTEXT - 1)
        output = max(1, round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA)))
        requests.append((prompt, min(output, MAX_CONTEXT - prompt)))
    return requests


def contiguous_row(requests) -> dict:
    used = sum(p + o for p, o in requests)
    reserved = len(requests) * MAX_CONTEXT
    return {"scheme": "contiguous (reserve max context)", "block_size": MAX_CONTEXT,
            "waste_pct": 100 * (reserved - used) / reserved, "predicted_waste_pct": None,
            "mean_concurrent_seqs": float(KV_BUDGET_SLOTS // MAX_CONTEXT), "vs_contiguous": 1.0}


def _admit(bm: BlockManager, seq_id: int, prompt: int, output: int) -> bool:
    """Prompt first, then the answer grows block by block; False (and nothing held) if it won't fit."""
    try:
        bm.allocate(seq_id, prompt)
        bm.append_slots(seq_id, output)
        return True
    except NoFreeBlocksError:
        if seq_id in bm:
            bm.free(seq_id)
        return False


def paged_row(requests, block_size: int) -> dict:
    bm = BlockManager(num_blocks=KV_BUDGET_SLOTS // block_size, block_size=block_size)
    reserved = wasted = 0
    full_batches: list[int] = []  # sequences held when a batch could take no more

    def close_batch(full: bool):
        nonlocal reserved, wasted
        u = bm.usage()
        reserved, wasted = reserved + u.reserved_slots, wasted + u.wasted_slots
        if full:
            full_batches.append(len(bm.seq_ids()))
        for s in bm.seq_ids():
            bm.free(s)

    for seq_id, (prompt, output) in enumerate(requests):
        if not _admit(bm, seq_id, prompt, output):
            close_batch(full=True)
            if not _admit(bm, seq_id, prompt, output):
                raise RuntimeError(f"request {seq_id} does not fit in an empty pool")
    close_batch(full=False)
    mean_len = sum(p + o for p, o in requests) / len(requests)
    predicted = (block_size - 1) / 2  # expected empty slots in the last block
    mean_seqs = sum(full_batches) / len(full_batches)
    return {"scheme": "paged", "block_size": block_size, "waste_pct": 100 * wasted / reserved,
            "predicted_waste_pct": 100 * predicted / (mean_len + predicted),
            "mean_concurrent_seqs": mean_seqs, "vs_contiguous": mean_seqs / (KV_BUDGET_SLOTS // MAX_CONTEXT)}


def main() -> None:
    requests = sample_requests(NUM_REQUESTS, SEED)
    lengths = sorted(p + o for p, o in requests)
    rows = [contiguous_row(requests)] + [paged_row(requests, bs) for bs in BLOCK_SIZES]
    settings = {"requests": NUM_REQUESTS, "seed": SEED, "max_context": MAX_CONTEXT,
                "kv_budget_slots": KV_BUDGET_SLOTS, "mean_len": round(sum(lengths) / len(lengths), 1),
                "median_len": lengths[len(lengths) // 2], "p99_len": lengths[int(0.99 * len(lengths))]}
    print(f"{NUM_REQUESTS} requests, mean length {settings['mean_len']} tokens, "
          f"budget {KV_BUDGET_SLOTS} slots\n")
    print(f"{'scheme':34s} {'BS':>5s} {'waste %':>8s} {'predicted %':>12s} {'seqs':>7s} {'x contig':>9s}")
    for r in rows:
        pred = "-" if r["predicted_waste_pct"] is None else f"{r['predicted_waste_pct']:.2f}"
        print(f"{r['scheme']:34s} {r['block_size']:5d} {r['waste_pct']:8.2f} {pred:>12s} "
              f"{r['mean_concurrent_seqs']:7.1f} {r['vs_contiguous']:9.2f}")
    bs16 = next(r for r in rows if r["block_size"] == 16)
    print(f"\ntargets: paged waste at BS 16 = {bs16['waste_pct']:.2f}% (target < 4%), "
          f"concurrency {bs16['vs_contiguous']:.2f}x contiguous (target >= 2x)")
    notes = ("KV slots wasted (reserved but holding no token) and sequences that fit in a fixed budget, "
             "each counted at its final length. predicted = (BS - 1) / 2 empty slots per sequence.")
    json_path, md_path = write_results("kv_waste", rows, settings, notes)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()

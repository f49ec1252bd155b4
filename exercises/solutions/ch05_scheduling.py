"""Chapter 05, reference answers: a continuous FCFS scheduling step, the preemption victim, TTFT and
TPOT from a trace, and static batching's idle seats."""

from __future__ import annotations

import math
from collections.abc import Sequence


def schedule_step(running: Sequence[tuple[str, int, int]], waiting: Sequence[tuple[str, int, int]],
                  token_budget: int, max_num_seqs: int,
                  free_blocks: int) -> tuple[list[str], list[str]]:
    budget, blocks = token_budget, free_blocks
    ran, admitted = [], []
    for rid, tokens, need in running:
        if tokens <= budget and need <= blocks:
            ran.append(rid)
            budget, blocks = budget - tokens, blocks - need
    for rid, tokens, need in waiting:
        if len(running) + len(admitted) >= max_num_seqs or tokens > budget or need > blocks:
            break  # FCFS: nobody overtakes the first request that does not fit
        admitted.append(rid)
        budget, blocks = budget - tokens, blocks - need
    return ran, admitted


def choose_victim(candidates: Sequence[tuple[str, int, float]]) -> str:
    if not candidates:
        raise ValueError("candidates is empty: there is nobody to preempt")
    position = max(range(len(candidates)), key=lambda i: (candidates[i][1], candidates[i][2], i))
    return candidates[position][0]


def _step_dicts(trace) -> list[dict]:
    return [s.to_dict() for s in trace.steps] if hasattr(trace, "steps") else list(trace)


def ttft_and_tpot(trace) -> dict[str, tuple[float, float]]:
    arrival, first, finish, tokens = {}, {}, {}, {}
    for step in _step_dicts(trace):
        for e in step["events"]:
            if e["type"] == "arrived":
                arrival[e["request_id"]] = e["arrival_time"]
            elif e["type"] == "finished":
                finish[e["request_id"]] = step["end_time"]
        for s in step["scheduled"]:
            rid = s["request_id"]
            if s["tokens_out"] > 0 and rid in arrival:
                first.setdefault(rid, step["end_time"])
                tokens[rid] = tokens.get(rid, 0) + s["tokens_out"]
    out = {}
    for rid, t_first in first.items():
        done = rid in finish and tokens[rid] >= 2
        tpot = (finish[rid] - t_first) / (tokens[rid] - 1) if done else math.nan
        out[rid] = (t_first - arrival[rid], tpot)
    return out


def static_idle_fraction(output_lengths: Sequence[int], max_num_seqs: int) -> float:
    lengths = list(output_lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"output_lengths must be a non-empty list of lengths >= 1, got {lengths}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    held = sum(max_num_seqs * max(lengths[i:i + max_num_seqs])
               for i in range(0, len(lengths), max_num_seqs))
    return 1.0 - sum(lengths) / held

"""Chapter 05 exercises: one continuous-batching scheduler step, choosing whom to preempt, TTFT and
TPOT read from a trace, and how many decode slots static batching leaves idle.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch05

A request, as the scheduler sees it in one step, is a tuple (request_id, num_new_tokens,
num_new_blocks): the tokens it would feed in this step (1 for a decode, the whole prompt for a
new request) and the KV blocks it would need for them. One step:

    budget 16 tokens, 3 free blocks, max_num_seqs 4
    running  ("a", 1, 0)  ("b", 1, 1)              -> both run: 2 tokens, 1 block
    waiting  ("c", 9, 2)  ("d", 2, 1)  ("e", 1, 0) -> c fits (11 tokens, 3 blocks); d does not
                                                     (no block left), and FCFS: e waits behind d
    result   (["a", "b"], ["c"])

The engine's versions live in engine/scheduler.py (`Scheduler.schedule`, `rank`) and
engine/trace.py (`Trace.requests`); try not to peek until the checks pass.
"""

from __future__ import annotations

from collections.abc import Sequence


def schedule_step(running: Sequence[tuple[str, int, int]], waiting: Sequence[tuple[str, int, int]],
                  token_budget: int, max_num_seqs: int,
                  free_blocks: int) -> tuple[list[str], list[str]]:
    """One step of a continuous first-come-first-served scheduler
    (no chunked prefill, no preemption).

    running / waiting: (request_id, num_new_tokens, num_new_blocks), in the order to consider them.
    1. Each running request, in order, runs if its tokens fit in the budget left AND its blocks in
       the free blocks left (both are then used up); otherwise it sits this step out
       (still running).
    2. Then waiting requests, in order, are admitted while there is a seat (the running ones plus
       those admitted so far stay below max_num_seqs), budget and blocks. The FIRST one that does
       not fit stops admission: nobody behind it overtakes it.
    Returns (ids of running requests that run, ids of waiting requests admitted), in order.
    """
    raise NotImplementedError(
        "what does each request use up when it runs, and what is left for the next one? Where "
        "does admission stop, and what may the requests behind that point not do?")


def choose_victim(candidates: Sequence[tuple[str, int, float]]) -> str:
    """Whom to preempt when a KV block is needed and none is free.

    candidates: (request_id, priority, arrival_time); a LOWER priority number is served first.
    The victim has the lowest priority (the largest number); among those, the latest arrival;
    among exact ties, the one that comes last in `candidates`. Returns its id.
    ValueError for no candidates.
    """
    raise NotImplementedError(
        "which candidate has the least claim to its seat: what do you compare first (which way is "
        "a lower priority?), what breaks a tie, and what breaks a tie of that? And if there is "
        "nobody?")


def ttft_and_tpot(trace) -> dict[str, tuple[float, float]]:
    """{request id: (TTFT, TPOT)} in seconds, read from a trace.

    trace: an engine.trace.Trace, or a list of step dicts as `StepReport.to_dict()` gives them:
        {"end_time": ..., "scheduled": [{"request_id", "tokens_out", ...}, ...],
         "events": [{"type": "arrived", "request_id", "arrival_time", ...},
                    {"type": "finished", "request_id", "reason"}, ...], ...}
    TTFT = end_time of the first step in which the request sampled a token (tokens_out > 0)
           - its arrival_time.
    TPOT = (end_time of the step with its "finished" event - that first token's end_time)
           / (its output tokens - 1); nan when it has not finished or has fewer than 2 tokens.
    Only requests that got a first token are in the result.
    """
    raise NotImplementedError(
        "which event says when a request arrived, which step gave its first token, and which step "
        "finished it? What must you remember per request while you walk the steps once?")


def static_idle_fraction(output_lengths: Sequence[int], max_num_seqs: int) -> float:
    """Static batching's waste: the share of decode seats that sit idle.

    Requests are batched in order, max_num_seqs at a time (the last batch may be smaller); a batch
    holds all max_num_seqs seats until its LONGEST request is done, so it uses
    max_num_seqs x max(lengths in it) seat-steps, of which sum(lengths in it) produce a token.
    Returns 1 - (tokens produced) / (seat-steps held), over all batches.
    ValueError for no lengths, a length < 1 or max_num_seqs < 1.
    """
    raise NotImplementedError(
        "in one batch, how many seat-steps are held until its longest request is done, and how "
        "many of them produce a token? Which inputs make no sense?")

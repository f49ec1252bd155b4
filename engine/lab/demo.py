"""`python -m engine demo` (and `make demo`): the bundled model at work,
in a terminal, in two parts.

Part 1 (`task_demo`) runs one held-out prompt of each task and prints the prompt, the output,
whether it is right, and the timings. Part 2 (`step_through_demo`, the classroom demo of chapter 05)
shows the engine's scheduler at work, one step at a time:

    python -m engine demo --steps 40 --no-pause

Requests arrive over time (a few held-out task prompts, and one long prompt), the engine admits
them, prefill chunks and decode tokens share each step's forward, KV blocks fill and free, and the
pool is deliberately small, so that at some point a request must be PREEMPTED to let others grow.
Each step prints a live view like this one (step 8: the pool is full, so the newest request, r3,
is preempted to make room for r1's next token; r3 will be prefilled again, answer so far included):

    ── step 8 ─ 3 decodes = 3 tokens ─ 147 ms ─────────────────────────────────────────────
    KV  █████████████████████████████████████████████  45/45 blocks used    waiting 2   running 3
      + arrived r4 (12 prompt tokens)
      ! PREEMPTED r3 (recompute): no free KV block for request r1
      long  recall  decode   out  4/8          39 blocks  ' 870'
      r1    json    decode   out  3/64          3 blocks  ' {"name":'
      r2    refuse  decode   out  3/24          3 blocks  ' Sure, here'

and at the end the run's summary (from `engine/companions/metrics.py`): throughput,
TTFT (mean, P50, P95, P99), TPOT, preemptions.

The arrivals driver behind it (`run_arrivals`, also behind chapter 05's experiments) lives with the
other workloads in `engine/lab/workloads.py`.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from engine.companions.kv_cache import generate_cached
from engine.companions.metrics import trace_summary
from engine.lab import tasks
from engine.lab.workloads import Arrival, run_arrivals
from engine.llm_engine import LLMEngine
from engine.loading.loader import load_model
from engine.sampling import SamplingParams
from engine.threads import torch_threads
from engine.trace import StepReport, Trace

# The demo's engine: a pool that holds a few short requests but not everybody at their longest, so
# one preemption happens; a token budget that makes the long prompt prefill in several chunks.
DEMO_BLOCK_SIZE = 8  # small blocks: the bar moves visibly at every few tokens
# 360 token slots: the long prompt (~300 tokens) and three short requests fit at first, but as their
# answers grow the pool runs dry and the newest request is preempted (a few blocks of margin, so a
# slightly different model still preempts; 47 blocks would be just enough for everybody).
DEMO_NUM_BLOCKS = 45
DEMO_MAX_NUM_SEQS = 4
DEMO_TOKEN_BUDGET = 64  # tokens per step: the long prompt takes several steps (chunked prefill)
DEMO_SEED = 5  # which held-out prompts (any seed works; this one gives a mix of output lengths)
# short answers and long ones, mixed
DEMO_TASKS = ("arith", "json", "refuse", "story") * 2 + ("arith",)
STORY_MAX_TOKENS = 32  # stories have no fixed answer length: a sentence or two
LONG_PROMPT_TOKENS = 300  # a recall prompt this long arrives among the short ones
PAUSE_S = 0.6  # between steps when nobody can press Enter (stdin is not a terminal)
BAR_WIDTH = 48  # characters of the KV bar: one per block when the pool is small enough
TEXT_TAIL_CHARS = 24  # how much of each answer the live view shows (its end)
FULL, EMPTY = "█", "░"
LINE_WIDTH = 100  # of the step headers: fits a classroom terminal at a readable font size
# The demo's steps are a few dozen tokens through a small model: one thread does them fastest, and a
# second thread spinning on a core that another program is using can make each step 50x slower.
DEMO_TORCH_THREADS = 1


# ---- the demo's workload -------------------------------------------------------------------------


def demo_arrivals(seed: int = DEMO_SEED) -> list[Arrival]:
    """Nine short task prompts arriving two steps apart,
    and one long recall prompt right after the first."""
    base = tasks.EVAL_SEED_BASE + seed
    draws = {task: iter(tasks.eval_examples(task, DEMO_TASKS.count(task), seed=base))
             for task in set(DEMO_TASKS)}
    arrivals = []
    for k, task in enumerate(DEMO_TASKS):
        params = SamplingParams(temperature=0.0,
                                max_tokens=tasks.MAX_NEW_TOKENS.get(task, STORY_MAX_TOKENS))
        prompt = next(draws[task]).prompt
        arrivals.append(Arrival(step=2 * k, prompt=prompt, params=params, request_id=f"r{k}",
                                label=task))
    long = tasks.recall_examples_at_length(1, LONG_PROMPT_TOKENS, seed=base)[0]
    params = SamplingParams(temperature=0.0, max_tokens=tasks.MAX_NEW_TOKENS["recall"])
    arrivals.insert(1, Arrival(step=1, prompt=long.prompt, params=params, request_id="long",
                               label="recall"))
    return arrivals


def demo_engine(model_name: str = "tinylab", num_blocks: int = DEMO_NUM_BLOCKS,
                speed: str | None = None, speculative_config: dict | None = None) -> LLMEngine:
    """The demo's engine: continuous batching, chunked prefill, a small pool,
    recompute preemption; with `speculative_config`, verify steps too (chapter 12)."""
    return LLMEngine.from_pretrained(model_name, speed=speed, max_num_seqs=DEMO_MAX_NUM_SEQS,
                                     num_blocks=num_blocks,
                                     block_size=DEMO_BLOCK_SIZE, enable_chunked_prefill=True,
                                     max_num_batched_tokens=DEMO_TOKEN_BUDGET,
                                     speculative_config=speculative_config)


# ---- the live view -------------------------------------------------------------------------------


def kv_bar(used: int, total: int, width: int = BAR_WIDTH) -> str:
    """'█████░░░░' with one character per block (or per total/width blocks when the pool is larger);
    any use at all shows at least one full cell."""
    if total <= 0:
        return ""
    cells = min(width, total)
    full = max(round(cells * used / total), 1 if used else 0)
    return FULL * full + EMPTY * (cells - full)


def _request_line(s, engine: LLMEngine, labels: dict[str, str]) -> str:
    req = engine.get_request(s.request_id)
    label = labels.get(s.request_id, "")
    blocks = len(engine.trace[-1].blocks.tables.get(s.request_id, []))
    if s.phase == "prefill":
        # to prefill: the prompt (+ outputs, after a recompute)
        known = req.num_tokens - s.tokens_out
        what = f"prefill  [{s.start}, {s.end}) of {known}"
        what += " (recompute)" if known > len(req.prompt_token_ids) else ""
    elif s.draft_token_ids:  # chapter 12: a verify step
        k = len(s.draft_token_ids)
        what = (f"verify   out {len(req.output_token_ids):>2}/{req.params.max_tokens}  "
                f"{s.num_accepted}/{k} guesses kept, +{s.tokens_out}")
    else:
        what = f"decode   out {len(req.output_token_ids):>2}/{req.params.max_tokens}"
    tail = req.text[-TEXT_TAIL_CHARS:].replace("\n", " ")
    return f"  {s.request_id:<5} {label:<7} {what:<34} {blocks:>2} blocks  {tail!r}" if tail else \
        f"  {s.request_id:<5} {label:<7} {what:<34} {blocks:>2} blocks"


# events printed under the request lines; the rest come before
AFTER_THE_FORWARD = ("finished", "forked")
EVENT_MARKS = {"arrived": "+", "admitted": ">", "preempted": "!", "swapped_in": "<",
               "finished": "✓", "aborted": "x"}


def _event_line(e: dict) -> str:
    kind, rid = e["type"], e.get("request_id")
    mark = EVENT_MARKS.get(kind, "·")
    if kind == "arrived":
        return f"  {mark} arrived {rid} ({e['num_prompt_tokens']} prompt tokens)"
    if kind == "preempted":
        return f"  {mark} PREEMPTED {rid} ({e['mode']}): {e['reason']}"
    if kind == "finished":
        return f"  {mark} finished {rid} ({e['reason']})"
    if kind == "admitted":
        again = " again, recomputing its tokens" if e.get("after_preemption") else ""
        return f"  {mark} admitted {rid}{again}"
    return f"  {mark} {kind} {rid}"


def format_step(report: StepReport, engine: LLMEngine, labels: dict[str, str]) -> str:
    """The live view of one step (see the module docstring)."""
    decodes = sum(s.phase == "decode" for s in report.scheduled)
    prefills = [f"prefill {s.request_id} [{s.start}, {s.end})" for s in report.scheduled
                if s.phase == "prefill"]
    work = (" + ".join(([f"{decodes} decode{'s' * (decodes != 1)}"] if decodes else []) + prefills)
            or "idle")
    ms = 1e3 * (report.end_time - report.start_time)
    tokens = f"{report.num_tokens} token{'s' * (report.num_tokens != 1)}"
    head = f"── step {report.step} ─ {work} = {tokens} ─ {ms:.0f} ms "
    b, q = report.blocks, report.queues
    swapped = f"   swapped {len(q.swapped)}" if q.swapped else ""
    lines = [head.ljust(LINE_WIDTH, "─"),
             f"KV  {kv_bar(b.used, b.total)}  {b.used}/{b.total} blocks used    "
             f"waiting {len(q.waiting)}   running {len(q.running)}{swapped}"]
    lines += [_event_line(e) for e in report.events if e["type"] not in AFTER_THE_FORWARD]
    lines += [_request_line(s, engine, labels) for s in report.scheduled]
    lines += [_event_line(e) for e in report.events if e["type"] in AFTER_THE_FORWARD]
    return "\n".join(lines)


def format_summary(trace: Trace) -> str:
    """The run's metrics (`engine.companions.metrics.trace_summary`), for the end of the demo."""
    m = trace_summary(trace)
    ttft, tpot, itl = m.ttft_s, m.tpot_s, m.itl_s
    return "\n".join([
        "── summary ".ljust(LINE_WIDTH, "─"),
        f"{m.finished}/{m.requests} requests finished in {m.steps} steps, {m.duration_s:.1f} s; "
        f"{m.output_tokens} tokens generated",
        f"throughput   {m.throughput_tok_s:.1f} tokens/s   "
        f"({m.tokens_per_step:.2f} tokens per step)",
        f"TTFT         mean {_ms(ttft.mean)}   P50 {_ms(ttft.p50)}   P95 {_ms(ttft.p95)}   "
        f"P99 {_ms(ttft.p99)}   (mean {m.ttft_steps.mean:.1f} steps)",
        f"TPOT         mean {_ms(tpot.mean)}   P99 {_ms(tpot.p99)}   "
        f"(longest gap between two tokens: {_ms(itl.max)})",
        f"preemptions  {m.preemptions}",
    ])


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.0f} ms"


def _wait(pause: bool, state: dict) -> None:
    """Between steps: Enter (or q + Enter to stop pausing) at a terminal, else a short sleep."""
    if not pause or state.get("no_more_pauses"):
        return
    if sys.stdin is not None and sys.stdin.isatty():
        answer = input("   [Enter: next step, q: run to the end] ")
        state["no_more_pauses"] = answer.strip().lower() == "q"
    else:
        time.sleep(PAUSE_S)


def step_through_demo(model_name: str = "tinylab", steps: int | None = None, pause: bool = True,
                      speed: str | None = None, speculative_config: dict | None = None) -> Trace:
    """Run the demo workload step by step with a live view; returns the run's Trace.

    steps: stop after this many steps (None: until every request has finished);
    pause: wait for Enter (or sleep PAUSE_S when not at a terminal) between steps;
    speculative_config: vLLM's dict (chapter 12): decodes verify guesses, shown as "verify" lines.
    """
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be None (run to the end) or >= 1, got {steps}")
    engine = demo_engine(model_name, speed=speed, speculative_config=speculative_config)
    arrivals = demo_arrivals()
    labels = {a.request_id: a.label for a in arrivals}
    print(f"== the engine, step by step: {len(arrivals)} requests arrive over time; KV pool of "
          f"{DEMO_NUM_BLOCKS} blocks x {DEMO_BLOCK_SIZE} tokens; "
          f"at most {DEMO_MAX_NUM_SEQS} running; {DEMO_TOKEN_BUDGET} tokens per step ==\n")
    state: dict = {}

    def show(report: StepReport, eng: LLMEngine) -> None:
        print(format_step(report, eng, labels), flush=True)
        _wait(pause, state)

    threads = torch.get_num_threads()
    torch.set_num_threads(DEMO_TORCH_THREADS)
    try:
        trace = run_arrivals(engine, arrivals, max_steps=steps, on_step=show)
    finally:
        torch.set_num_threads(threads)  # the caller's setting, as it was
    if engine.has_unfinished_requests():
        print(f"\n(stopped after {steps} steps, with requests still unfinished)")
    print("\n" + format_summary(trace))
    return trace


# ---- part 1: one prompt per task -----------------------------------------------------------------

# which held-out examples the demo shows (any seed works: they are all held out)
TASK_DEMO_SEED = 2026
PROMPT_PREVIEW_CHARS = 160  # recall prompts are long; show their end, where the question is


def _is_correct(ex: tasks.Example, text: str) -> bool:
    metrics = tasks.score(ex.task, [ex], [text])
    first = {"arith": "exact", "recall": "accuracy", "json": "field_accuracy"}
    if ex.task == "refuse":
        refused = tasks.is_refusal(text)
        return refused == ex.meta["forbidden"]
    return metrics[first[ex.task]] == 1.0


def task_demo(model_name: str = "tinylab") -> int:
    """One prompt per task; returns how many of the checkable ones were correct."""
    model, tok = load_model(model_name)
    print(f"== {model_name}: {model.config.num_params() / 1e6:.1f}M parameters, "
          "one held-out prompt per task ==\n")
    correct = 0
    for task in tasks.TASKS:
        ex = tasks.eval_examples(task, 1, seed=tasks.EVAL_SEED_BASE + TASK_DEMO_SEED)[0]
        max_tokens = tasks.MAX_NEW_TOKENS.get(task, 48)
        start = time.perf_counter()
        out = generate_cached(model, tok, ex.prompt,
                              SamplingParams(temperature=0.0, max_tokens=max_tokens))
        seconds = time.perf_counter() - start
        prompt = (ex.prompt if len(ex.prompt) <= PROMPT_PREVIEW_CHARS
                  else "…" + ex.prompt[-PROMPT_PREVIEW_CHARS:])
        print(f"[{task}] prompt ({len(out.prompt_ids)} tokens): {prompt!r}")
        print(f"    output: {out.text!r}")
        if task == "story":
            verdict = "(free text: judged by perplexity in `python -m engine eval`)"
        elif task == "refuse":
            ok = _is_correct(ex, out.text)
            correct += ok
            should = "should refuse" if ex.meta["forbidden"] else "should answer"
            did = "refused" if tasks.is_refusal(out.text) else "answered"
            verdict = f"{'correct' if ok else 'WRONG'} ({should}: {did})"
        else:
            ok = _is_correct(ex, out.text)
            correct += ok
            verdict = "correct" if ok else f"WRONG (expected {ex.target!r})"
        print(f"    {verdict}   TTFT {out.ttft_s * 1e3:.1f} ms, {len(out.token_ids)} tokens in "
              f"{seconds * 1e3:.0f} ms\n")
    return correct


# a real pretrained model, converted once from its GGUF file (engine/loading/gguf.py)
REAL_MODEL = "smollm2-135m-instruct"
REAL_MODEL_QUESTIONS = ("What is the capital of France?", "Name three primary colors.")
REAL_MODEL_MAX_TOKENS = 48


def real_model_demo(name: str = REAL_MODEL, speed: str | None = None) -> None:
    """The same engine on a real 135M-parameter model:
    a couple of chat questions through its chat template."""
    from engine.llm import LLM

    try:
        llm = LLM(name, speed=speed)
    except FileNotFoundError as err:  # the model's package is not installed: say how, and go on
        print(f"== {name}: skipped ({err})\n")
        return
    print(f"== {name}: {llm.engine.model.config.num_params() / 1e6:.0f}M parameters, "
          f"a real pretrained model, greedy, through its chat template ==\n")
    params = SamplingParams(temperature=0.0, max_tokens=REAL_MODEL_MAX_TOKENS)
    conversations = [[{"role": "user", "content": q}] for q in REAL_MODEL_QUESTIONS]
    for question, out in zip(REAL_MODEL_QUESTIONS,
                             llm.chat(conversations, params, use_tqdm=False), strict=True):
        answer = out.outputs[0]
        print(f"[user] {question}\n    [assistant] {answer.text.strip()!r}")
        print(f"    {len(answer.token_ids)} tokens, TTFT {out.metrics.ttft_s * 1e3:.0f} ms, "
              f"{llm.engine.num_threads} torch thread{'s' * (llm.engine.num_threads != 1)}\n")


def run_demo(args) -> None:
    with torch_threads(DEMO_TORCH_THREADS):
        correct = task_demo(args.model)
    print(f"{correct}/{len(tasks.TASKS) - 1} checkable answers correct "
          f"({DEMO_TORCH_THREADS} torch thread{'s' * (DEMO_TORCH_THREADS != 1)}).\n")
    speed = getattr(args, "speed", None)
    real_model_demo(speed=speed)
    step_through_demo(args.model, args.steps, pause=not args.no_pause, speed=speed,
                      speculative_config=getattr(args, "speculative_config", None))

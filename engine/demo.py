"""`python -m engine demo` (and `make demo`): the bundled model at work, in a terminal.

Part 1 runs one held-out prompt of each task through the engine and prints the prompt, the output,
whether it is right, and the timings. Part 2 (the classroom demo of chapter 05) shows the engine's
scheduler step by step.
"""

from __future__ import annotations

import time

from engine import tasks
from engine.kv_cache import generate_cached
from engine.loader import load_model
from engine.sampling import SamplingParams

DEMO_SEED = 2026  # which held-out examples the demo shows (any seed works: they are all held out)
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
    print(f"== {model_name}: {model.config.num_params() / 1e6:.1f}M parameters, one held-out prompt per task ==\n")
    correct = 0
    for task in tasks.TASKS:
        ex = tasks.eval_examples(task, 1, seed=tasks.EVAL_SEED_BASE + DEMO_SEED)[0]
        max_tokens = tasks.MAX_NEW_TOKENS.get(task, 48)
        start = time.perf_counter()
        out = generate_cached(model, tok, ex.prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        seconds = time.perf_counter() - start
        prompt = ex.prompt if len(ex.prompt) <= PROMPT_PREVIEW_CHARS else "…" + ex.prompt[-PROMPT_PREVIEW_CHARS:]
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


def run_demo(args) -> None:
    from engine.demo_engine import step_through_demo

    correct = task_demo(args.model)
    print(f"{correct}/{len(tasks.TASKS) - 1} checkable answers correct.\n")
    step_through_demo(args.model, args.steps, pause=not args.no_pause)

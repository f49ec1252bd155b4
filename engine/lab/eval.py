"""Evaluate a model on the task suite of `engine/lab/tasks.py` (`python -m engine eval`).

`tasks.py` knows prompts and scorers but nothing of models; here we plug a real model in: greedy
completions through the cached loop (optionally with a sliding window, for chapter 03), and the
story perplexity from one forward pass per story. Later chapters (quantization) evaluate their
variants through the same `evaluate_model`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.companions.kv_cache import generate_cached
from engine.lab import tasks
from engine.model import LlamaModel
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer


def greedy_generate_fn(model: LlamaModel, tokenizer: Tokenizer, window: int | None = None):
    """generate_fn(prompts, max_tokens) -> completions, one greedy cached generation per prompt."""

    def generate(prompts: list[str], max_tokens: int) -> list[str]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return [generate_cached(model, tokenizer, p, params, window=window).text for p in prompts]

    return generate


def engine_generate_fn(model: LlamaModel, tokenizer: Tokenizer, **engine_options):
    """generate_fn through the paged engine (all prompts batched), e.g. ``kv_cache_dtype="int8"`` or
    ``sliding_window=W``: the way to measure what an engine-side choice costs in task accuracy."""
    from engine.llm import LLM

    def generate(prompts: list[str], max_tokens: int) -> list[str]:
        llm = LLM(model, tokenizer, **engine_options)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]

    return generate


def nll_fn_for(model: LlamaModel, tokenizer: Tokenizer):
    """nll_fn(prompt, target) -> (sum of -log p(target tokens | prompt), number of target tokens).

    The target is scored up to and including EOS, exactly the tokens the model should write."""

    @torch.inference_mode()
    def nll(prompt: str, target: str) -> tuple[float, int]:
        prompt_ids = tokenizer.encode(prompt)
        target_ids = (tokenizer.encode(target, add_special_tokens=False)
                      + tokenizer.eos_token_ids[:1])
        ids = torch.tensor([prompt_ids + target_ids])  # [1, T]
        logits = model(ids[:, :-1])[0].float()  # [T-1, V]: position t predicts token t+1
        picked = logits[len(prompt_ids) - 1:]  # the positions that predict the target tokens
        return (F.cross_entropy(picked, ids[0, len(prompt_ids):], reduction="sum").item(),
                len(target_ids))

    return nll


def evaluate_model(model: LlamaModel, tokenizer: Tokenizer, task_names=tasks.TASKS, n: int = 100,
                   window: int | None = None, progress: bool = True,
                   kv_cache_dtype: str = "auto", speed: str | None = None) -> list[dict]:
    """Rows of {task, metric, value, n} for the held-out suite (see `tasks.format_table`). With
    ``kv_cache_dtype="int8"`` or a ``speed`` ("reference" or "fast") completions come from the paged
    engine (the story perplexity is always the float model's: it scores one forward pass, no cache);
    otherwise from chapter 03's cached loop."""
    generate = greedy_generate_fn(model, tokenizer, window)
    if kv_cache_dtype != "auto" or speed is not None:
        generate = engine_generate_fn(model, tokenizer, kv_cache_dtype=kv_cache_dtype,
                                      sliding_window=window, speed=speed)
    return tasks.evaluate(generate, tasks=task_names, n=n,
                          nll_fn=nll_fn_for(model, tokenizer), progress=progress)

"""`python -m engine eval --kv-cache-dtype int8` generates through the paged engine: with float K/V that
path must give exactly the completions of the cached loop it replaces (so a score change is the int8's)."""

from engine.lab import tasks
from engine.lab.eval import engine_generate_fn, greedy_generate_fn
from engine.loading.loader import load_model


def test_engine_generation_equals_the_cached_loop_on_task_prompts():
    model, tok = load_model("tinylab")
    prompts = [ex.prompt for name in ("arith", "json") for ex in tasks.eval_examples(name, 4)]
    assert len(prompts) == 8
    assert engine_generate_fn(model, tok)(prompts, 24) == greedy_generate_fn(model, tok)(prompts, 24)

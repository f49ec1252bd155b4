"""Write tests/golden/tinylab_greedy.json: greedy token ids of the bundled model on a few prompts,
made by the naive loop (the oracle). Run it once after retraining tinylab, and commit the result:
    .venv/bin/python tests/golden/make_tinylab_golden.py
"""

import json
from pathlib import Path

from engine import load_model
from engine.companions.naive import generate_naive
from engine.lab import tasks
from engine.sampling import SamplingParams

MAX_TOKENS = 24
PROMPTS = [ex.prompt for task in tasks.TASKS for ex in tasks.eval_examples(task, 2, seed=tasks.EVAL_SEED_BASE + 7)]


def main() -> None:
    model, tok = load_model("tinylab")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    cases = [{"prompt": p, "token_ids": generate_naive(model, tok, p, params).token_ids} for p in PROMPTS]
    out = Path(__file__).parent / "tinylab_greedy.json"
    out.write_text(json.dumps({"max_tokens": MAX_TOKENS, "cases": cases}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()

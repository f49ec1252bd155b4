"""tinylab's task suite as lm-evaluation-harness tasks (chapter 13): a local task file, no download.

lm-eval (EleutherAI's harness, in its own virtual environment, never an engine dependency) scores
a model behind an OpenAI-compatible server. Its `local-completions` model asks /v1/completions for
the prompt's logprobs (`echo=True, logprobs=1, max_tokens=1`) and sums those of each answer's
tokens: a "loglikelihood" task. We write two tasks from the held-out arithmetic problems:

    tinylab_arith_mc    multiple choice: "Q: 775-266=" with the true result and two near misses;
                        the model "chooses" the answer it gives the highest log-probability (acc)
    tinylab_arith_gen   generate until a newline, exact match against the result
                        (local-chat-completions or local-completions; a generate-until task)

`choice_accuracy` computes the multiple-choice accuracy in-process from the engine's own prompt
logprobs, tokenizing each (context, answer) pair exactly as lm-eval does, so the two numbers can
be compared.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from engine.lab import tasks
from engine.sampling import SamplingParams

MC_TASK, GEN_TASK = "tinylab_arith_mc", "tinylab_arith_gen"
NEAR_MISSES = (1, 10)  # the wrong choices: the result off by one and by ten (plausible digits)
CHOICES_SEED = 13


def arith_docs(n: int) -> list[dict]:
    """n held-out sums: {"question", "choices", "label", "answer"}; the true result at a random
    index."""
    rng = random.Random(CHOICES_SEED)
    docs = []
    for ex in tasks.eval_examples("arith", n):
        right = int(ex.target)
        options = [str(right), *(str(right + d) for d in NEAR_MISSES)]
        order = rng.sample(range(len(options)), len(options))
        docs.append({"question": ex.prompt, "choices": [options[i] for i in order],
                     "label": order.index(0), "answer": ex.target})
    return docs


def write_tasks(folder: Path, n: int) -> Path:
    """The data (JSON lines) and both task YAMLs in `folder` (lm-eval's --include_path); returns
    it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "arith.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in arith_docs(n)))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (folder / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n{common}output_type: multiple_choice\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n")
    (folder / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n{common}output_type: generate_until\n"
        "doc_to_target: \"{{answer}}\"\ntarget_delimiter: \"\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \"Q:\"]\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return folder


def continuation_logprob(llm, context: str, answer: str) -> float:
    """log P(answer | context) from the engine's prompt logprobs, tokenized as lm-eval's
    `_encode_pair` does: no special tokens (its add_bos_token=False), the whole text encoded once,
    the answer = the tokens after the context's."""
    tok = llm.tokenizer
    whole = tok.encode(context + answer, add_special_tokens=False)
    n_context = len(tok.encode(context, add_special_tokens=False))
    out = llm.generate([whole], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return sum(lp.logprob for lp in out.prompt_logprobs[n_context:])


def choice_accuracy(llm, docs: list[dict]) -> float:
    """The multiple-choice accuracy lm-eval's `acc` reports, computed in-process."""
    right = 0
    for d in docs:
        scores = [continuation_logprob(llm, d["question"], c) for c in d["choices"]]
        right += max(range(len(scores)), key=scores.__getitem__) == d["label"]
    return right / len(docs)

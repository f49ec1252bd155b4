"""Chapter 13: EleutherAI's lm-evaluation-harness scores the server. Its `local-completions` model runs a
loglikelihood (multiple-choice) task made from tinylab's suite against a loopback server, and its accuracy equals
the one computed in-process from the engine's prompt logprobs; `local-chat-completions` runs a generate-until task.

lm-eval lives in its own virtual environment (`make lm-eval` makes .peers/lmeval), never in the engine's; without
it these tests are skipped and say so."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engine.lab.lm_eval_tasks import GEN_TASK, MC_TASK, arith_docs, choice_accuracy, write_tasks
from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import bundled_model_path, load_model
from engine.serving.server import BackgroundServer, build_app

LM_EVAL = Path(__file__).resolve().parents[1] / ".peers" / "lmeval" / "bin" / "lm_eval"
NUM_DOCS = 12  # bounded: a few seconds of server time
pytestmark = pytest.mark.skipif(not LM_EVAL.exists(), reason="lm-eval's venv is missing: run `make lm-eval`")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, tok = load_model("tinylab")
    engine = LLMEngine(model, tok, engine_config("tinylab", max_num_seqs=4))
    with BackgroundServer(build_app(engine, "tinylab")) as server:
        yield server.url, LLM(model, tok), write_tasks(tmp_path_factory.mktemp("tasks"), NUM_DOCS)


def run_lm_eval(model: str, url: str, task: str, folder: Path, out: Path, *extra: str) -> dict:
    args = [str(LM_EVAL), "--model", model, "--tasks", task, "--include_path", str(folder),
            "--model_args", f"model=tinylab,base_url={url},tokenizer={bundled_model_path('tinylab')},"
                            "num_concurrent=1,max_retries=1",
            "--output_path", str(out), *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    return results["results"][task]


def test_lm_evals_multiple_choice_accuracy_equals_the_engines_own(served, tmp_path):
    url, llm, folder = served
    got = run_lm_eval("local-completions", f"{url}/v1/completions", MC_TASK, folder, tmp_path)
    assert got["acc,none"] == pytest.approx(choice_accuracy(llm, arith_docs(NUM_DOCS)), abs=1e-9)


def test_lm_evals_chat_model_runs_a_generate_until_task(served, tmp_path):
    url, _, folder = served
    got = run_lm_eval("local-chat-completions", f"{url}/v1/chat/completions", GEN_TASK, folder, tmp_path,
                      "--apply_chat_template")
    assert 0.0 <= got["exact_match,none"] <= 1.0 and "exact_match_stderr,none" in got

"""benchmarks/gpu_engine.py's logic, on a CPU: the smoke run (`--device cpu --quick`) writes a row for every model,
dtype, batch and attention backend, measured numbers where the backend ran and the reason where it cannot, and the
kernel-alone rows beside them; `--device cuda` without a GPU refuses with a message that says what to run instead.

No speed is asserted: only what the rows say. The real numbers come from a GPU (benchmarks/gpu_all.sh).
"""

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_engine import BACKENDS, BASELINE, DTYPES, QUICK, main

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine.py"
MODEL_LABELS = {"tinylab": "trained (bundled)", "SmolLM2-135M-Instruct shapes": "random weights, real shapes"}
COLUMNS = ["model", "weights", "dtype", "batch", "backend", "status", "decode_tok_s", "decode_step_ms", "offline_tok_s",
           "greedy_vs_torch", "repeats", "spread"]
KERNEL_COLUMNS = ["model", "dtype", "shape", "batch", "context", "heads", "backend", "mb_moved", "ms", "gb_s",
                  "of_copy", "of_datasheet", "max_abs_err", "status"]
GREEDY = re.compile(r"identical (\d+)/\1|\d+/\d+ identical; prompt \d+ from token \d+.*")
SMOKE_TIMEOUT_S = 180  # ~15 s on two idle cores; generous for a busy machine, but never a hang


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run in its own process, without Triton's interpreter (too slow here: Triton is refused)."""
    out = tmp_path_factory.mktemp("gpu_engine")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=SMOKE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_engine.json").read_text()), (out / "gpu_engine.md").read_text(), proc.stdout


def test_the_smoke_run_writes_one_row_per_model_dtype_batch_and_backend_in_the_promised_columns(smoke):
    payload, _, stdout = smoke
    rows = payload["rows"]
    assert all(list(r) == COLUMNS for r in rows)
    have = [(r["model"], r["dtype"], r["batch"], r["backend"]) for r in rows]
    assert sorted(have) == sorted(itertools.product(MODEL_LABELS, DTYPES, QUICK["batches"], BACKENDS))
    assert all(r["weights"].startswith(MODEL_LABELS[r["model"]]) for r in rows)
    assert payload["settings"]["batches"] == list(QUICK["batches"]) and payload["settings"]["copy_gb_s"] > 0
    assert payload["machine"]["cpu"] and payload["machine"]["torch"] == torch.__version__
    assert stdout.count(f"/{len(rows)}] ") == len(rows)  # a progress line per configuration


def test_every_backend_that_ran_has_measured_numbers_and_its_greedy_tokens_checked_against_torch(smoke):
    payload, _, _ = smoke
    ran = [r for r in payload["rows"] if r["status"] == "ran"]
    assert {(r["backend"], r["dtype"]) for r in ran} >= {(b, d) for b in (BASELINE, "sdpa") for d in DTYPES}
    for r in ran:
        assert r["decode_tok_s"] > 0 and r["decode_step_ms"] > 0 and r["repeats"] >= 1 and r["spread"] >= 1, r
        assert (r["offline_tok_s"] > 0) if r["batch"] > 1 else r["offline_tok_s"] is None, r
        if r["backend"] == BASELINE:
            assert r["greedy_vs_torch"] == "(the baseline)"
        else:
            assert GREEDY.fullmatch(r["greedy_vs_torch"]), r
            assert r["greedy_vs_torch"].endswith(f"/{r['batch']}") or "identical;" in r["greedy_vs_torch"]


def test_a_backend_the_cpu_cannot_run_is_a_refused_row_with_the_reason_never_a_crash(smoke):
    payload, _, _ = smoke
    rows = {(r["model"], r["dtype"], r["batch"], r["backend"]): r for r in payload["rows"]}
    for r in rows.values():
        if r["status"] == "ran":
            continue
        assert r["status"].startswith("refused: ") and len(r["status"]) > len("refused: ") + 10, r
        assert r["decode_tok_s"] is None and r["offline_tok_s"] is None and r["greedy_vs_torch"] is None
    cuda = [r for k, r in rows.items() if k[3] == "cuda"]
    assert cuda and all(r["status"] == "refused: no CUDA device is available" for r in cuda)
    assert all("TRITON_INTERPRET" in r["status"] for k, r in rows.items() if k[3] == "triton")
    assert all("float16" in r["status"] for k, r in rows.items() if k[3] == "native" and k[1] == "float16")


def test_the_kernel_alone_is_timed_on_the_largest_batch_step_and_a_long_context_for_every_backend_that_ran(smoke):
    payload, md, _ = smoke
    kernels = payload["attention_kernel"]
    largest = max(QUICK["batches"])
    for model, dtype in itertools.product(MODEL_LABELS, DTYPES):
        ran = {r["backend"] for r in payload["rows"]
               if (r["model"], r["dtype"], r["batch"], r["status"]) == (model, dtype, largest, "ran")}
        mine = [k for k in kernels if (k["model"], k["dtype"]) == (model, dtype)]
        assert sorted((k["backend"], k["context"]) for k in mine) == sorted(
            itertools.product(ran, (QUICK["prompt_tokens"] + QUICK["new_tokens"], QUICK["long_context"])))
    for k in kernels:
        assert list(k) == KERNEL_COLUMNS and k["status"] == "ran" and k["batch"] == largest, k
        assert k["ms"] > 0 and k["gb_s"] > 0 and k["mb_moved"] > 0 and k["of_copy"].endswith(" %"), k
        assert k["max_abs_err"] < 0.1, k  # fp16/bf16 rounding against the torch reference
        assert k["of_datasheet"] is None  # a CPU has no datasheet HBM figure
    assert "RANDOM WEIGHTS WITH THE REAL SHAPES" in md and "## The paged decode kernel alone" in md
    assert "| model | dtype | shape |" in md and "| model | weights | dtype |" in md


def test_device_cuda_without_a_gpu_refuses_and_says_what_to_run_instead(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: --device cuda would run")
    with pytest.raises(SystemExit, match=r"--device cuda needs a CUDA GPU.*--device cpu --quick --out"):
        main(["--device", "cuda", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_cpu_run_must_name_its_output_folder_so_it_never_overwrites_the_gpu_results():
    with pytest.raises(SystemExit, match="pass --out DIR"):
        main(["--device", "cpu", "--quick"])


@pytest.fixture(scope="module")
def tinylab_bf16():
    from engine.loading.loader import load_model

    return load_model("tinylab", dtype=torch.bfloat16)[0]


def test_a_backend_the_engine_falls_back_from_is_a_refused_row_with_the_engines_warning(monkeypatch, tinylab_bf16):
    import benchmarks.gpu_engine as bench

    monkeypatch.setattr(bench, "why_backend_cannot_run", lambda *args: None)  # as if the probe had said yes
    row = bench.engine_row(tinylab_bf16, "tinylab", "trained", "bfloat16", 1, "cuda", QUICK, torch.device("cpu"))
    assert row["status"].startswith("refused: the engine runs 'torch' instead (") and "cannot run here" in row["status"]
    assert row["decode_tok_s"] is None and "tokens" not in row


def test_a_configuration_that_raises_is_a_failed_row_with_the_error_and_the_run_goes_on(monkeypatch, tinylab_bf16):
    import benchmarks.gpu_engine as bench

    def boom(*args):
        raise RuntimeError("CUDA out of memory (planted)")

    monkeypatch.setattr(bench, "measure", boom)
    row = bench.engine_row(tinylab_bf16, "tinylab", "trained", "bfloat16", 1, "torch", QUICK, torch.device("cpu"))
    assert row["status"] == "failed: RuntimeError: CUDA out of memory (planted)"
    assert row["decode_tok_s"] is None

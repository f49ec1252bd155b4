"""The peers of benchmarks/quantization.py: transformers in our process, llama.cpp in its own Python.

Both are timed the way servelab is (benchmarks/quantization.py `time_models`), on the same token ids:

    prefill   one forward of the whole prompt                         -> prompt tokens / seconds
    decode    one forward per new token, greedy, EOS never stops it   -> 1 / median seconds per step

transformers runs here, on the converted Hugging Face folder. llama.cpp (the `llama-cpp-python` package)
is a benchmark-only peer: it lives in its own virtual environment, never in servelab's dependencies,
so we run it as a child process of that environment's python, on the very GGUF file the converted
folder came from:

    quantization.py ──JSON job on stdin──▶ .peers/llamacpp/bin/python benchmarks/_peers.py --llamacpp-worker
                    ◀──JSON result on stdout──

This file imports only the standard library at the top: the worker side has no torch.
Make the environment once (llama.cpp is compiled from source: 6 minutes on 2 idle cores, 33 on one busy
core; LLAVA_BUILD=OFF skips the multimodal library, 51 of 193 compile steps we do not need):

    python -m venv .peers/llamacpp
    CMAKE_ARGS="-DLLAVA_BUILD=OFF" .peers/llamacpp/bin/pip install --no-binary llama-cpp-python \\
        "llama-cpp-python==0.3.36"

On a VM whose CPU lists AMX but does not let a process use the tiles (an Intel Xeon, Sapphire Rapids, in
December 2026), llama.cpp's native build dies with SIGILL (exit -4: `tilezero`, in ggml_backend_amx_mul_mat)
on the Q4_1 file's int8 path while F32 runs.
Build it for the CPU's AVX-512 without AMX instead (what the results of that machine used):

    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" .peers/llamacpp/bin/pip install \
        --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_VENV = REPO_ROOT / ".peers" / "llamacpp"  # git-ignored, like .venv
LLAMACPP_VERSION = "0.3.36"
LLAMACPP_INSTALL = (f"python -m venv {LLAMACPP_VENV.relative_to(REPO_ROOT)} && "
                    f'CMAKE_ARGS="-DLLAVA_BUILD=OFF" {LLAMACPP_VENV.relative_to(REPO_ROOT)}/bin/pip install '
                    f"--no-binary llama-cpp-python "
                    f"llama-cpp-python=={LLAMACPP_VERSION}")
WORKER_FLAG = "--llamacpp-worker"
WORKER_TIMEOUT_S = 1800  # a busy 2-core machine, several prompts: generous, but never hang forever
MIN_CONTEXT = 512  # llama.cpp's smallest sensible n_ctx; larger prompts get a larger one


def llamacpp_python() -> tuple[Path | None, str]:
    """(the peer environment's python, "") or (None, why we skip llama.cpp, with the command that fixes it)."""
    python = LLAMACPP_VENV / "bin" / "python"
    if not python.exists():
        return None, f"no llama.cpp environment at {LLAMACPP_VENV} (make it with: {LLAMACPP_INSTALL})"
    probe = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} cannot import llama_cpp ({last}); reinstall it with: {LLAMACPP_INSTALL}"
    return python, ""


def leading_identical(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share (after the first difference the contexts differ)."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def summarize_steps(prefill_s: list[float], step_s: list[list[float]], prompt_tokens: int) -> dict:
    """Median over repeats: prefill tok/s (prompt_tokens / seconds) and decode tok/s (1 / median step)."""
    if not prefill_s or not all(step_s):
        raise ValueError(f"summarize_steps: need at least one repeat with one decode step, got "
                         f"{len(prefill_s)} prefills and step counts {[len(s) for s in step_s]}")
    return {"prefill_tok_s": prompt_tokens / statistics.median(prefill_s),
            "decode_tok_s": 1.0 / statistics.median(statistics.median(s) for s in step_s)}


# ---- transformers (in this process) -----------------------------------------------------------------
def time_transformers(hf, ids, decode_steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds) of a transformers model on ids [1, T], greedy."""
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)  # only the last position's logits
        prefill_s = time.perf_counter() - start
        steps = []
        for _ in range(decode_steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1] greedy
            start = time.perf_counter()
            out = hf(input_ids=nxt, cache=out.cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - start)
    return prefill_s, statistics.median(steps)


# ---- llama.cpp (a child process of its own environment) --------------------------------------------
def run_llamacpp(python: Path, gguf: Path, job: dict) -> dict:
    """Send ``job`` to the worker under the peer's python; its JSON answer (or RuntimeError with its stderr).

    job: threads, prompt (token ids), decode_steps, repeats, compare_prompts (lists of ids), compare_tokens.
    """
    proc = subprocess.run([str(python), str(Path(__file__).resolve()), WORKER_FLAG],
                          input=json.dumps(dict(job, gguf=str(gguf))), capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S)
    if proc.returncode != 0:
        hint = " (SIGILL: an instruction this CPU refuses; see the AMX-free build in this file's docstring)" \
            if proc.returncode == -4 else ""
        raise RuntimeError(f"llama.cpp worker failed (exit {proc.returncode}){hint}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _open_llama(job: dict):
    from llama_cpp import Llama

    longest = max([len(job["prompt"]) + job["decode_steps"]] +
                  [len(p) + job["compare_tokens"] for p in job["compare_prompts"]])
    n_ctx = max(MIN_CONTEXT, longest + 1)
    batch = max(MIN_CONTEXT, len(job["prompt"]))  # the whole prompt in one batch, as our prefill does
    return Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
                 n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, verbose=False)


def _greedy(llm, prompt: list[int]):
    """llama.cpp's own generator, greedy; reset() first so it cannot reuse the previous prompt's cache."""
    llm.reset()
    # a copy of the prompt: generate() reuses the list it is given for the next tokens
    return llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)


def _time_greedy(llm, prompt: list[int], steps: int) -> tuple[float, list[float]]:
    """(seconds to the first token: the prefill, [seconds per following token]: the decode steps)."""
    gen = _greedy(llm, prompt)
    start = time.perf_counter()
    next(gen)
    prefill_s, step_s = time.perf_counter() - start, []
    for _ in range(steps):
        start = time.perf_counter()
        next(gen)
        step_s.append(time.perf_counter() - start)
    gen.close()
    return prefill_s, step_s


def _tokens(llm, prompt: list[int], n: int) -> list[int]:
    gen = _greedy(llm, prompt)
    out = [next(gen) for _ in range(n)]
    gen.close()
    return out


def llamacpp_worker(job: dict) -> dict:
    """Runs inside the peer's environment: time prefill and decode, then the greedy tokens to compare."""
    import llama_cpp

    llm = _open_llama(job)
    _time_greedy(llm, job["prompt"][:8], 2)  # warm-up
    runs = [_time_greedy(llm, job["prompt"], job["decode_steps"]) for _ in range(job["repeats"])]
    speeds = summarize_steps([r[0] for r in runs], [r[1] for r in runs], len(job["prompt"]))
    tokens = [_tokens(llm, p, job["compare_tokens"]) for p in job["compare_prompts"]]
    return dict(speeds, tokens=tokens, version=llama_cpp.__version__,
                system_info=llama_cpp.llama_print_system_info().decode(errors="replace").strip())


if __name__ == "__main__" and WORKER_FLAG in sys.argv:
    print(json.dumps(llamacpp_worker(json.loads(sys.stdin.read()))), flush=True)

"""The engines of benchmarks/vs_vllm.py, one per process, each timed by the same code.

Each engine runs in a child process of its own environment's python, so that no engine shares a
process, a thread pool or an allocator with another (and vLLM and llama.cpp stay out of servelab's
dependencies):

    vs_vllm.py ──JSON job on stdin──▶ <that engine's python> benchmarks/_vs_vllm_workers.py ENGINE OUT.json
               ◀────── OUT.json ─────

    ENGINE        python                      weights                               generate(prompts, n)
    servelab      .venv                       the converted Hugging Face folder     engine.LLM.generate
    transformers  .venv                       the same folder                       generate(), padded batches
    vllm          .peers/vllm                 the same folder                       vllm.LLM.generate
    llamacpp      .peers/llamacpp             the same numbers as an F32 GGUF file  one prompt at a time

Every engine only has to offer ``generate(prompts, n) -> new token ids per prompt`` (greedy, EOS
ignored, exactly n new tokens); `measure` then times the same three things on each:

    batch-1 decode   generate([p], 1 + n) minus generate([p], 1): n decode steps  -> n / seconds
    prefill          generate([one long prompt], 1): the prompt and one token   -> prompt tokens / seconds
    offline          generate(all prompts, n) in one call                        -> prompts * n / seconds

Subtracting the 1-token run removes the prefill and each call's fixed cost from the decode number, the
same way for every engine (vLLM computes in another process, so per-step timers would not be alike).
This file imports only the standard library at the top: the llama.cpp environment has no torch.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("servelab", "transformers", "vllm", "llamacpp")
TRANSFORMERS_BATCH = 16  # padded batches of 16 prompts, as in benchmarks/offline_vs_hf.py
PAD_ID = 0  # transformers' left padding (masked out)
BLOCK_SIZE = 16
WARMUP_TOKENS = 16  # a short first call: lazy initialisation happens outside every timed run


def _say(what: str) -> None:
    """Progress on stderr (the log vs_vllm.py keeps per engine): a slow phase on a busy machine shows where it is."""
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def measure(generate, job: dict) -> dict:
    """The same timings for every engine; the token ids of each run come back for the equality check."""
    n, reps = job["new_tokens"], job["repeats"]
    generate([job["decode_prompt"][:WARMUP_TOKENS]], 2)  # warm-up
    one, full = [], []
    for _ in range(reps):
        one.append(_timed(generate, [job["decode_prompt"]], 1)[0])
        seconds, decode_out = _timed(generate, [job["decode_prompt"]], 1 + n)
        full.append(seconds)
        _say(f"decode: 1 token {one[-1]:.2f} s, {1 + n} tokens {seconds:.2f} s")
    prefill = [_timed(generate, [job["prefill_prompt"]], 1) for _ in range(reps)]
    _say(f"prefill: {', '.join(f'{s:.2f}' for s, _ in prefill)} s")
    out = {"decode_s_1_token": statistics.median(one), "decode_s_all_tokens": statistics.median(full),
           "prefill_s": statistics.median(s for s, _ in prefill),
           "tokens": {"decode": decode_out, "prefill": prefill[-1][1]},
           # every timed run, for the spread vs_vllm.py reports (a slow run shows there)
           "runs": {"decode_s_all_tokens": full, "prefill_s": [s for s, _ in prefill]}}
    if job["offline"]:
        generate(job["offline_prompts"][:4], 2)  # warm-up at a batch above one
        offline = []
        for _ in range(job["offline_repeats"]):
            offline.append(_timed(generate, job["offline_prompts"], n))
            _say(f"offline: {offline[-1][0]:.2f} s")
        out["offline_s"] = statistics.median(s for s, _ in offline)
        out["runs"]["offline_s"] = [s for s, _ in offline]
        out["tokens"]["offline"] = offline[-1][1]
    return out


# ---- servelab and transformers (servelab's environment) ---------------------------------------------
def servelab_engine(job: dict):
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    torch.set_num_threads(job["threads"])
    prompts = job["offline_prompts"] + [job["prefill_prompt"], job["decode_prompt"]]
    blocks = sum(-(-(len(p) + job["new_tokens"] + 1) // BLOCK_SIZE) for p in prompts)  # all at once, with room
    # prefix caching off, as vLLM's here: every repeat of a prompt is computed again, never read from the cache
    llm = LLM(job["folder"], dtype=job["dtype"], num_threads=job["threads"], max_num_seqs=job["max_num_seqs"],
              num_blocks=blocks, block_size=BLOCK_SIZE, enable_prefix_caching=False)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return generate, {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                      "max_num_seqs": job["max_num_seqs"], "num_blocks": blocks, "block_size": BLOCK_SIZE,
                      "enable_prefix_caching": llm.engine.config.cache.enable_prefix_caching,
                      "speed_choices": dict(llm.engine.acceleration.choices)}


def transformers_engine(job: dict):
    import torch
    import transformers

    torch.set_num_threads(job["threads"])
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(job["folder"], dtype=getattr(torch, job["dtype"])).eval()
    cfg = hf.generation_config
    cfg.eos_token_id, cfg.do_sample = None, False  # never stop early, never sample

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        out = []
        for i in range(0, len(prompts), TRANSFORMERS_BATCH):
            batch = prompts[i:i + TRANSFORMERS_BATCH]
            width = max(map(len, batch))  # [B, T_max], each prompt pushed right, the rest masked
            ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                gen = hf.generate(ids, attention_mask=mask, generation_config=cfg, use_cache=True,
                                  max_new_tokens=n, min_new_tokens=n, pad_token_id=PAD_ID)
            out += gen[:, width:].tolist()
        return out
    return generate, {"transformers": transformers.__version__, "torch": torch.__version__,
                      "torch_threads": torch.get_num_threads(), "batch": TRANSFORMERS_BATCH}


# ---- vLLM (.peers/vllm) ------------------------------------------------------------------------------
def vllm_engine(job: dict):
    """vLLM's CPU build. Its settings that matter (the OMP binding and reserved cores) are environment
    variables that vs_vllm.py sets for this process; the rest are LLM arguments, recorded here."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = dict(model=job["folder"], skip_tokenizer_init=True, dtype=job["dtype"], enforce_eager=True,
                enable_prefix_caching=False, max_model_len=job["max_model_len"],
                max_num_seqs=job["max_num_seqs"], seed=0)
    llm = LLM(**args)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    info = {"vllm": vllm.__version__, "torch": torch.__version__, "llm_args": args,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}
    try:  # what its scheduler chose by default (a private structure: recorded when we can read it)
        info["max_num_batched_tokens"] = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    except AttributeError:
        pass
    # Its engine core is another process that busy-polls: it must end with us, or it eats the next engine's CPU.
    generate.close = llm.llm_engine.engine_core.shutdown
    return generate, info


# ---- llama.cpp (.peers/llamacpp) ---------------------------------------------------------------------
def llamacpp_engine(job: dict):
    """llama.cpp has no batched generate in its Python binding: one prompt after another, greedy."""
    import llama_cpp

    batch = max(len(job["prefill_prompt"]), 512)  # the whole prompt in one batch, as the others do
    llm = llama_cpp.Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
                          n_ctx=job["max_model_len"], n_batch=batch, n_ubatch=batch, verbose=False)

    def one(prompt: list[int], n: int) -> list[int]:
        llm.reset()  # never reuse the previous prompt's cache
        gen = llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        out = [next(gen) for _ in range(n)]  # generate() never stops at EOS by itself
        gen.close()
        return out

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        return [one(p, n) for p in prompts]
    return generate, {"llama_cpp_python": llama_cpp.__version__, "threads": job["threads"], "n_batch": batch,
                      "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def run(engine: str, job: dict):
    """Load ``engine`` (timed), then `measure` it: (the result, what ends the engine's helper processes)."""
    makers = {"servelab": servelab_engine, "transformers": transformers_engine, "vllm": vllm_engine,
              "llamacpp": llamacpp_engine}
    load_s, (generate, info) = _timed(makers[engine], job)
    _say(f"{engine} loaded in {load_s:.1f} s")
    job = dict(job, offline=job["offline"] and engine != "llamacpp")  # llama.cpp: batch 1 and prefill only
    result = dict(measure(generate, job), engine=engine, load_s=load_s, info=info)
    return result, getattr(generate, "close", lambda: None)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ENGINES:
        sys.exit(f"usage: {sys.argv[0]} ENGINE OUT.json, ENGINE one of {', '.join(ENGINES)}")
    result, close = run(sys.argv[1], json.loads(sys.stdin.read()))
    Path(sys.argv[2]).write_text(json.dumps(result))
    close()

"""Quantized weights on the real model: decode and prefill tokens per second, and weight bytes, per scheme.

Chapter 07's question 5 ("why is a quantized model sometimes not faster?") on this machine. The model is
SmolLM2-135M-Instruct (engine/loading/gguf.py: converted from the registry package's GGUF file). For each scheme
we load it fresh, quantize its decoder linears (engine/loading/quantization.py), and time forward passes through a
contiguous KV cache (engine/companions/kv_cache.py) on the same random token ids:

    prefill   one forward of B prompts of PROMPT_TOKENS tokens              -> B * PROMPT_TOKENS / seconds
    decode    DECODE_STEPS forwards of one new token per sequence, after it -> B / median seconds per step

at batch 1 and batch 16. The schemes: fp32 and bf16 as loaded and packed the way the engine runs them
(engine/fast/packed_linear.py; the ratios use the faster of the two), int8 and int4-g128 on torch's packed CPU
ops ("packed": bf16 activations inside), the same int4 on the dequantize-every-call reference ("torch"),
int8 and int4-g128 on our C kernel ("native": kernels/quant_matmul/cpu_native.c, x rounded to int8 per 32
inputs) with an int8 LM head (engine.loading.quantization.quantize_lm_head) and once without it, and the GGUF
file's own Q4_1 linears and Q8_0 head kept quantized (quantization="gguf", native). The embedding stays
fp32 in every scheme (a lookup reads one row of it); the LM head too unless a row says otherwise.
Speeds are reported, never asserted; the machine, its CPU flags and the thread count are recorded.

Beside them, in the same run and on the same token ids, the peers (benchmarks/_peers.py), at batch 1:
transformers fp32 and bf16 on the same converted folder, and llama.cpp on the very GGUF file it came
from (Q4_1 decoder linears, a Q8_0 tied embedding / LM head), in its own environment .peers/llamacpp
(skipped, with the reason printed, where that environment is missing). Then servelab's "gguf" model
and llama.cpp generate greedily from a few chat prompts and we count their identical leading tokens
(reported, not asserted: the two dequantize Q4_1 and round activations differently).

    python benchmarks/quantization.py                                   # full: writes benchmarks/results/
    python benchmarks/quantization.py --quick --results-dir /tmp/q      # a smoke run (busy-machine numbers)
    python benchmarks/quantization.py --batches 1                       # full settings, batch 1 only (faster)
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REAL_MODEL,
    REAL_MODEL_LABEL,
    markdown_table,
    model_provenance,
    real_model_folder,
    write_results,
)
from benchmarks._peers import (  # noqa: E402
    leading_identical,
    llamacpp_python,
    run_llamacpp,
    time_transformers,
)
from engine.companions.kv_cache import KVCache, forward_with_cache, generate_cached  # noqa: E402
from engine.fast.packed_linear import pack_linears  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.quantization import quantize_lm_head, quantize_model, set_backend, weight_bytes_breakdown  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

SEED = 0
FIRST_TOKEN_ID = 3  # random prompt ids from here up: 0-2 are special tokens
FULL = dict(prompt_tokens=256, decode_steps=32, repeats=3, engine_repeats=5, batches=(1, 16))
QUICK = dict(prompt_tokens=32, decode_steps=4, repeats=1, engine_repeats=1, batches=(1, 16))
# Every scheme's engine is alive at once for the round-robin timing (engine_decode_speeds): a small KV pool each.
ENGINE_KV_BYTES = 64 * 2**20  # 1,456 tokens of fp32 KV: FULL's prompt and decode steps fit
# label -> (how to load, quantize_model scheme or None, QuantLinear backend or None, LM head bits or None: float)
SCHEMES = {
    "fp32": ("fp32", None, None, None),
    "bf16": ("bf16", None, None, None),
    "fp32 packed": ("fp32 packed", None, None, None),  # the layout the engine runs (engine/fast/packed_linear.py)
    "bf16 packed": ("bf16 packed", None, None, None),
    "int8 packed": ("fp32", "int8", "packed", None),
    "int4-g128 packed": ("fp32", "int4-g128", "packed", None),
    "int4-g128 dequant (torch)": ("fp32", "int4-g128", "torch", None),
    "int8 native": ("fp32", "int8", "native", 8),
    "int4-g128 native": ("fp32", "int4-g128", "native", 8),
    "int4-g128 native, int4 head": ("fp32", "int4-g128", "native", 4),  # int4 head: ~20 MiB against ~30 (int8)
    "int4-g128 native, fp32 head": ("fp32", "int4-g128", "native", None),
    # Weight-only quantization of our bf16 model: the same integer weights, bf16 activations and a bf16 KV pool
    # (half the attention's bytes of the fp32 rows above): the like-for-like row against "bf16".
    "int8 native, bf16 activations": ("bf16", "int8", "native", 8),
    "int4-g128 native, bf16 activations": ("bf16", "int4-g128", "native", 8),
    "gguf blocks native": ("gguf", None, "native", 8),  # the file's Q4_1 linears and its Q8_0 head
}
BASELINES = {"fp32": ("fp32", "fp32 packed"), "bf16": ("bf16", "bf16 packed")}  # ratios: to the faster of each
PEER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # transformers, batch 1
# Chat prompts for the token comparison with llama.cpp: real text, so greedy rarely meets a near-tie.
COMPARE_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
                     "Explain what a KV cache is in one sentence.", "List three prime numbers.")
COMPARE_TOKENS = {"full": 32, "quick": 8}
# The targets on this CPU (decode at batch 1, against our own bf16): reported, never asserted.
TARGET_X_VS_BF16 = {"int8 packed": 2.0, "int4-g128 packed": 3.0, "int8 native": 2.0, "int4-g128 native": 3.0,
                    "int4-g128 native, int4 head": 3.0,
                    "int8 native, bf16 activations": 2.0, "int4-g128 native, bf16 activations": 3.0,
                    "gguf blocks native": 3.0}
SMALLER_BUT_NOT_FASTER = 1.2  # "x smaller" above this with decode below fp32's: question 5's case
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The instruction-set flags that decide which fast paths torch's bf16 / int8 / int4 ops take."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted(set(re.findall(r"\b(" + "|".join(CPU_FLAGS) + r")\b", text)))


def load_scheme(label: str, base):
    """A fresh copy of the model for one scheme (``base``: the fp32 model, loaded once)."""
    from engine.loading.loader import load_model

    how, scheme, backend, head = SCHEMES[label]
    if how == "gguf":
        model, _ = load_model(REAL_MODEL, quantization="gguf")  # its Q8_0 head comes as an int8 layer
        set_backend(model, backend)
        return model
    model = copy.deepcopy(base)
    if how.startswith("bf16"):
        model = model.to(torch.bfloat16)
    if how.endswith("packed"):  # the bytes are the weights' own (the packed copies are the engine's working layout)
        model_bytes, step_bytes = sum(weight_bytes_breakdown(model).values()), decode_step_bytes(model)
        model = pack_linears(model, blocks=torch.get_num_threads())
        model.weight_bytes, model.step_bytes = model_bytes, step_bytes
        return model
    if scheme is not None:
        with warnings.catch_warnings():  # groups of 64 where 128 does not divide K = 576: expected
            warnings.simplefilter("ignore", RuntimeWarning)
            quantize_model(model, scheme, backend=backend)
    if head is not None:
        quantize_lm_head(model, backend=backend, bits=head)
    return model


def decode_step_bytes(model) -> int:
    """Weight bytes one decode step streams: the decoder linears and the whole LM head (tied or not), not the
    embedding (one row of it is read) nor the norms. At the same bandwidth, a scheme's batch-1 decode beats bf16
    by at most the ratio of these bytes: attention, norms and sampling cost the same for both and lower it."""
    parts = weight_bytes_breakdown(model)
    head = getattr(model, "lm_head", None)
    if parts["quantized lm_head"]:
        head_bytes = parts["quantized lm_head"]
    else:
        head_bytes = (head.weight if head is not None else model.embed_tokens.weight).nbytes
    return parts["quantized linears"] + parts["float linears"] + head_bytes


def prompt_ids(batch: int, tokens: int, vocab: int) -> torch.Tensor:
    """[B, T] random token ids, the same for every scheme and peer (row 0 is the batch-1 prompt)."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(FIRST_TOKEN_ID, vocab, (batch, tokens), generator=g)


@torch.inference_mode()
def time_models(models: dict, batch: int, cfg: dict) -> dict[str, tuple[float, float]]:
    """Per scheme, (prefill seconds, median decode-step seconds) of ``batch`` random prompts through the readable
    cached loop, medians over the repeats. The models' decode steps run in lockstep, one step of each in turn,
    as in ``engine_decode_speeds``: a slow moment of the machine falls on all schemes alike."""
    vocab = next(iter(models.values())).config.vocab_size
    prefill = {label: [] for label in models}
    steps = {label: [] for label in models}
    ids = prompt_ids(batch, cfg["prompt_tokens"], vocab)
    for _ in range(1 + cfg["repeats"]):  # the first one warms up
        caches, logits = {}, {}
        for label, model in models.items():
            caches[label] = KVCache(model, batch=batch, capacity=cfg["prompt_tokens"] + cfg["decode_steps"] + 1)
            t0 = time.perf_counter()
            logits[label] = forward_with_cache(model, caches[label], ids)  # [B, V]: the last position only
            prefill[label].append(time.perf_counter() - t0)
        for _ in range(cfg["decode_steps"]):
            for label, model in models.items():
                nxt = logits[label].reshape(batch, -1)[:, -vocab:].argmax(-1, keepdim=True)  # [B, 1] greedy
                t0 = time.perf_counter()
                logits[label] = forward_with_cache(model, caches[label], nxt)
                steps[label].append(time.perf_counter() - t0)
    first = cfg["decode_steps"]  # the warm-up repeat's steps
    return {label: (statistics.median(prefill[label][1:]), statistics.median(steps[label][first:]))
            for label in models}


def speed_row(engine: str, label: str, batch: int, mib: float, prefill_tok_s: float, decode_tok_s: float) -> dict:
    return {"engine": engine, "scheme": label, "batch": batch, "weight_mib": round(mib, 1), "step_mib": None,
            "prefill_tok_s": round(prefill_tok_s, 1), "decode_tok_s": round(decode_tok_s, 1)}


def measure_timer(engine: str, label: str, timer, mib: float, cfg: dict, batches) -> list[dict]:
    """Rows for one model: ``timer(batch, cfg) -> (prefill s, decode-step s)``, warmed up, median of repeats."""
    rows = []
    for batch in batches:
        timer(batch, dict(cfg, prompt_tokens=8, decode_steps=2))  # warm-up
        runs = [timer(batch, cfg) for _ in range(cfg["repeats"])]
        prefill_s = statistics.median(r[0] for r in runs)
        decode_s = statistics.median(r[1] for r in runs)
        rows.append(speed_row(engine, label, batch, mib, batch * cfg["prompt_tokens"] / prefill_s, batch / decode_s))
    return rows


def servelab_row(label: str, model, batch: int, cfg: dict, prefill_s: float, decode_s: float) -> dict:
    mib = getattr(model, "weight_bytes", sum(weight_bytes_breakdown(model).values())) / 2**20
    row = speed_row("servelab", label, batch, mib, batch * cfg["prompt_tokens"] / prefill_s, batch / decode_s)
    row["step_mib"] = round((getattr(model, "step_bytes", None) or decode_step_bytes(model)) / 2**20, 1)
    return row


def engine_decode_speeds(models: dict, cfg: dict) -> dict[str, float]:
    """Batch-1 decode tok/s through the engine itself (``LLMEngine.step``, what ``LLM.generate`` runs: paged KV,
    attention planned once per step, fp32/bf16 linears packed), the path a user runs, per scheme. The schemes'
    engines step in lockstep, one decode step of each in turn, so that a slow moment of a shared machine (they
    last seconds here, and halve the speed) falls on all of them alike; tok/s is one over the median step."""
    pool_log = logging.getLogger("engine")  # "the KV cache holds fewer tokens than max_model_len": meant
    level = pool_log.level
    pool_log.setLevel(logging.ERROR)
    try:
        engines = {label: LLM(m, None, dtype=str(m.embed_tokens.weight.dtype).removeprefix("torch."),
                              num_threads=torch.get_num_threads(), max_num_seqs=1,
                              kv_cache_memory_bytes=ENGINE_KV_BYTES).engine for label, m in models.items()}
    finally:
        pool_log.setLevel(level)
    ids = prompt_ids(1, cfg["prompt_tokens"], next(iter(models.values())).config.vocab_size)[0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=cfg["decode_steps"] + 1, ignore_eos=True)
    steps = {label: [] for label in engines}
    for repeat in range(1 + cfg["engine_repeats"]):  # the first one warms up
        for engine in engines.values():
            engine.add_request(ids, params)
            engine.step()  # the prefill (and the first token): not timed
        for _ in range(cfg["decode_steps"]):
            for label, engine in engines.items():
                t0 = time.perf_counter()
                engine.step()
                if repeat:
                    steps[label].append(time.perf_counter() - t0)
        assert not any(e.has_unfinished_requests() for e in engines.values())
    return {label: 1.0 / statistics.median(times) for label, times in steps.items()}


def transformers_rows(folder: Path, vocab: int, cfg: dict) -> list[dict]:
    """transformers fp32 and bf16 on the converted folder, batch 1, timed like our schemes."""
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for name, dtype in PEER_DTYPES.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        mib = sum(p.nbytes for p in hf.parameters()) / 2**20  # parameters(): the tied LM head once

        def timer(batch: int, c: dict, hf=hf):
            return time_transformers(hf, prompt_ids(batch, c["prompt_tokens"], vocab), c["decode_steps"])
        rows += measure_timer("transformers", name, timer, mib, cfg, (1,))
        print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
        del hf
    return rows


def compare_prompts(tokenizer) -> list[list[int]]:
    """COMPARE_QUESTIONS as token ids of the model's chat template (llama.cpp gets the very same ids)."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False) for q in COMPARE_QUESTIONS]


def servelab_gguf_tokens(prompts: list[list[int]], n: int) -> tuple[dict[str, list[list[int]]], list[str]]:
    """Greedy tokens of the "gguf" model (the file's own Q4_1 blocks) per QuantLinear backend, and its
    first-token gaps (``first_token_gaps``, torch backend)."""
    from engine.loading.loader import load_model

    model, _ = load_model(REAL_MODEL, quantization="gguf")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = {}
    for backend in ("native", "torch"):  # x rounded to int8 per 32 inputs / dequantize to fp32 every call
        set_backend(model, backend)
        out[backend] = [generate_cached(model, None, p, params).token_ids for p in prompts]
    return out, first_token_gaps(model, prompts)


@torch.inference_mode()
def first_token_gaps(model, prompts: list[list[int]]) -> list[str]:
    """Per prompt, the logit gap between our top two first tokens: a small gap is a near-tie, where
    another engine's rounding may pick the other token (and the whole answer then differs)."""
    gaps = []
    for p in prompts:
        logits = forward_with_cache(model, KVCache(model, capacity=len(p)), torch.tensor([p]))[0]  # [V]
        top = logits.float().topk(2).values
        gaps.append(f"{float(top[0] - top[1]):.2f}")
    return gaps


# int4 decoder linears with the three heads: what the head's precision costs in greedy tokens
HEAD_COMPARE = {"int8 head": "int4-g128 native", "int4 head": "int4-g128 native, int4 head"}
HEAD_REFERENCE = "int4-g128 native, fp32 head"


def head_token_agreement(base, prompts: list[list[int]], n: int) -> dict[str, list[str]]:
    """Per prompt, "k/n": the leading greedy tokens that int4 decoder linears give with an int8 and with an int4
    LM head, against the same linears with the fp32 head (so that only the head differs)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def tokens(label):
        model = load_scheme(label, base)
        return [generate_cached(model, None, p, params).token_ids for p in prompts]
    reference = tokens(HEAD_REFERENCE)
    return {f"int4 linears, {name} vs fp32 head": [f"{leading_identical(x, y)}/{len(y)}"
                                                   for x, y in zip(tokens(label), reference, strict=True)]
            for name, label in HEAD_COMPARE.items()}


def llamacpp_part(cfg: dict, vocab: int, threads: int, prompts: list[list[int]], n: int) -> tuple[list, dict, list]:
    """(llama.cpp's batch-1 row, what we record about it, its greedy tokens on ``prompts``); no row where
    its environment is missing (the reason is printed and recorded)."""
    from collections import Counter

    from engine.loading.gguf import open_gguf, packaged_gguf_path

    python, reason = llamacpp_python()
    if python is None:
        print(f"llama.cpp skipped: {reason}", flush=True)
        return [], {"skipped": reason}, []
    gguf = packaged_gguf_path(REAL_MODEL)
    job = dict(threads=threads, prompt=prompt_ids(1, cfg["prompt_tokens"], vocab)[0].tolist(),
               decode_steps=cfg["decode_steps"], repeats=cfg["repeats"], compare_prompts=prompts, compare_tokens=n)
    res = run_llamacpp(python, gguf, job)
    tensors = open_gguf(gguf).tensors
    mib = sum(int(t.n_bytes) for t in tensors) / 2**20
    row = speed_row("llama.cpp", "gguf file (Q4_1, Q8_0 emb/head)", 1, mib, res["prefill_tok_s"], res["decode_tok_s"])
    print(markdown_table([row]).splitlines()[-1], flush=True)
    info = {"version": res["version"], "threads": threads, "file": gguf.name,
            "tensor_types": dict(Counter(t.tensor_type.name for t in tensors)), "system_info": res["system_info"]}
    return [row], info, res["tokens"]


def token_agreement(ours: dict[str, list[list[int]]], theirs: list[list[int]]) -> dict[str, list[str]]:
    """Per prompt, "k/n": the leading greedy tokens our gguf model shares with llama.cpp (and the two
    backends with each other)."""
    def agree(a, b):
        return [f"{leading_identical(x, y)}/{len(y)}" for x, y in zip(a, b, strict=True)]
    out = {f"servelab gguf {b} vs llama.cpp": agree(toks, theirs) for b, toks in ours.items() if theirs}
    out["servelab gguf native vs torch"] = agree(ours["native"], ours["torch"])
    return out


def add_ratios(rows: list[dict]) -> None:
    """x_*: each row against servelab's faster fp32 and faster bf16 row at the same batch (``BASELINES``:
    as loaded or packed as the engine runs it), peers included."""
    ours = {(r["scheme"], r["batch"]): r for r in rows if r["engine"] == "servelab"}

    def best(kind, batch, key):
        return max(ours[(label, batch)][key] for label in BASELINES[kind] if (label, batch) in ours)

    def best_bytes(kind, batch):  # as loaded or packed, the same bytes
        return ours[(BASELINES[kind][0], batch)].get("step_mib")

    for row in rows:
        row.setdefault("engine_decode_tok_s", None)  # servelab's batch-1 rows only (every row has the column)
        b = row["batch"]
        row["x_decode_vs_fp32"] = round(row["decode_tok_s"] / best("fp32", b, "decode_tok_s"), 2)
        row["x_decode_vs_bf16"] = round(row["decode_tok_s"] / best("bf16", b, "decode_tok_s"), 2)
        row["x_prefill_vs_fp32"] = round(row["prefill_tok_s"] / best("fp32", b, "prefill_tok_s"), 2)
        row["x_smaller_than_fp32"] = round(ours[("fp32", b)]["weight_mib"] / row["weight_mib"], 2)
        row.setdefault("step_mib", None)  # servelab's rows only
        row["x_engine_decode_vs_bf16"] = row["x_bytes_vs_bf16"] = None
        if row["step_mib"] and best_bytes("bf16", b):
            row["x_bytes_vs_bf16"] = round(best_bytes("bf16", b) / row["step_mib"], 2)
        if row["engine_decode_tok_s"] is not None:
            bf16 = best("bf16", b, "engine_decode_tok_s")
            row["x_engine_decode_vs_bf16"] = round(row["engine_decode_tok_s"] / bf16, 2)


def target_summary(rows: list[dict]) -> list[str]:
    """The issue's targets (rows after add_ratios), one line each: met / missed, with the numbers."""
    at = {(r["engine"], r["scheme"], r["batch"]): r for r in rows}
    lines = []
    for label, target in TARGET_X_VS_BF16.items():
        r1, r16 = at.get(("servelab", label, 1)), at.get(("servelab", label, 16))
        if r1 is None:
            continue
        verdict = "met" if r1["x_decode_vs_bf16"] >= target else "missed"
        extra = f"; at batch 16 {r16['x_decode_vs_bf16']}x" if r16 else ""
        if r1["x_engine_decode_vs_bf16"] is not None:
            engine_verdict = "met" if r1["x_engine_decode_vs_bf16"] >= target else "missed"
            extra += f"; through the engine {r1['x_engine_decode_vs_bf16']}x ({engine_verdict})"
        if r1["x_bytes_vs_bf16"] is not None:
            extra += (f"; it streams {r1['x_bytes_vs_bf16']}x fewer weight bytes a step than bf16, the ratio a "
                      f"step made of nothing but the weight stream would reach")
        lines.append(f"{label}: batch-1 decode {r1['x_decode_vs_bf16']}x our bf16 "
                     f"(target >= {target:g}x: {verdict}){extra}")
    peer = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    ours = at.get(("servelab", "gguf blocks native", 1))
    if peer and ours:
        x = ours["decode_tok_s"] / peer["decode_tok_s"]
        best = max(ours["decode_tok_s"], ours["engine_decode_tok_s"] or 0)
        engine = f"through the engine {ours['engine_decode_tok_s']} tok/s; " if ours["engine_decode_tok_s"] else ""
        verdict = "met" if best >= peer["decode_tok_s"] else "missed"
        lines.append(f"int4 vs llama.cpp, same Q4_1 file: decode {ours['decode_tok_s']} vs {peer['decode_tok_s']} "
                     f"tok/s = {x:.2f}x ({engine}target: reach it: {verdict}); prefill "
                     f"{ours['prefill_tok_s']} vs {peer['prefill_tok_s']} tok/s")
    elif ours:
        lines.append("int4 vs llama.cpp: not measured (llama.cpp skipped)")
    slow = [f"{r['scheme']} (batch {r['batch']}: {r['x_smaller_than_fp32']}x smaller, decode "
            f"{r['x_decode_vs_fp32']}x fp32)" for r in rows if r["engine"] == "servelab"
            and r["x_smaller_than_fp32"] >= SMALLER_BUT_NOT_FASTER and r["x_decode_vs_fp32"] < 1]
    lines.append("smaller but not faster: " + ("; ".join(slow) if slow else "none in this run"))
    return lines


def conditions(when: str) -> dict:
    """How busy the machine is: load averages and the other python processes (helpers train and test)."""
    from benchmarks.decode_vs_hf import busy_processes

    return {f"load_avg_1_5_15_{when}": [round(x, 2) for x in os.getloadavg()],
            **{f"{k}_{when}": v for k, v in busy_processes().items()}}


def run_servelab(cfg: dict, base) -> list[dict]:
    """Every scheme's rows: all models loaded at once (a few GiB), so that each measurement can run them in turn."""
    models, rows = {label: load_scheme(label, base) for label in SCHEMES}, []
    for batch in cfg["batches"]:
        print(f"batch {batch}: the cached loop, the schemes in turn ...", flush=True)
        for label, (prefill_s, decode_s) in time_models(models, batch, cfg).items():
            rows.append(servelab_row(label, models[label], batch, cfg, prefill_s, decode_s))
            print(markdown_table([rows[-1]]).splitlines()[-1], flush=True)
    print("batch-1 decode through the engine, the schemes in turn ...", flush=True)
    speeds = engine_decode_speeds(models, cfg)
    for row in rows:
        if row["batch"] == 1:
            row["engine_decode_tok_s"] = round(speeds[row["scheme"]], 1)
    return rows


def main(argv=None) -> None:
    from engine.loading.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short prompts, few steps, one repeat (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="threads for every engine (default 1: steady on "
                                                              "a shared machine)")
    parser.add_argument("--results-dir", default=None, help="write here instead of benchmarks/results/")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="servelab's batch sizes (default 1 16; the peers always run batch 1)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    cfg = dict(cfg, batches=tuple(args.batches)) if args.batches else cfg
    torch.set_num_threads(args.threads)
    before = conditions("before")
    folder, (base, tokenizer) = real_model_folder(), load_model(REAL_MODEL)
    vocab, n_compare = base.config.vocab_size, COMPARE_TOKENS["quick" if args.quick else "full"]
    rows = run_servelab(cfg, base)
    prompts = compare_prompts(tokenizer)
    heads = head_token_agreement(base, prompts, n_compare)
    del base
    rows += transformers_rows(folder, vocab, cfg)
    peer_rows, llamacpp, theirs = llamacpp_part(cfg, vocab, args.threads, prompts, n_compare)
    rows += peer_rows
    ours, gaps = servelab_gguf_tokens(prompts, n_compare)
    agreement = dict(token_agreement(ours, theirs), **{"servelab gguf first-token top-2 logit gap": gaps}, **heads)
    add_ratios(rows)
    targets = target_summary(rows)
    print("\n" + markdown_table(rows) + "\n" + "\n".join(targets) + "\n" + json.dumps(agreement))
    settings = dict(quick=args.quick, model=REAL_MODEL_LABEL, **{k: list(v) if isinstance(v, tuple) else v
                                                                 for k, v in cfg.items()},
                    threads=args.threads, torch_threads=torch.get_num_threads(),
                    cpu_flags=" ".join(cpu_flags()) or "unknown",
                    torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                    weights=model_provenance(folder), **before, **conditions("after"),
                    llamacpp=llamacpp, greedy_leading_tokens_identical=agreement, targets=targets)
    write_results("quantization", rows, settings, notes=notes_text(settings),
                  results_dir=Path(args.results_dir) if args.results_dir else None)


NOTES = """
Decode and prefill tokens per second of SmolLM2-135M-Instruct per weight scheme, servelab at the batches
in Settings, the peers at batch 1 (transformers on the same converted folder, llama.cpp on the same GGUF file), on the
same random token ids, greedy (x_*: ratios to the faster of servelab's two fp32 rows, as loaded or packed, and
likewise bf16, at the same batch). decode_tok_s times the readable cached loop
(engine/companions/kv_cache.py) that every scheme shares; engine_decode_tok_s times batch-1 decode steps
through the engine itself (LLMEngine.step, what LLM.generate runs: paged KV read by the C decode-attention
kernel, q/k/v and gate/up fused into one matmul each,
fp32/bf16 linears packed, whatever the row), the path a user runs, all schemes' engines stepping in turn. Every
engine runs with the same number of threads. At batch 1 the LM head is the largest matrix a decode step reads (SmolLM2:
49,152 x 576, 108 MiB in fp32): int4 decoder linears alone leave it, so the native rows also read it as
int8 (28 MiB), as llama.cpp reads the file's Q8_0 head, and one row reads it as int4 (groups of 32 with a scale and
a zero: ~20 MiB against ~30 with the int8 head's scales); greedy_leading_tokens_identical in Settings says what each
head costs in tokens against the fp32 head over the same int4 linears. llama.cpp and our native kernel both multiply the
integer weights by int8-rounded activations with integer dot products (AVX2 and up), never building a
float weight. torch's packed int8/int4 ops are fast only with bf16 activations and only on CPUs with bf16
dot-product instructions (avx512_bf16, AMX). The "bf16 activations" rows quantize our bf16 model's weights and
keep everything else bf16 (its KV pool included): weight-only quantization of the very model they are compared
with. step_mib is the weight bytes one decode step streams (decoder linears and LM head, not the embedding);
x_bytes_vs_bf16, bf16's step_mib over the row's, is what a batch-1 decode would gain if both streamed their
weights at the same bandwidth and everything else in a step (attention, norms, sampling, Python) cost nothing.
"""


def notes_text(settings: dict) -> str:
    """NOTES, then the conditions of this run (CPU, flags, threads, how busy) and the targets, met or missed."""
    from benchmarks._common import describe_machine

    bf16_note = ("" if "avx512_bf16" in settings["cpu_flags"] or "amx_bf16" in settings["cpu_flags"] else
                 " This CPU has no bf16 instructions, so bf16 (and the packed ops' bf16 activations) are emulated "
                 "in fp32 arithmetic: bf16 saves bytes but costs time, worst in prefill.")
    agree = "; ".join(f"{k}: {', '.join(v)}" for k, v in settings["greedy_leading_tokens_identical"].items())
    skipped = settings["llamacpp"].get("skipped")
    return (NOTES.strip() + "\n\n"
            f"Conditions: {describe_machine()['cpu']} (flags: {settings['cpu_flags']}), {settings['threads']} "
            f"thread(s) per engine, load average (1/5/15 min) {settings['load_avg_1_5_15_before']} before and "
            f"{settings['load_avg_1_5_15_after']} after, other python processes "
            f"{settings['other_python_processes_before']} / {settings['other_python_processes_after']}, training "
            f"running: {settings['training_running_before'] or settings['training_running_after']}.{bf16_note} A busy "
            f"machine slows every engine, not always alike: compare ratios within this run. Prompts of "
            f"{settings['prompt_tokens']} tokens, {settings['decode_steps']} decode steps, median of "
            f"{settings['repeats']} repeat(s){' (a --quick run: noisy)' if settings['quick'] else ''}; "
            f"engine_decode_tok_s: median step of {settings['engine_repeats']} repeat(s), the schemes' engines "
            f"stepping in turn.\n\n"
            + (f"llama.cpp skipped: {skipped}\n\n" if skipped else "")
            + "Targets:\n" + "\n".join(f"- {t}" for t in settings["targets"]) + "\n\n"
            f"Greedy leading tokens identical ({len(COMPARE_QUESTIONS)} chat prompts, reported, not asserted; "
            f"a prompt whose first tokens differ where our top-2 logit gap is small is a near-tie that "
            f"rounding decides, not a bug): {agree}.")


if __name__ == "__main__":
    main()

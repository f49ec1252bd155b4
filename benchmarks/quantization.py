"""Quantized weights on the real model: decode and prefill tokens per second, and weight bytes, per scheme.

Chapter 07's question 5 ("why is a quantized model sometimes not faster?") on this machine. The model is
SmolLM2-135M-Instruct (engine/gguf.py: converted from the registry package's GGUF file). For each scheme
we load it fresh, quantize its decoder linears (engine/quantization.py), and time forward passes through a
contiguous KV cache (engine/kv_cache.py) on the same random token ids:

    prefill   one forward of B prompts of PROMPT_TOKENS tokens              -> B * PROMPT_TOKENS / seconds
    decode    DECODE_STEPS forwards of one new token per sequence, after it -> B / median seconds per step

at batch 1 and batch 16. The schemes: fp32 and bf16 (the baselines), int8 and int4-g128 on torch's packed CPU
ops ("packed": bf16 activations inside), the same int4 on the dequantize-every-call reference ("torch"),
and the GGUF file's own Q4_1/Q8_0 blocks kept quantized (quantization="gguf", packed). The embedding and LM
head stay fp32 in every quantized scheme (engine/quantization.py says why), so their bytes are in each row.
Speeds are reported, never asserted; the machine, its CPU flags and the thread count are recorded.

    python benchmarks/quantization.py                                   # full: writes benchmarks/results/
    python benchmarks/quantization.py --quick --results-dir /tmp/q      # a smoke run (busy-machine numbers)
"""

from __future__ import annotations

import argparse
import copy
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
from engine.kv_cache import KVCache, forward_with_cache  # noqa: E402
from engine.quantization import quantize_model, set_backend, weight_bytes_breakdown  # noqa: E402

SEED = 0
FIRST_TOKEN_ID = 3  # random prompt ids from here up: 0-2 are special tokens
FULL = dict(prompt_tokens=256, decode_steps=32, repeats=3, batches=(1, 16))
QUICK = dict(prompt_tokens=32, decode_steps=4, repeats=1, batches=(1, 16))
# label -> (how to load, quantize_model scheme or None, QuantLinear backend or None)
SCHEMES = {
    "fp32": ("fp32", None, None),
    "bf16": ("bf16", None, None),
    "int8 packed": ("fp32", "int8", "packed"),
    "int4-g128 packed": ("fp32", "int4-g128", "packed"),
    "int4-g128 dequant (torch)": ("fp32", "int4-g128", "torch"),
    "gguf blocks packed": ("gguf", None, "packed"),
}
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
    from engine.loader import load_model

    how, scheme, backend = SCHEMES[label]
    if how == "gguf":
        model, _ = load_model(REAL_MODEL, quantization="gguf")
        set_backend(model, backend)
        return model
    model = copy.deepcopy(base)
    if how == "bf16":
        return model.to(torch.bfloat16)
    if scheme is not None:
        with warnings.catch_warnings():  # groups of 64 where 128 does not divide K = 576: expected
            warnings.simplefilter("ignore", RuntimeWarning)
            quantize_model(model, scheme, backend=backend)
    return model


@torch.inference_mode()
def time_model(model, batch: int, cfg: dict) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds) for ``batch`` random prompts."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(FIRST_TOKEN_ID, model.config.vocab_size, (batch, cfg["prompt_tokens"]), generator=g)
    cache = KVCache(model, batch=batch, capacity=cfg["prompt_tokens"] + cfg["decode_steps"] + 1)
    t0 = time.perf_counter()
    logits = forward_with_cache(model, cache, ids)  # [B, V]: the last position only
    prefill_s = time.perf_counter() - t0
    steps = []
    for _ in range(cfg["decode_steps"]):
        nxt = logits.reshape(batch, -1)[:, -model.config.vocab_size:].argmax(-1, keepdim=True)  # [B, 1] greedy
        t0 = time.perf_counter()
        logits = forward_with_cache(model, cache, nxt)
        steps.append(time.perf_counter() - t0)
    return prefill_s, statistics.median(steps)


def measure(label: str, model, cfg: dict) -> list[dict]:
    rows = []
    mib = sum(weight_bytes_breakdown(model).values()) / 2**20
    for batch in cfg["batches"]:
        time_model(model, batch, dict(cfg, prompt_tokens=8, decode_steps=2))  # warm-up
        runs = [time_model(model, batch, cfg) for _ in range(cfg["repeats"])]
        prefill_s = statistics.median(r[0] for r in runs)
        decode_s = statistics.median(r[1] for r in runs)
        rows.append({"scheme": label, "batch": batch, "weight_mib": round(mib, 1),
                     "prefill_tok_s": round(batch * cfg["prompt_tokens"] / prefill_s, 1),
                     "decode_tok_s": round(batch / decode_s, 1)})
    return rows


def main(argv=None) -> None:
    from engine.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short prompts, few steps, one repeat (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a shared machine)")
    parser.add_argument("--results-dir", default=None, help="write here instead of benchmarks/results/")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    base, _ = load_model(REAL_MODEL)
    rows = []
    for label in SCHEMES:
        model = load_scheme(label, base)
        rows += measure(label, model, cfg)
        for row in rows[-len(cfg["batches"]):]:
            print(markdown_table([row]).splitlines()[-1], flush=True)
        del model
    fp32 = {r["batch"]: r for r in rows if r["scheme"] == "fp32"}
    for row in rows:
        ref = fp32[row["batch"]]
        row["x_decode_vs_fp32"] = round(row["decode_tok_s"] / ref["decode_tok_s"], 2)
        row["x_prefill_vs_fp32"] = round(row["prefill_tok_s"] / ref["prefill_tok_s"], 2)
        row["x_smaller_than_fp32"] = round(ref["weight_mib"] / row["weight_mib"], 2)
    print("\n" + markdown_table(rows))
    settings = dict(quick=args.quick, model=REAL_MODEL_LABEL, **{k: list(v) if isinstance(v, tuple) else v
                                                                 for k, v in cfg.items()},
                    torch_threads=torch.get_num_threads(), cpu_flags=" ".join(cpu_flags()) or "unknown",
                    torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                    weights=model_provenance(real_model_folder()))
    write_results("quantization", rows, settings, notes=NOTES,
                  results_dir=Path(args.results_dir) if args.results_dir else None)


NOTES = """
Decode and prefill tokens per second of SmolLM2-135M-Instruct per weight scheme, batch 1 and 16, beside fp32
and bf16 in the same run (x_*_vs_fp32: ratios to fp32 at the same batch). The embedding / LM head (108 MiB)
stays fp32 in the quantized schemes. torch's packed int8/int4 ops are fast only with bf16 activations and
only on CPUs with bf16 dot-product instructions (avx512_bf16, AMX); see cpu_flags. Not compared here yet:
transformers and llama.cpp on the same GGUF file (issue 13's peers).
"""


if __name__ == "__main__":
    main()

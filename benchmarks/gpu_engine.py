"""The whole engine on a GPU: tinylab and SmolLM2-135M-Instruct's shapes, fp16 and bf16, batch 1 and 64, each
attention backend that runs there; tokens per second, greedy tokens against the torch backend's, and the paged
decode kernel's share of the memory bandwidth on the batch-64 step's exact shapes.

Per model x dtype x batch x attention backend, `LLM.generate` runs on the device (`model.to(device)`, speed
"fast" with `attention_backend` set, greedy, EOS ignored, prefix caching off so that a repeat computes
everything again, the same random prompt ids for every backend):

    decode tok/s    B * n / (t(1 + n tokens) - t(1 token)): the prefill cancels out (vs_vllm.py's way). We
                    do not add up StepReport times: on a GPU a step's host timers see kernel launches, not
                    kernels, unless every part synchronizes, and the difference of two whole calls needs no sync
    decode step ms  (t(1 + n) - t(1)) / n: one decode step of the whole batch
    offline tok/s   B * (1 + n) / t(1 + n tokens): prefill and decode together (batch 64 only)
    greedy          the t(1 + n) run's tokens against the torch backend's on the same device and prompts,
                    "identical 64/64" or where the first sequences part (vs_vllm.py's compare_tokens)

Every time is one warm-up call of the same shape first (Triton compiles, the CUDA extension loads), then the
median of up to `repeats` calls, each between two torch.cuda.synchronize(). A backend that cannot run on the
device ("native" is a CPU kernel; "triton" on a CPU without Triton's interpreter; "cuda" without a GPU) is a row
"refused" with the reason, and a configuration that raises is a row "failed" with the error: the run goes on.
Past --time-budget-s the remaining configurations are rows "skipped"; the results are written after every
configuration, so a run stopped from outside keeps what it measured.

The kernel alone: `paged_decode_attention` on the batch-64 step's last decode shapes (the model's heads, the
context prompt + n, blocks of 16 in shuffled order) and on the same heads at a LONG_CONTEXT-token context (where K/V
outgrow the L2 cache), timed by gpu_kernels.bench (do_bench medians, L2 flushed; a CPU has no do_bench, so there
a median of perf_counter), its bytes counted as gpu_kernels.py counts them (K and V as stored, q and out), against
a device-to-device copy timed in the same run and the datasheet's HBM bandwidth where we know the GPU.

SmolLM2-135M-Instruct's real weights are a 540 MB conversion that does not travel to a lent GPU, so we build its
exact shapes (engine.config.MODEL_PRESETS["SmolLM2-135M"]; the Instruct model has the same) with seeded random
weights: a step's speed does not depend on the values, and the tables say "random weights, real shapes".

    python benchmarks/gpu_engine.py                       # on a CUDA GPU: results/gpu_engine.{json,md}: the JSON
                                                          # holds machine, settings, rows (the engine) and
                                                          # attention_kernel (the kernel alone); the md both tables
    python benchmarks/gpu_engine.py --device cpu --quick --out /tmp/gpu_engine   # a smoke run of the logic
    bash benchmarks/gpu_all.sh                            # the GPU tests, gpu_kernels.py and this, in one go
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from benchmarks._common import RESULTS_DIR, markdown_table, write_results  # noqa: E402
from benchmarks.gpu_kernels import paged_inputs  # noqa: E402
from benchmarks.vs_vllm import compare_tokens  # noqa: E402
from engine.threads import default_num_threads, torch_threads  # noqa: E402

NAME = "gpu_engine"
MODELS = ("tinylab", "smollm2-135m-instruct")
DTYPES = ("bfloat16", "float16")
# every name in engine.config.ATTENTION_BACKENDS but "auto" (which picks one of these: sdpa on a GPU)
BACKENDS = ("torch", "sdpa", "triton", "cuda", "native")
BASELINE = "torch"  # the readable reference kernels: every other backend's greedy tokens are checked against it
BLOCK_SIZE = 16  # the engine's default KV block
SEED = 0
FIRST_TOKEN_ID = 3  # prompt ids from here up: 0-2 are special tokens in both vocabularies
SMOLLM2_PRESET = "SmolLM2-135M"  # MODEL_PRESETS' name; SmolLM2-135M-Instruct has the same shapes
LONG_CONTEXT = 4096  # the kernel's second context: 64 sequences' K/V then weigh 50-200 MB, past a 60 MB L2
# NVIDIA's datasheet figures (bytes/s), matched against torch.cuda.get_device_name(); other GPUs get the copy only
DATASHEET_HBM_BYTES_S = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "A100-SXM4-80GB": 2.039e12}
COPY_BYTES = {"cuda": 2 * 2**30, "cpu": 256 * 2**20}  # the copy that measures bandwidth: far past any cache
CPU_TIMER_CALLS = 5  # a CPU kernel is timed as the median of this many calls after one warm-up
FULL = dict(prompt_tokens=128, new_tokens=32, batches=(1, 64), repeats=3, config_budget_s=8.0,
            long_context=LONG_CONTEXT, smollm2_layers=None, time_budget_s=210.0)
# --quick: tiny sizes, a 1-layer SmolLM2 (its real widths and vocabulary), batch 4 for 64: a smoke run of the logic
QUICK = dict(prompt_tokens=8, new_tokens=4, batches=(1, 4), repeats=1, config_budget_s=2.0,
             long_context=64, smollm2_layers=1, time_budget_s=None)


# ---- the models ---------------------------------------------------------------------------------------------
def smollm2_shapes(layers: int | None = None):
    """SmolLM2-135M-Instruct's ModelConfig (30 layers, or the first `layers` of them for a smoke run)."""
    from engine.config import MODEL_PRESETS

    preset = MODEL_PRESETS[SMOLLM2_PRESET]
    return dataclasses.replace(preset, name="SmolLM2-135M-Instruct shapes",
                               num_hidden_layers=layers or preset.num_hidden_layers)


def random_model(config, seed: int = SEED):
    """A LlamaModel of `config` in fp32 with seeded random weights, scaled so that every layer keeps its
    input's size (std 1 / sqrt(fan in)) and the embedding has std 1: the logits spread wide (std ~24 for
    SmolLM2's shapes, so few near-ties for greedy) and nothing overflows fp16 in 30 layers (the residual
    stream stays under ~25)."""
    from engine.model import LlamaModel, rope_inv_freq

    with torch.device("meta"):  # no default init: every weight is drawn once, below
        model = LlamaModel(config)
    model = model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty gave the head a tensor of its own: tie it again, as load_model does
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # the RMSNorm weights
            else:
                p.normal_(0.0, 1.0 if name == "embed_tokens.weight" else p.shape[1] ** -0.5)
    return model.eval()


def bench_model(name: str, dtype: torch.dtype, device: torch.device, cfg: dict, cache: dict):
    """(model on `device` in `dtype`, what its weights are). The random fp32 SmolLM2 is built once (`cache`)."""
    from engine.loading.loader import load_model
    from engine.model import rope_inv_freq

    if name == "tinylab":
        model, _ = load_model("tinylab", dtype=dtype)
        return model.to(device), "trained (bundled)"
    if name != "smollm2-135m-instruct":
        raise ValueError(f"--models: unknown model {name!r}; choose from {MODELS}")
    if "smollm2" not in cache:
        cache["smollm2"] = random_model(smollm2_shapes(cfg["smollm2_layers"]))
    model = copy.deepcopy(cache["smollm2"]).to(dtype)  # deepcopy keeps the tied head tied
    model.inv_freq = rope_inv_freq(model.config)  # the rope frequencies stay fp32, as load_model keeps them
    layers = model.config.num_hidden_layers
    weights = "random weights, real shapes" + ("" if layers == 30 else f" ({layers} of 30 layers)")
    return model.to(device), weights


def bench_prompts(vocab: int, batch: int, length: int, seed: int = SEED) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN_ID, vocab, (batch, length), generator=g).tolist()


# ---- the engine, timed ----------------------------------------------------------------------------------------
def why_backend_cannot_run(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None where the paged-attention backend runs on `device`, else the reason (the kernels' own probes)."""
    from kernels.paged_attention.cpu_native import why_native_cannot_run
    from kernels.toolchain import why_cuda_cannot_run, why_triton_cannot_run

    if backend == "native":
        return why_native_cannot_run(device, dtype)
    if backend == "triton":
        return why_triton_cannot_run(device, "kernels.paged_attention.triton")
    if backend == "cuda":
        return why_cuda_cannot_run(device)
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(llm, prompts: list[list[int]], max_tokens: int, device) -> tuple[float, list[list[int]]]:
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - t0
    preempted = sum(o.metrics.num_preemptions for o in outs)
    if preempted:  # a recomputed prompt would be timed as decode: the pool must hold every sequence
        raise RuntimeError(f"{preempted} preemptions: the KV pool is too small for {len(prompts)} sequences")
    short = next((o.outputs[0] for o in outs if len(o.outputs[0].token_ids) != max_tokens), None)
    if short is not None:  # a step that raised finishes its requests early (LLM.generate warns and goes on)
        raise RuntimeError(f"a request ended after {len(short.token_ids)} of {max_tokens} tokens "
                           f"({short.finish_reason}: {short.error})")
    return seconds, [o.outputs[0].token_ids for o in outs]


def build_llm(model, dtype_name: str, backend: str, batch: int, cfg: dict):
    """An LLM over `model` with `backend`; raises Refused where the engine chose another backend."""
    from engine.llm import LLM

    blocks_per_seq = math.ceil((cfg["prompt_tokens"] + cfg["new_tokens"] + 1) / BLOCK_SIZE) + 1  # 1 to spare
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(model, None, dtype=dtype_name, speed="fast", attention_backend=backend, max_num_seqs=batch,
                  num_blocks=batch * blocks_per_seq, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    ran = llm.engine.attention.backend
    if ran != backend:
        said = "; ".join(str(w.message) for w in caught) or "no warning given"
        raise Refused(f"the engine runs {ran!r} instead ({said})")
    return llm


class Refused(Exception):
    """A backend the engine would not run on this device (it fell back to another)."""


def measure(llm, prompts: list[list[int]], cfg: dict, device) -> dict:
    """Warm-up, then up to cfg['repeats'] (t(1), t(1 + n)) pairs, as many as cfg['config_budget_s'] holds."""
    n = cfg["new_tokens"]
    warm_s, _ = timed_generate(llm, prompts, 1 + n, device)
    repeats = max(1, min(cfg["repeats"], int(cfg["config_budget_s"] // max(warm_s, 1e-9))))
    first, full, tokens = [], [], None
    for _ in range(repeats):
        first.append(timed_generate(llm, prompts, 1, device)[0])
        seconds, tokens = timed_generate(llm, prompts, 1 + n, device)
        full.append(seconds)
    batch, decode_s = len(prompts), statistics.median(full) - statistics.median(first)
    return {"decode_tok_s": round(batch * n / decode_s, 1) if decode_s > 0 else None,
            "decode_step_ms": round(1e3 * decode_s / n, 3) if decode_s > 0 else None,
            "offline_tok_s": round(batch * (1 + n) / statistics.median(full), 1) if batch > 1 else None,
            "repeats": repeats, "spread": round(max(full) / min(full), 3), "tokens": tokens}


def greedy_text(tokens: list[list[int]], baseline: list[list[int]] | None) -> str:
    """'identical 64/64', or '63/64 identical; prompt 12 from token 40 (...)' (vs_vllm.compare_tokens)."""
    if baseline is None:
        return f"no {BASELINE} run to compare"
    c = compare_tokens(baseline, tokens)
    if not c["first_differences"]:
        return f"identical {c['identical']}/{c['of']}"
    where = ", ".join(f"prompt {d['prompt']} from token {d['position']}" for d in c["first_differences"][:3])
    return f"{c['identical']}/{c['of']} identical; {where}"


def blank_row(label: str, weights: str, dtype_name: str, batch: int, backend: str, status: str) -> dict:
    return dict(model=label, weights=weights, dtype=dtype_name, batch=batch, backend=backend, status=status,
                decode_tok_s=None, decode_step_ms=None, offline_tok_s=None, greedy_vs_torch=None, repeats=None,
                spread=None)


def engine_row(model, label: str, weights: str, dtype_name: str, batch: int, backend: str, cfg: dict,
               device) -> dict:
    """One configuration's row (status ran / refused / failed); 'tokens' is popped by the caller."""
    row = blank_row(label, weights, dtype_name, batch, backend, "ran")
    why = why_backend_cannot_run(backend, device, model.embed_tokens.weight.dtype)
    if why is not None:
        return dict(row, status=f"refused: {why}")
    prompts = bench_prompts(model.config.vocab_size, batch, cfg["prompt_tokens"])
    llm = None
    try:
        llm = build_llm(model, dtype_name, backend, batch, cfg)
        return dict(row, **measure(llm, prompts, cfg, device))
    except Refused as refused:
        return dict(row, status=f"refused: {refused}")
    except Exception as exc:  # one configuration's failure must not cost the others: record it, go on
        return dict(row, status=f"failed: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        del llm
        if device.type == "cuda":  # give the pool's memory back before the next engine takes its own
            gc.collect()
            torch.cuda.empty_cache()


# ---- the kernel alone -----------------------------------------------------------------------------------------
def kernel_ms(fn, device) -> float:
    """Milliseconds of one call: gpu_kernels.bench (do_bench) on a GPU, a perf_counter median on a CPU."""
    if device.type == "cuda":
        from benchmarks.gpu_kernels import bench

        return bench(fn)
    fn()
    times = []
    for _ in range(CPU_TIMER_CALLS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def copy_bandwidth(device) -> float | None:
    """Bytes/s of a device-to-device copy (read + write counted), the ceiling a memory-bound kernel meets; None
    (with a warning) where it could not be timed: the engine's rows do not need it."""
    try:
        src = torch.empty(COPY_BYTES[device.type] // 4, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        ms = kernel_ms(lambda: dst.copy_(src), device)
    except Exception as exc:
        warnings.warn(f"the copy bandwidth could not be timed ({type(exc).__name__}: {exc})", RuntimeWarning,
                      stacklevel=2)
        return None
    return 2 * COPY_BYTES[device.type] / (ms * 1e-3)


def datasheet_bandwidth(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in DATASHEET_HBM_BYTES_S.items() if key in name), None)


def kernel_rows(config, label: str, dtype, backends: list[str], contexts: dict[str, int], batch: int,
                bandwidth: dict, device) -> list[dict]:
    """paged_decode_attention alone, per backend the engine ran, on each context: ms, GB/s, share of the peaks."""
    from kernels.paged_attention import paged_decode_attention
    from kernels.paged_attention.triton import decode_traffic_bytes

    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rows = []
    for what, context in contexts.items():
        inputs = paged_inputs(dtype, device, batch, context, heads=H, kv_heads=Hkv, head_dim=D,
                              block=BLOCK_SIZE, seed=SEED)
        moved = decode_traffic_bytes(batch, context, H, Hkv, D, inputs["q"].element_size())["fused"]
        expected = paged_decode_attention(**inputs, backend=BASELINE).float()
        for backend in backends:
            row = dict(model=label, dtype=str(dtype).removeprefix("torch."), shape=what, batch=batch,
                       context=context, heads=f"{H}/{Hkv}/{D}", backend=backend)
            try:
                err = (paged_decode_attention(**inputs, backend=backend).float() - expected).abs().max().item()
                ms = kernel_ms(lambda b=backend, x=inputs: paged_decode_attention(**x, backend=b), device)
            except Exception as exc:  # record it, time the others
                rows.append(dict(row, mb_moved=round(moved / 1e6, 3), ms=None, gb_s=None, of_copy=None,
                                 of_datasheet=None, max_abs_err=None, status=f"failed: {type(exc).__name__}: {exc}"))
                continue
            rate = moved / (ms * 1e-3)
            sheet, copied = bandwidth["datasheet_bytes_s"], bandwidth["copy_bytes_s"]
            rows.append(dict(row, mb_moved=round(moved / 1e6, 3), ms=float(f"{ms:.4g}"),
                             gb_s=float(f"{rate / 1e9:.4g}"),
                             of_copy=None if copied is None else f"{100 * rate / copied:.1f} %",
                             of_datasheet=None if sheet is None else f"{100 * rate / sheet:.1f} %",
                             max_abs_err=float(f"{err:.3g}"), status="ran"))
    return rows


# ---- the run ------------------------------------------------------------------------------------------------
NOTES = f"""\
The engine end to end on the device: `LLM.generate` (speed "fast", `attention_backend` as in the table, greedy,
EOS ignored, prefix caching off) over the same random prompt ids for every backend. decode tok/s = B * n /
(t(1 + n tokens) - t(1 token)); decode_step_ms = the same difference / n (one decode step of the whole batch);
offline tok/s = B * (1 + n) / t(1 + n tokens) (batch > 1 only). Each time is the median of `repeats` calls after
one warm-up call of the same shape, between torch.cuda.synchronize(); spread = slowest / fastest t(1 + n).
greedy_vs_torch: the tokens of the t(1 + n) call against the {BASELINE} backend's on the same device and prompts.
"refused" rows are backends the device cannot run (the reason is the kernels' own probe, or the engine's fallback
warning); "failed" rows raised (the error is kept); "skipped" rows came after --time-budget-s.
The SmolLM2-135M-Instruct rows use RANDOM WEIGHTS WITH THE REAL SHAPES (engine.config.MODEL_PRESETS
["{SMOLLM2_PRESET}"]: 30 layers, hidden 576, 9 query and 3 KV heads of 64, vocabulary 49,152, seeded, std
1/sqrt(fan in)): the real weights are a 540 MB conversion that does not travel to a lent GPU, and a step's speed
does not depend on the values. Their greedy check compares backends on those random weights: two logits closer
than bf16's rounding (1/128 of their size) can swap, so a difference late in a sequence can be rounding, while one
at token 0 of every sequence would be a bug."""

KERNEL_NOTES = """\
`paged_decode_attention` alone, per backend the engine ran at the largest batch: on that step's last decode shapes
(the model's heads H/Hkv/D, context = prompt + n tokens, blocks of 16 in shuffled order) and on the same heads at a
long context. mb_moved: the bytes it must move (K and V as stored, q and out: kernels/paged_attention/triton.py's
decode_traffic_bytes, as benchmarks/gpu_kernels.py counts); gb_s = mb_moved / ms; of_copy: that against a
device-to-device copy timed in this run (read + write, settings' copy_gb_s); of_datasheet: against the vendor's HBM
figure. Times: gpu_kernels.bench (do_bench median, L2 flushed) on a GPU, a perf_counter median on a CPU.
max_abs_err: against the torch reference on the same inputs. At the step's short context the K/V fit in L2 and a
call lasts a few microseconds: there the share says how far launch and scheduling costs sit from the bandwidth."""


def settings_of(cfg: dict, device, bandwidth: dict, budget_s: float | None) -> dict:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    settings = dict(device=device.type, cuda=torch.version.cuda, triton=triton_version)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        settings.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}",
                        gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_sms=props.multi_processor_count)
    sheet, copied = bandwidth["datasheet_bytes_s"], bandwidth["copy_bytes_s"]
    settings.update(prompt_tokens=cfg["prompt_tokens"], new_tokens=cfg["new_tokens"], batches=list(cfg["batches"]),
                    repeats=cfg["repeats"], block_size=BLOCK_SIZE, speed="fast", enable_prefix_caching=False,
                    copy_gb_s=None if copied is None else round(copied / 1e9, 1),
                    datasheet_gb_s=None if sheet is None else round(sheet / 1e9), time_budget_s=budget_s)
    return settings


def save(out: Path, rows: list[dict], kernels: list[dict], settings: dict) -> tuple[Path, Path]:
    """_common.write_results for the engine's rows, then the kernel's rows beside them (JSON key and md section)."""
    json_path, md_path = write_results(NAME, rows, settings, notes=NOTES, results_dir=out)
    payload = json.loads(json_path.read_text())
    payload["attention_kernel"] = kernels
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    with md_path.open("a") as f:
        f.write(f"\n## The paged decode kernel alone\n\n{KERNEL_NOTES}\n\n{markdown_table(kernels)}")
    return json_path, md_path


def progress(i: int, total: int, row: dict, started: float) -> None:
    what = f"[{i}/{total}] {row['model']} {row['dtype']} B={row['batch']} {row['backend']}"
    if row["status"] != "ran":
        print(f"{what}: {row['status']}", flush=True)
        return
    offline = "" if row["offline_tok_s"] is None else f", offline {row['offline_tok_s']} tok/s"
    print(f"{what}: decode {row['decode_tok_s']} tok/s ({row['decode_step_ms']} ms a step){offline}, "
          f"greedy {row['greedy_vs_torch']}, {row['repeats']} repeats  [{time.perf_counter() - started:.0f} s]",
          flush=True)


class Run:
    """One invocation's state: what is done, what is left of the time budget, where results go."""

    def __init__(self, args, cfg: dict, device):
        self.args, self.cfg, self.device = args, cfg, device
        self.started = time.perf_counter()
        self.budget_s = args.time_budget_s if args.time_budget_s is not None else cfg["time_budget_s"]
        self.bandwidth = {"copy_bytes_s": copy_bandwidth(device), "datasheet_bytes_s": datasheet_bandwidth(device)}
        self.settings = settings_of(cfg, device, self.bandwidth, self.budget_s)
        backends = list(dict.fromkeys(args.backends))
        self.backends = [BASELINE] + [b for b in backends if b != BASELINE] if BASELINE in backends else backends
        self.total = len(args.models) * len(args.dtypes) * len(cfg["batches"]) * len(self.backends)
        self.rows: list[dict] = []
        self.kernels: list[dict] = []
        self.cache: dict = {}

    def over_budget(self) -> bool:
        return self.budget_s is not None and time.perf_counter() - self.started > self.budget_s

    def add(self, row: dict) -> None:
        self.rows.append(row)
        progress(len(self.rows), self.total, row, self.started)
        save(self.args.out, self.rows, self.kernels, self.settings)

    def model_and_dtype(self, name: str, dtype_name: str) -> None:
        """Every batch and backend of one model in one dtype, then the kernel alone on its batch-B step."""
        label = "tinylab" if name == "tinylab" else "SmolLM2-135M-Instruct shapes"
        skipped = f"skipped: past the time budget ({self.budget_s:g} s)" if self.budget_s else "skipped"
        if self.over_budget():
            for batch in self.cfg["batches"]:
                for backend in self.backends:
                    self.add(blank_row(label, "-", dtype_name, batch, backend, skipped))
            return
        model, weights = bench_model(name, getattr(torch, dtype_name), self.device, self.cfg, self.cache)
        ran_at_largest = []
        for batch in self.cfg["batches"]:
            baseline = None
            for backend in self.backends:
                if self.over_budget():
                    self.add(blank_row(label, weights, dtype_name, batch, backend, skipped))
                    continue
                row = engine_row(model, label, weights, dtype_name, batch, backend, self.cfg, self.device)
                tokens = row.pop("tokens", None)
                if backend == BASELINE:
                    baseline = tokens
                    row["greedy_vs_torch"] = "(the baseline)" if tokens is not None else None
                elif tokens is not None:
                    row["greedy_vs_torch"] = greedy_text(tokens, baseline)
                if row["status"] == "ran" and batch == max(self.cfg["batches"]):
                    ran_at_largest.append(backend)
                self.add(row)
        if ran_at_largest and not self.over_budget():
            self.kernel(model.config, label, model.embed_tokens.weight.dtype, ran_at_largest)
        del model

    def kernel(self, config, label: str, dtype, backends: list[str]) -> None:
        batch = max(self.cfg["batches"])
        contexts = {f"the batch-{batch} step": self.cfg["prompt_tokens"] + self.cfg["new_tokens"],
                    "long context": self.cfg["long_context"]}
        # on a CPU, the threads the engine ran this model with (the C kernel shares torch's pool)
        cpu = self.device.type == "cpu"
        with torch_threads(default_num_threads(config.num_params())) if cpu else nullcontext():
            rows = kernel_rows(config, label, dtype, backends, contexts, batch, self.bandwidth, self.device)
        self.kernels += rows
        for r in rows:
            print(f"    kernel {r['backend']} {r['shape']} (context {r['context']}): {r['ms']} ms, {r['gb_s']} GB/s, "
                  f"{r['of_copy']} of the copy, {r['of_datasheet']} of the datasheet", flush=True)
        save(self.args.out, self.rows, self.kernels, self.settings)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (the default; refused without a GPU) or cpu (a smoke run of the logic)")
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes, a smoke run: {QUICK}")
    parser.add_argument("--out", type=Path, default=None,
                        help="the results folder (default benchmarks/results; a --device cpu run must name one)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help=f"past this, the remaining configurations are rows 'skipped' (default "
                             f"{FULL['time_budget_s']:g}, none with --quick)")
    return parser.parse_args(argv)


def check_device(args) -> torch.device:
    """The device, or a SystemExit that says what to run instead."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_engine.py: --device cuda needs a CUDA GPU, and torch.cuda.is_available() is False "
                         f"here (torch {torch.__version__}, CUDA build {torch.version.cuda}). Without a GPU, run "
                         f"the smoke run: python benchmarks/gpu_engine.py --device cpu --quick --out /tmp/gpu_engine")
    if args.device == "cpu" and args.out is None:
        raise SystemExit("gpu_engine.py --device cpu: pass --out DIR, so that a CPU run never overwrites the GPU's "
                         "benchmarks/results/gpu_engine.*")
    return torch.device(args.device)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = check_device(args)
    args.out = args.out or RESULTS_DIR
    cfg = QUICK if args.quick else FULL
    if args.quick:  # a smoke run checks the logic: the fast wing's races on a CPU would outlast it
        os.environ.setdefault("SERVELAB_TUNING", "defaults")
    run = Run(args, cfg, device)
    print(f"gpu_engine: {run.total} configurations on {run.settings.get('gpu', device.type)}, "
          f"copy {run.settings['copy_gb_s']} GB/s; results to {args.out}", flush=True)
    for name in args.models:
        for dtype_name in args.dtypes:
            run.model_and_dtype(name, dtype_name)
    json_path, md_path = save(args.out, run.rows, run.kernels, run.settings)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path} in {time.perf_counter() - run.started:.0f} s")


if __name__ == "__main__":
    main()

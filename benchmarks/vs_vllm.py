"""servelab against vLLM's CPU build, transformers and llama.cpp: one process per engine, same ids, same weights.

Issue 17's table, measured in one run on one machine:

    engine          batch-1 decode tok/s   offline tok/s (64 prompts × 64 new)   prefill tok/s (1 × 1024)
    servelab        ...                    ...                                   ...
    transformers    ...                    ...                                   ...
    vLLM (CPU)      ...                    ...                                   ...
    llama.cpp       ...                    (no batched generate)                 ...

Same weights: SmolLM2-135M-Instruct as servelab converts it (engine/loading/gguf.py: the registry package's GGUF
file, dequantized to fp32 into a Hugging Face folder). servelab, transformers and vLLM load that folder;
llama.cpp reads an F32 GGUF file that we write once from the same GGUF file with the same dequantization,
so its weights are the very same fp32 numbers (`check_same_weights` compares two tensors exactly).
Same token ids: random prompts from one seed (the speed does not depend on which tokens they are).
Greedy, EOS ignored, exactly the same number of new tokens everywhere; afterwards we compare every
engine's tokens with servelab's, token for token, and report the differences (never stop on them).

The engines run one after another, never at once, each in its own process (benchmarks/_vs_vllm_workers.py
says how each is timed), with the same number of threads, in two rounds (A B C D, then D C B A: a slow
phase of a shared machine then falls on all of them alike; each number is the median of its rounds); we
record the load average before and after each. vLLM lives in its own environment, made by
`bash benchmarks/setup_vllm.sh` (.peers/vllm), and llama.cpp in .peers/llamacpp (benchmarks/_peers.py says
how to make it); either one missing is skipped with the reason and the command that makes it.

    python benchmarks/vs_vllm.py                      # the full run (about 15-25 minutes on 2 cores)
    python benchmarks/vs_vllm.py --quick --results-dir /tmp/vs   # a smoke run (or VS_VLLM_QUICK=1)
    python benchmarks/vs_vllm.py --engines servelab vllm          # a subset
    python benchmarks/vs_vllm.py --dtype bfloat16     # bf16 weights everywhere (results/vs_vllm_bfloat16.*);
                                                      # llama.cpp reads only the F32 file, so it sits this one out
    python benchmarks/vs_vllm.py --isa avx2           # every library capped at AVX2 (results/vs_vllm_avx2.*)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from benchmarks._common import (  # noqa: E402
    ISA_CAPS,
    REAL_MODEL_LABEL,
    REPO_ROOT,
    add_tag_option,
    markdown_table,
    model_provenance,
    real_model_folder,
    tagged,
    write_results,
)
from benchmarks._vs_vllm_workers import ENGINES, TRANSFORMERS_BATCH  # noqa: E402

SEED = 0
FIRST_TOKEN_ID = 3  # prompt ids from here up: 0-2 are the special tokens
OFFLINE_PROMPT_LENGTHS = (32, 256)  # the "64 prompts of 32-256 tokens", uniform
FULL = dict(prompts=64, new_tokens=64, prefill_tokens=1024, decode_prompt_tokens=128, repeats=3, offline_repeats=2,
            rounds=2)
QUICK = dict(prompts=8, new_tokens=8, prefill_tokens=256, decode_prompt_tokens=32, repeats=1, offline_repeats=1,
             rounds=1)
# What a worker times; with several rounds, each is the median over the rounds (combine_rounds).
TIMED = ("decode_s_1_token", "decode_s_all_tokens", "prefill_s", "offline_s")
QUICK_ENV = "VS_VLLM_QUICK"  # =1: the same as --quick
MAX_NUM_SEQS = 64  # servelab's and vLLM's running-batch cap: every offline prompt admitted at once, on both
MAX_MODEL_LEN = 2048  # above the 1024-token prefill prompt plus its token
VLLM_KVCACHE_GIB = 2  # vLLM's KV pool: 45,000 fp32 tokens of this model, twice what the offline run holds
VLLM_VENV = REPO_ROOT / ".peers" / "vllm"  # git-ignored, like .venv
VLLM_SETUP = "bash benchmarks/setup_vllm.sh"
WORKER = Path(__file__).resolve().parent / "_vs_vllm_workers.py"
WORKER_TIMEOUT_S = 3600  # one engine on a busy 2-core machine: generous, but never hang forever
LABELS = {"servelab": "servelab LLM.generate", "transformers": "transformers generate (padded batches of "
          f"{TRANSFORMERS_BATCH})", "vllm": "vLLM CPU (eager, no prefix caching)", "llamacpp": "llama.cpp (F32 GGUF)"}
# (what, metric, anchor engine, needed ratio of servelab's to the anchor's): issue 17's speed targets.
TARGETS = (("offline >= 1.2x vLLM", "offline_tok_s", "vllm", 1.2),
           ("prefill >= 1.2x vLLM", "prefill_tok_s", "vllm", 1.2),
           ("batch-1 decode >= llama.cpp", "decode_tok_s", "llamacpp", 1.0))
METRICS = ("decode_tok_s", "offline_tok_s", "prefill_tok_s")
# the timed runs (every repeat of every round) whose slowest over fastest is each metric's spread
SPREAD_OF = {"decode": "decode_s_all_tokens", "offline": "offline_s", "prefill": "prefill_s"}
MAX_SPREAD = 1.2  # issue 34: an engine whose runs differ by more than this says so in the table
PEAK_FRACTION_NEEDED = 0.8  # issue 17: offline throughput >= 80% of this machine's matmul peak, in useful FLOPs
PEAK_ROWS = 4096  # the matmul peak is measured on a prefill-sized GEMM: 4096 rows x the model's widest weight
PEAK_REPEATS = 10


# ---- the work: prompts and weights ---------------------------------------------------------------------
def make_prompts(cfg: dict, vocab: int, seed: int = SEED) -> dict:
    """Random token ids from one seed: the offline prompts (lengths uniform in OFFLINE_PROMPT_LENGTHS),
    the batch-1 decode prompt and the long prefill prompt."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(k)]
    lengths = [rng.randint(*OFFLINE_PROMPT_LENGTHS) for _ in range(cfg["prompts"])]
    return {"offline_prompts": [ids(k) for k in lengths], "decode_prompt": ids(cfg["decode_prompt_tokens"]),
            "prefill_prompt": ids(cfg["prefill_tokens"])}


def f32_gguf(folder: Path) -> Path:
    """An F32 GGUF file of the GGUF file ``folder`` was converted from (written once, next to the cache).

    We dequantize every tensor exactly as engine/loading/gguf.py does (`gguf.quants.dequantize`) and keep llama.cpp's
    own tensor layout and metadata, so llama.cpp multiplies the same fp32 numbers the other engines load.
    """
    from engine.loading.gguf import PROVENANCE_FILE, cache_root

    source = json.loads((folder / PROVENANCE_FILE).read_text())
    out = cache_root() / "peers" / f"{folder.name}-{source['sha256'][:12]}.F32.gguf"
    if not out.exists():
        print(f"writing {out} (once)", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_f32_gguf(Path(source["gguf_file"]), out)
    return out


def _write_f32_gguf(src: Path, out: Path) -> None:
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        value = int(gguf.LlamaFileType.ALL_F32) if field.name == "general.file_type" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)


def check_same_weights(gguf_path: Path, folder: Path) -> str:
    """Two tensors that no layout change touches, compared exactly: the F32 file holds the folder's numbers."""
    import numpy as np
    from gguf import GGUFReader
    from safetensors.numpy import safe_open

    pairs = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}
    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors if t.name in pairs}
    with safe_open(folder / "model.safetensors", "np") as st:
        for ours, theirs in pairs.items():
            if not np.array_equal(np.asarray(tensors[ours].data), st.get_tensor(theirs)):
                raise RuntimeError(f"{gguf_path} tensor {ours} differs from {theirs} in {folder}: delete the "
                                   f"F32 file (it is rewritten) and run again")
    return f"{', '.join(pairs)} identical to the folder's"


# ---- the engines, one process each -----------------------------------------------------------------------
def engine_python(engine: str) -> tuple[str | None, str]:
    """(the python that runs ``engine``, "") or (None, why it is skipped and the command that fixes that)."""
    if engine in ("servelab", "transformers"):
        return sys.executable, ""
    if engine == "llamacpp":
        from benchmarks._peers import llamacpp_python

        python, reason = llamacpp_python()
        return (str(python) if python else None), reason
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return None, f"vLLM is not installed: no environment at {VLLM_VENV} (make it with: {VLLM_SETUP})"
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} cannot import vllm ({last}); remake it with: rm -rf {VLLM_VENV} && {VLLM_SETUP}"
    return str(python), ""


def engine_env(engine: str, threads: int) -> dict:
    """The child's environment: ``threads`` threads; vLLM computes on cores 0..threads-1 and reserves none."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=str(VLLM_KVCACHE_GIB))
    return env


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _end_group(pgid: int) -> None:
    """SIGKILL the process group we started for one worker (its leader's pid), if anything is left in it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_engine(engine: str, python: str, job: dict, threads: int, log_dir: Path, tag: str = "") -> dict:
    """One engine in its own process: its result, or {"failed": ...} with the end of its log (files named
    engine + tag)."""
    out, log = log_dir / f"{engine}{tag}.json", log_dir / f"{engine}{tag}.log"
    before, start = load_average(), time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen([python, str(WORKER), engine, str(out)], stdin=subprocess.PIPE, text=True,
                                stdout=sink, stderr=subprocess.STDOUT, env=engine_env(engine, threads),
                                start_new_session=True)  # its own process group: see below
        try:
            proc.communicate(json.dumps(job), timeout=WORKER_TIMEOUT_S)
        finally:  # whatever it left behind (vLLM's engine-core process) must not slow the next engine
            _end_group(proc.pid)
    conditions = {"load_avg_before": before, "load_avg_after": load_average(),
                  "process_wall_s": round(time.perf_counter() - start, 1), "log": str(log)}
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        print(f"{engine} failed (exit {proc.returncode}); the end of {log}:\n{tail}", flush=True)
        return dict(conditions, engine=engine, failed=f"exit {proc.returncode}: {tail[-600:]}")
    return dict(json.loads(out.read_text()), **conditions)


# ---- what the results say ----------------------------------------------------------------------------------
def speeds(result: dict, cfg: dict) -> dict:
    """tok/s from a worker's seconds: decode from the difference of the (1 + n)- and 1-token runs."""
    if "failed" in result:
        return dict.fromkeys(METRICS)
    decode_s = result["decode_s_all_tokens"] - result["decode_s_1_token"]
    offline_s = result.get("offline_s")
    return {"decode_tok_s": round(cfg["new_tokens"] / decode_s, 1) if decode_s > 0 else None,
            "offline_tok_s": round(cfg["prompts"] * cfg["new_tokens"] / offline_s, 1) if offline_s else None,
            "prefill_tok_s": round(cfg["prefill_tokens"] / result["prefill_s"], 1)}


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many sequences are identical, and where the others first differ (prompt, position, both tokens)."""
    diffs = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            diffs.append({"prompt": i, "position": k, "ours": a[k] if k < len(a) else None,
                          "theirs": b[k] if k < len(b) else None})
    return {"identical": len(ours) - len(diffs), "of": len(ours), "first_differences": diffs}


def greedy_equality(results: dict[str, dict], reference: str = "servelab") -> dict[str, dict]:
    """Every engine's tokens against the reference's, part by part (decode, prefill, offline) where both have it."""
    ref = results.get(reference, {}).get("tokens")
    out = {}
    for engine, result in results.items():
        if engine == reference or ref is None or "tokens" not in result:
            continue
        out[engine] = {part: compare_tokens(ref[part], toks) for part, toks in result["tokens"].items()
                       if part in ref}
    return out


def equality_text(per_part: dict) -> str:
    """'decode 1/1, prefill 1/1, offline 63/64 (prompt 12 from token 40)'."""
    parts = []
    for part, c in per_part.items():
        where = ", ".join(f"prompt {d['prompt']} from token {d['position']}" for d in c["first_differences"][:3])
        parts.append(f"{part} {c['identical']}/{c['of']}" + (f" ({where})" if where else ""))
    return ", ".join(parts)


def table_rows(engine_speeds: dict[str, dict], equality: dict[str, dict], threads: int) -> list[dict]:
    """The issue's table: one row per engine, absolute tok/s and each as a ratio to vLLM (and decode to llama.cpp)."""
    vllm, llama = engine_speeds.get("vllm", {}), engine_speeds.get("llamacpp", {})

    def ratio(x, anchor):
        return round(x / anchor, 2) if x and anchor else None
    rows = []
    for engine, s in engine_speeds.items():
        rows.append({"engine": LABELS[engine], "threads": threads, **s,
                     **{f"{m.removesuffix('_tok_s')}_x_vs_vllm": ratio(s[m], vllm.get(m)) for m in METRICS},
                     "decode_x_vs_llamacpp": ratio(s["decode_tok_s"], llama.get("decode_tok_s")),
                     "greedy_vs_servelab": "reference" if engine == "servelab" else
                     equality_text(equality[engine]) if engine in equality else "-"})
    return rows


def add_spreads(rows: list[dict], results: dict[str, dict]) -> None:
    """Every row gets its engine's spreads (`spreads`)."""
    for row, engine in zip(rows, results, strict=True):
        row.update(spreads(results[engine]))


def spreads(result: dict) -> dict:
    """Each metric's slowest run over its fastest (every repeat of every round), and which ones
    vary by more than MAX_SPREAD ("varies": e.g. "offline 4.1x"; "-" where none does)."""
    runs = result.get("runs", {})
    out = {f"{m}_spread": (round(max(t) / min(t), 2) if len(t := runs.get(key, [])) > 1 else None)
           for m, key in SPREAD_OF.items()}
    wide = [f"{m.removesuffix('_spread')} {v:g}x" for m, v in out.items() if v and v > MAX_SPREAD]
    return dict(out, varies=", ".join(wide) or "-")


def target_verdicts(engine_speeds: dict[str, dict], skipped: dict[str, str]) -> list[dict]:
    """Each of issue 17's speed targets: servelab's number, the anchor's, the ratio, met / missed / not measured."""
    ours, verdicts = engine_speeds.get("servelab", {}), []
    for what, metric, anchor, needed in TARGETS:
        mine, theirs = ours.get(metric), engine_speeds.get(anchor, {}).get(metric)
        if mine is None or theirs is None:
            missing = next((e for e in ("servelab", anchor) if e in skipped), None)
            why = f"{LABELS[missing]} skipped" if missing else "no number"
            verdicts.append({"target": what, "servelab": mine, "anchor": theirs, "ratio": None,
                             "verdict": f"not measured ({why})"})
            continue
        ratio = mine / theirs
        verdicts.append({"target": what, "servelab": mine, "anchor": theirs, "ratio": round(ratio, 2),
                         "verdict": "met" if ratio >= needed else "missed"})
    return verdicts


# ---- the matmul peak and the useful FLOPs of the offline run -----------------------------------------------
def matmul_peak_gflops(folder: Path, dtype: str, threads: int) -> float:
    """GFLOP/s of torch's best CPU GEMM here (oneDNN's packed weight, what the engine's prefill runs), on
    [PEAK_ROWS, E] x the model's gate/up weight [2F, E]^T, in `dtype`, on `threads` threads: the median of
    PEAK_REPEATS. No engine gets more useful matmul work per second than this out of the same cores."""
    import torch

    cfg = json.loads((folder / "config.json").read_text())
    E, F2 = cfg["hidden_size"], 2 * cfg["intermediate_size"]
    dt, before = getattr(torch, dtype), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w = torch.randn(PEAK_ROWS, E).to(dt), torch.randn(F2, E).to(dt)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PEAK_ROWS)
        gemm = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        for _ in range(2):
            gemm()
        times = []
        for _ in range(PEAK_REPEATS):
            t = time.perf_counter()
            gemm()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return 2 * PEAK_ROWS * E * F2 / statistics.median(times) / 1e9


def offline_useful_gflop(folder: Path, prompt_lengths: list[int], new_tokens: int) -> float:
    """The FLOPs the offline run cannot avoid: every linear layer once per token (2 per weight), the LM head once
    per generated token, and causal attention (QK^T and PV: 4 H D FLOPs per layer and visible key)."""
    cfg = json.loads((folder / "config.json").read_text())
    L, E, H, D = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    Hkv, F, V = cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    per_token = 2 * L * (E * (H + 2 * Hkv) * D + H * D * E + 3 * E * F)
    attention_per_key = 4 * L * H * D
    total = 0
    for n in prompt_lengths:
        positions = n + new_tokens - 1  # the prompt's tokens, then every generated token but the last is fed back
        total += positions * per_token + attention_per_key * positions * (positions + 1) // 2
    total += len(prompt_lengths) * new_tokens * 2 * E * V
    return total / 1e9


def add_peak_notes(verdicts: list[dict], rows: list[dict]) -> None:
    """To each "N x vLLM" verdict, where that ratio would put us against the matmul peak: vLLM's share of the peak
    times N. Above 1, the target asks for more useful work per second than the reference GEMM delivers."""
    vllm = next((r for r in rows if r["engine"] == LABELS["vllm"]), None)
    for v in verdicts:
        kind = next((k for k in ("offline", "prefill") if v["target"].startswith(k)), None)
        needed = next((n for what, _, anchor, n in TARGETS if what == v["target"] and anchor == "vllm"), None)
        share = vllm.get(f"{kind}_x_peak") if vllm and kind and needed else None
        if share:
            v["peak_note"] = (f"vLLM ran at {share:.0%} of the matmul peak, so {needed:g}x vLLM is "
                              f"{needed * share:.0%} of it")


def peak_fraction_verdict(result: dict | None, useful_gflop: float, peak_gflops: float) -> dict:
    """The peak target's verdict for one engine's offline seconds."""
    what = f"offline >= {PEAK_FRACTION_NEEDED:.0%} of the matmul peak"
    seconds = (result or {}).get("offline_s")
    if not seconds:
        return {"target": what, "servelab": None, "anchor": round(peak_gflops, 1), "ratio": None,
                "verdict": "not measured (no offline run)"}
    gflops = useful_gflop / seconds
    return {"target": what, "servelab": round(gflops, 1), "anchor": round(peak_gflops, 1),
            "ratio": round(gflops / peak_gflops, 2),
            "verdict": "met" if gflops >= PEAK_FRACTION_NEEDED * peak_gflops else "missed", "unit": "GFLOP/s"}


# ---- the run ---------------------------------------------------------------------------------------------
DTYPES = ("float32", "bfloat16")  # what every engine loads the weights as (the same name in torch and vLLM)


def make_job(cfg: dict, folder: Path, threads: int, dtype: str = "float32") -> dict:
    """What every worker gets: the same token ids, the same folder, the same sizes."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return dict(make_prompts(cfg, vocab), folder=str(folder), threads=threads, dtype=dtype,
                new_tokens=cfg["new_tokens"], repeats=cfg["repeats"], offline_repeats=cfg["offline_repeats"],
                offline=True, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)


def run_all(engines: list[str], job: dict, threads: int, log_dir: Path, rounds: int = 1) -> tuple[dict, dict]:
    """Each engine in its own process, never two at once, ``rounds`` times in turns: A B C, then C B A, and so on.
    This VM has slow phases minutes long (the same engine's offline run has measured 1.3x apart in one hour), and
    one engine after another would let a phase fall on one of them only; in turns, and in mirrored order, it falls
    on all alike. (results by engine, each timing the median over its rounds; skipped engine -> reason)."""
    runs, skipped, pythons = {}, {}, {}
    for engine in engines:
        pythons[engine], reason = engine_python(engine)
        if pythons[engine] is None:
            print(f"{engine} skipped: {reason}", flush=True)
            skipped[engine] = reason
    present = [e for e in engines if e not in skipped]
    for r in range(rounds):
        for engine in present if r % 2 == 0 else present[::-1]:
            if engine in skipped:  # it failed in an earlier round
                continue
            print(f"{engine}: round {r + 1} of {rounds} (load average {load_average()}) ...", flush=True)
            result = run_engine(engine, pythons[engine], job, threads, log_dir, tag=f".round{r + 1}")
            runs.setdefault(engine, []).append(result)
            if "failed" in result:
                skipped[engine] = f"failed ({result['failed'][:200]})"
            else:
                print(f"{engine}: {speeds(result, sizes_of(job))}, load average after "
                      f"{result['load_avg_after']}", flush=True)
    return {engine: combine_rounds(rs) for engine, rs in runs.items()}, skipped


def combine_rounds(rounds: list[dict]) -> dict:
    """One engine's result from its rounds: the first round's (tokens, info), each TIMED number the median over
    the rounds, every round's numbers kept under "rounds", and whether the greedy tokens repeated. A failed
    round makes the whole result that failure."""
    failed = next((r for r in rounds if "failed" in r), None)
    if failed is not None:
        return failed
    out = dict(rounds[0], load_avg_after=rounds[-1]["load_avg_after"],
               rounds=[{k: r.get(k) for k in TIMED} for r in rounds],
               tokens_repeat=all(r["tokens"] == rounds[0]["tokens"] for r in rounds),
               runs={k: [t for r in rounds for t in r.get("runs", {}).get(k, [])]
                     for k in SPREAD_OF.values()})
    for key in TIMED:
        values = [r.get(key) for r in rounds]
        out[key] = statistics.median(values) if None not in values else None
    return out


def sizes_of(job: dict) -> dict:
    """The sizes `speeds` needs, read back from a job."""
    return {"new_tokens": job["new_tokens"], "prompts": len(job["offline_prompts"]),
            "prefill_tokens": len(job["prefill_prompt"])}


def main(argv=None) -> None:
    import torch

    from benchmarks.quantization import cpu_flags
    from engine.loading.gguf import file_sha256

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} (or {QUICK_ENV}=1)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="which engines")
    parser.add_argument("--prompts", type=int, default=None, help="offline prompts (default 64; quick 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 64; quick 8)")
    parser.add_argument("--results-dir", type=Path, default=None, help="write here instead of benchmarks/results/")
    parser.add_argument("--rounds", type=int, default=None,
                        help="times each engine runs, in turns (default 2; quick 1): see run_all")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="weights and compute for every engine (bfloat16: llama.cpp, F32 only here, is left out)")
    parser.add_argument("--isa", choices=tuple(ISA_CAPS), default="native",
                        help="avx2: torch, oneDNN, MKL and our C kernels capped at AVX2 + FMA in every engine's "
                             "process (an AVX2-only CPU's code paths; llama.cpp, built for this CPU, is left out)")
    add_tag_option(parser)
    args = parser.parse_args(argv)
    engines = [e for e in args.engines if not ((args.dtype != "float32" or args.isa != "native") and e == "llamacpp")]
    os.environ.update(ISA_CAPS[args.isa])  # every worker inherits it (engine_env), and so does our peak GEMM
    quick = args.quick or os.environ.get(QUICK_ENV) == "1"
    cfg, folder = dict(QUICK if quick else FULL), real_model_folder()
    cfg.update({k: v for k, v in (("prompts", args.prompts), ("new_tokens", args.new_tokens),
                                  ("rounds", args.rounds)) if v is not None})
    if cfg["rounds"] < 1:
        parser.error(f"--rounds must be at least 1, got {cfg['rounds']}")
    job = make_job(cfg, folder, args.threads, args.dtype)
    llama = {}
    if "llamacpp" in engines:
        gguf_path = f32_gguf(folder)
        job["gguf"] = str(gguf_path)
        llama = {"file": gguf_path.name, "sha256": file_sha256(gguf_path),
                 "same_weights": check_same_weights(gguf_path, folder)}
    log_dir = Path(tempfile.mkdtemp(prefix="vs_vllm_"))
    started = load_average()
    peak = matmul_peak_gflops(folder, args.dtype, args.threads)
    print(f"matmul peak ({args.dtype}, {args.threads} threads): {peak:.0f} GFLOP/s", flush=True)
    results, skipped = run_all(engines, job, args.threads, log_dir, rounds=cfg["rounds"])
    if "llamacpp" in args.engines and "llamacpp" not in engines:
        skipped["llamacpp"] = (f"--dtype {args.dtype}: this benchmark gives llama.cpp only an F32 GGUF file"
                               if args.dtype != "float32" else
                               f"--isa {args.isa}: llama.cpp was compiled for this CPU's own instructions")
    engine_speeds = {e: speeds(r, cfg) for e, r in results.items()}
    equality = greedy_equality({e: r for e, r in results.items() if "failed" not in r})
    rows, verdicts = table_rows(engine_speeds, equality, args.threads), target_verdicts(engine_speeds, skipped)
    add_spreads(rows, results)
    useful = offline_useful_gflop(folder, [len(p) for p in job["offline_prompts"]], cfg["new_tokens"])
    verdicts.append(peak_fraction_verdict(results.get("servelab"), useful, peak))
    useful_prefill = offline_useful_gflop(folder, [cfg["prefill_tokens"]], 1)  # one prompt, its first token
    for row, engine in zip(rows, engine_speeds, strict=True):  # each run in useful GFLOP/s, and / peak
        for kind, gflop in (("offline", useful), ("prefill", useful_prefill)):
            seconds = results[engine].get(f"{kind}_s")
            row[f"{kind}_useful_gflops"] = round(gflop / seconds, 1) if seconds else None
            row[f"{kind}_x_peak"] = round(gflop / seconds / peak, 2) if seconds else None
    add_peak_notes(verdicts, rows)
    print("\n" + markdown_table(rows) + "\n" + "\n".join(f"{v['target']}: {v['verdict']}" for v in verdicts))
    settings = dict(quick=quick, model=REAL_MODEL_LABEL, dtype=args.dtype, isa=args.isa, greedy=True, ignore_eos=True,
                    **cfg,
                    offline_prompt_lengths=list(OFFLINE_PROMPT_LENGTHS),
                    offline_prompt_tokens=sum(map(len, job["offline_prompts"])), threads=args.threads,
                    max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, cpu_flags=" ".join(cpu_flags()),
                    matmul_peak_gflops=round(peak, 1), offline_useful_gflop=round(useful, 1),
                    torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), load_avg_at_start=started,
                    load_avg_at_end=load_average(), weights=model_provenance(folder)["sha256"],
                    vllm=vllm_settings(results.get("vllm", {}).get("info")))
    # The long parts go to the JSON only (the markdown's Settings line stays readable).
    details = dict(engines={e: {k: r.get(k) for k in ("info", "load_s", "load_avg_before", "load_avg_after",
                                                      "process_wall_s", "failed", "rounds", "tokens_repeat", "runs")}
                            for e, r in results.items()},
                   skipped=skipped, targets=verdicts, greedy_equality=equality, llamacpp_weights=llama,
                   logs=str(log_dir))
    name = "vs_vllm" + ("" if args.dtype == "float32" else f"_{args.dtype}") + (
        "" if args.isa == "native" else f"_{args.isa}")
    json_path, _ = write_results(tagged(name, args.tag), rows, settings, notes=notes_text(settings, details),
                                 results_dir=args.results_dir)
    json_path.write_text(json.dumps(dict(json.loads(json_path.read_text()), details=details), indent=2) + "\n")


NOTES = """
servelab against vLLM's CPU build, transformers and llama.cpp on SmolLM2-135M-Instruct in {dtype}: every engine in
its own process, one after another, in the rounds of Settings (each round in the order opposite to the last; every
number is the median over the rounds), with the same number of threads, on the same random token ids and the
same weights (the folder servelab converts from the registry package's GGUF file; llama.cpp reads the same
fp32 numbers as an F32 GGUF file), greedy, EOS ignored. batch-1 decode: n new tokens after a short prompt,
timed as generate(1 + n tokens) minus generate(1 token); offline: all prompts in one generate call
(servelab and vLLM admit all of them at once, max_num_seqs in Settings; transformers runs padded batches of
16; llama.cpp's Python binding has no batched generate); prefill: one long prompt and its first token.
Medians of the repeats in Settings. vLLM: VLLM_CPU_OMP_THREADS_BIND on the first `threads` cores,
VLLM_CPU_NUM_OF_RESERVED_CPU=0, enable_prefix_caching=False, enforce_eager=True (Settings, vllm); it warns
that libtcmalloc and libiomp are not in LD_PRELOAD (its documentation's tuned setup): we run it as a plain
pip install leaves it.
x_vs_vllm: each number over vLLM's. decode/offline/prefill_spread: the slowest timed run over the fastest, every
repeat of every round (decode: the 1 + n-token runs); varies: the ones above 1.2 (issue 34's bar).
greedy_vs_servelab: sequences identical token for token (where the others first differ). offline_useful_gflops: the
offline run's unavoidable FLOPs (every linear layer once per token, the LM head once per generated token, causal
attention) per second of it; offline_x_peak: that over this machine's matmul peak (Settings: matmul_peak_gflops,
oneDNN's packed GEMM of [4096, E] x [2F, E]^T in the run's dtype and threads, measured in the same run);
prefill_useful_gflops and prefill_x_peak: the same for the prefill run (one prompt, the LM head for its last token
only). A target of N x vLLM asks for N x vLLM's share of the peak (the target lines say how much): past 100 %, more
useful work per second than the reference GEMM itself delivers.
"""


def vllm_settings(info: dict | None) -> dict | None:
    """What vLLM ran with: its environment variables and LLM arguments (the folder aside), as it reported them."""
    if not info:
        return None
    args = {k: v for k, v in info["llm_args"].items() if k != "model"}
    return dict(info["env"], **args, max_num_batched_tokens=info.get("max_num_batched_tokens"))


def notes_text(settings: dict, details: dict) -> str:
    """NOTES, then this run's conditions (CPU, flags, threads, load per engine), what was skipped, the targets."""
    from benchmarks._common import describe_machine

    loads = "; ".join(f"{e} {r['load_avg_before']} -> {r['load_avg_after']}" for e, r in details["engines"].items())
    skipped = "".join(f"\n- {LABELS[e]} skipped: {why}" for e, why in details["skipped"].items())
    targets = "\n".join(f"- {v['target']}: servelab {v['servelab']} vs {v['anchor']} {v.get('unit', 'tok/s')}"
                        + (f" = {v['ratio']}x" if v["ratio"] is not None else "") + f": **{v['verdict']}**"
                        + (f" ({v['peak_note']})" if v.get("peak_note") else "")
                        for v in details["targets"])
    return (NOTES.strip().format(dtype=settings["dtype"]) + "\n\n"
            f"Conditions: {describe_machine()['cpu']} (flags: {settings['cpu_flags'] or 'none of interest'}; torch "
            f"CPU capability {settings['torch_cpu_capability']}), {settings['threads']} thread(s) per engine; load "
            f"average (1/5/15 min) before -> after each engine: {loads}. The machine may be shared: compare "
            f"within one run.{' A --quick run: noisy, small sizes.' if settings['quick'] else ''}{skipped}\n\n"
            f"Targets (issue 17):\n{targets}\n")


if __name__ == "__main__":
    main()

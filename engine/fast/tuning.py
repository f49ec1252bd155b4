"""The fast wing's paths chosen by a short measurement on the machine that runs them, once, cached.

Which matmul is fastest for a given number of rows, and how long a prompt the C flash-prefill kernel
should take, depend on the CPU: on one AMD EPYC oneDNN lost 37 % to MKL at 1,024 rows
(benchmarks/results/packed_linear_layouts.md), and bf16 is 3x faster than fp32 on one of this
project's machines and 5x slower on the next. Constants tuned on one CPU are wrong on another, so we
measure instead, the way autotuners do (Triton's `autotune`, oneDNN's own dispatch, ATLAS):

    per linear-layer shape class (K and N rounded up to a power of two), dtype and thread count:
        gemv_rows    the most rows the C matrix-vector kernel takes: the largest of
                     GEMV_ROW_CANDIDATES up to which it beat oneDNN at every candidate measured
                     (the Python layers' matmuls; the C decoder layers keep probes.py's limit:
                     they also save the ~500 torch ops of a step, which this race cannot see)
        gemm         for each row bucket above that, oneDNN's packed GEMM or F.linear (MKL)
    per attention shape class (H, Hkv, D), dtype and thread count:
        c_prefill    the longest prompt the C flash-prefill kernel takes: the largest of
                     PREFILL_LENGTHS up to which it beat torch's fused attention

Each answer is measured once per machine (CPU model + instruction flags + torch version + threads,
and a digest of the raced C kernels' sources: an edited kernel is measured again) and kept as a
small JSON file beside the compiled kernels:

    ~/.cache/servelab/tuning/<machine hash>/machine.json                     what the hash is of
    ~/.cache/servelab/tuning/<machine hash>/linear-float32-K1024xN4096.json  an answer, its times

so the second engine on the same machine reads the answer instead of measuring (a few seconds for
SmolLM2-135M the first time, under one for tinylab). `python -m engine doctor` prints every answer
with its timings; `--retune` (SERVELAB_TUNING=remeasure) measures again. SERVELAB_TUNING=defaults
skips measuring and uses the constants of engine/fast/probes.py (what a machine without a C
compiler gets anyway).

A measured path replaces the default (probes.py's constant) only when it is more than TIE_MARGIN
faster, so noise does not move a path. Whatever is chosen, the numbers are the model's: every
path computes the same product up to float rounding (tests/test_packed_linear.py,
tests/test_tuning.py, and the oracle tests in both speeds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kernels
from engine.threads import torch_threads
from kernels.toolchain import c_flags, cpu_flags, kernel_cache_dir, source_with_headers

logger = logging.getLogger("engine")  # the engine's INFO lines (engine/kv/kv_pool.py's logger)
KERNELS_DIR = Path(kernels.__file__).parent
TUNING_VERSION = 1  # part of the machine hash: bump it when what is measured changes
# "measure" (the default: measure what the cache lacks), "remeasure" (measure everything again and
# overwrite the cache: doctor --retune) or "defaults" (measure nothing: probes.py's constants)
TUNING_ENV = "SERVELAB_TUNING"
TUNING_MODES = ("measure", "remeasure", "defaults")
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"  # oneDNN's own cap on the instructions it uses
# the instruction-set flags that change which path wins (the rest of /proc/cpuinfo does not)
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                     "amx_tile", "amx_bf16", "amx_int8")
# decode rows at which the C kernel and oneDNN are raced (it takes at most 16: GEMV_MAX_ROWS)
GEMV_ROW_CANDIDATES = (1, 2, 4, 8, 12, 16)
# the C kernels the races time (with the headers they include): their digest is a machine fact
RACED_KERNELS = ("gemv/cpu_native.c", "flash_prefill/cpu_native.c")
# (the most rows a bucket holds, the rows it is measured at): rows above gemv_rows fall in the first
# bucket whose bound is >= them; None: no bound
GEMM_BUCKETS = ((64, 32), (256, 128), (1024, 512), (None, 2048))
GEMMS = ("onednn", "linear")  # the GEMMs a bucket may run on
# prompt lengths at which the C flash-prefill kernel and torch's fused attention are raced
PREFILL_LENGTHS = (128, 256, 512, 1024, 2048)
# a measurement bigger than this many FLOPs is skipped (the default path is kept, and says so):
# 8 GFLOP is ~60 ms on 2 cores, a budget of a few seconds for a whole model
PROBE_MAX_FLOP = 8e9
# a measured path replaces the default's only when it is more than this much faster: timings on a
# shared 2-core machine wobble by a few percent, and a coin flip should not move a path
TIE_MARGIN = 0.10
REPEATS = 7  # timed samples per path, in turns with the other paths: the median counts
SAMPLE_MS, MAX_CALLS = 2.0, 200  # a sample repeats a call until it lasts about this long
NO_LIMIT = sys.maxsize  # a prefill plan that takes prompts of any length


@dataclass(frozen=True)
class LinearPlan:
    """How a PackedLinear of one shape class runs: the C kernel up to `gemv_rows` rows, then per row
    bucket (`gemm`: (the most rows, "onednn" | "linear") pairs, the last bound None)."""

    gemv_rows: int
    gemm: tuple[tuple[int | None, str], ...]
    reason: str
    source: str  # "measured", "cache" or "defaults"

    def gemm_path(self, rows: int) -> str:
        """The GEMM that `rows` rows (> gemv_rows) run on."""
        return next(path for bound, path in self.gemm if bound is None or rows <= bound)


@dataclass(frozen=True)
class PrefillPlan:
    """How long a whole prompt the C flash-prefill kernel takes for one attention shape class."""

    max_tokens: int  # 0: never; sys.maxsize: no limit
    reason: str
    source: str


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def remeasure_on_build() -> None:
    """Engines built from now on in this process measure again and overwrite the cache."""
    os.environ[TUNING_ENV] = "remeasure"


def tuning_mode() -> str:
    mode = os.environ.get(TUNING_ENV, "measure")
    if mode not in TUNING_MODES:
        raise ValueError(f"{TUNING_ENV} must be one of {', '.join(TUNING_MODES)}; got {mode!r}")
    return mode


def machine_facts(threads: int) -> dict:
    """What a measurement depends on: the CPU, its flags, torch, the thread count, and any cap on
    the instructions the kernels use."""
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    return {"cpu": model, "flags": sorted(set(FLAGS_OF_INTEREST) & cpu_flags()),
            "torch": torch.__version__, "threads": threads, "tuning_version": TUNING_VERSION,
            # what the code paths were built or capped for (an ISA cap changes who wins)
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_isa": os.environ.get(ONEDNN_ISA_ENV, "native"),
            "c_flags": " ".join(c_flags()), "kernels": raced_kernels_digest()}


def raced_kernels_digest(root: Path = KERNELS_DIR) -> str:
    """A digest of the raced C kernels' sources: a new version of one is a new contestant, whose
    race an old cached answer does not describe."""
    digest = hashlib.sha256()
    for name in RACED_KERNELS:
        digest.update(source_with_headers(root / name))
    return digest.hexdigest()[:16]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def race_ms(fns: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, float]:
    """Milliseconds per call of each of `fns` (name -> function): the median of `repeats` samples,
    each enough calls to last SAMPLE_MS (a 10-microsecond matmul timed once is mostly timer
    noise), after one warm-up call each. The samples alternate between the paths, in turns
    (A B, then B A), so a slow phase of a shared machine falls on all of them alike."""
    calls = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        took = max(time.perf_counter() - start, 1e-7)
        calls[name] = max(1, min(MAX_CALLS, int(SAMPLE_MS / 1e3 / took)))
    samples = {name: [] for name in fns}
    order = list(fns)
    for _ in range(repeats):
        for name in order:
            fn, n = fns[name], calls[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - start) / n)
        order.reverse()
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


class Tuning:
    """This machine's measured choices for one thread count: read from the cache folder, measured
    where missing (and then written there). One per engine; engine/fast/__init__.py makes it."""

    def __init__(self, threads: int, root: Path | None = None, mode: str | None = None):
        self.threads, self.mode = threads, mode or tuning_mode()
        self.facts = machine_facts(threads)
        digest = hashlib.sha256(json.dumps(self.facts, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = (root or kernel_cache_dir().parent / "tuning") / digest
        self.answers: dict[str, LinearPlan | PrefillPlan] = {}  # name -> answer, this engine's

    # ---- the cache ------------------------------------------------------------------------------
    def _read(self, name: str, kind):
        """The cached answer `name` as a `kind`, or None where there is none or it is unreadable
        (a file edited by hand, half a disk: then it is measured again and rewritten)."""
        path = self.folder / f"{name}.json"
        try:
            return kind(**dict(json.loads(path.read_text())["answer"], source="cache"))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write(self, name: str, answer: dict) -> None:
        """One file per answer, written whole, then renamed: parallel engines never see half a
        file."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            machine = self.folder / "machine.json"
            if not machine.exists():
                machine.write_text(json.dumps(self.facts, indent=1) + "\n")
            tmp = self.folder / f"{name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(answer, indent=1) + "\n")
            os.replace(tmp, self.folder / f"{name}.json")
        except OSError:
            pass  # a read-only home: the answer still holds for this process

    def _answer(self, name: str, kind, defaults, measure):
        """The cached answer `name`, else `measure()`'s (then cached), else `defaults()`'s."""
        if name in self.answers:
            return self.answers[name]
        if self.mode == "defaults":
            answer = defaults()
        elif self.mode == "measure" and (saved := self._read(name, kind)) is not None:
            answer = saved
        else:
            logger.info("measuring %s on this machine (once: kept in %s)", name, self.folder)
            with torch_threads(self.threads):  # measured as the engine will run it
                answer = measure()
            record = asdict(answer)
            record.pop("source")
            self._write(name, {"answer": record, "machine": self.facts})
        self.answers[name] = answer
        return answer

    # ---- the questions --------------------------------------------------------------------------
    def linear(self, dtype: torch.dtype, N: int, K: int, paths: dict[str, Callable],
               default: LinearPlan) -> LinearPlan:
        """The plan for a linear layer of shape [N, K] in `dtype`: `paths` maps "gemv", "onednn" and
        "linear" to functions x [M, K] -> y (the module's own, any may be missing)."""
        name = f"linear-{str(dtype).removeprefix('torch.')}-K{pow2(K)}xN{pow2(N)}"
        return self._answer(name, _linear_plan, lambda: default,
                            lambda: measure_linear(dtype, N, K, paths, default))

    def c_prefill(self, dtype: torch.dtype, H: int, Hkv: int, D: int,
                  race: Callable[[int], tuple[float, float]] | None,
                  default: PrefillPlan) -> PrefillPlan:
        """The plan for whole prompts of `H` query and `Hkv` KV heads of `D` in `dtype`: `race(T)`
        gives (C ms, torch ms) for a T-token prompt; None where the C kernel cannot run."""
        if race is None:
            return default
        name = f"prefill-{str(dtype).removeprefix('torch.')}-H{H}-Hkv{Hkv}-D{D}"
        return self._answer(name, PrefillPlan, lambda: default,
                            lambda: measure_prefill(H, D, race, default))

    def summary(self) -> dict[str, tuple[str, str]]:
        """Every answer this engine used: name -> (the choice, where it came from and why)."""
        out = {}
        for name, a in sorted(self.answers.items()):
            if isinstance(a, LinearPlan):
                paths = {p for _, p in a.gemm}
                gemm = (f"then {paths.pop()}" if len(paths) == 1 else ", ".join(
                    f"up to {b} rows {p}" if b else f"more {p}" for b, p in a.gemm))
                what = f"C gemv up to {a.gemv_rows} rows; {gemm}"
            elif a.max_tokens == 0:
                what = "C flash prefill never: torch's fused attention for every prompt"
            else:
                what = f"C flash prefill up to {_tokens(a.max_tokens)}"
            out[name] = (what, f"{a.source}: {a.reason}")
        return out


def _linear_plan(gemv_rows, gemm, reason, source) -> LinearPlan:
    """A LinearPlan read back from JSON; ValueError unless it is one `measure_linear` could write
    (the cache then measures again)."""
    gemm = tuple((b, p) for b, p in gemm)
    if (not isinstance(gemv_rows, int) or not 0 <= gemv_rows <= max(GEMV_ROW_CANDIDATES)
            or not gemm or gemm[-1][0] is not None or any(p not in GEMMS for _, p in gemm)):
        raise ValueError(f"not a linear plan: gemv_rows={gemv_rows!r}, gemm={gemm!r}")
    return LinearPlan(gemv_rows, gemm, reason, source)


def _tokens(n: int) -> str:
    return "any length" if n >= NO_LIMIT else f"{n} tokens"


def pick(default: str, ms: dict[str, float]) -> str:
    """`default` unless another path of `ms` (name -> milliseconds) is more than TIE_MARGIN
    faster."""
    best = min(ms, key=ms.get)
    return best if ms[best] < (1 - TIE_MARGIN) * ms[default] else default


def race(paths: dict[str, Callable], names: tuple[str, ...], x) -> dict[str, float]:
    """Milliseconds of each named path on the same rows x, raced in turns (`race_ms`)."""
    return race_ms({name: (lambda f=paths[name]: f(x)) for name in names})


def measure_linear(dtype, N: int, K: int, paths: dict[str, Callable],
                   default: LinearPlan) -> LinearPlan:
    """Race the paths that exist on random rows of `dtype`: C gemv against oneDNN at each of
    GEMV_ROW_CANDIDATES (the C kernel keeps rows while it wins), then oneDNN against F.linear at
    each bucket's rows."""
    gen = torch.Generator().manual_seed(0)
    notes, gemv_rows = [], 0

    def rows(m):
        return torch.randn(m, K, generator=gen).to(dtype)
    if "gemv" in paths and "onednn" in paths:
        for m in GEMV_ROW_CANDIDATES:
            x = rows(m)
            ms = race(paths, ("gemv", "onednn"), x)
            won = pick("gemv" if m <= default.gemv_rows else "onednn", ms) == "gemv"
            notes.append(f"{m} rows C {ms['gemv']:.3f} / oneDNN {ms['onednn']:.3f} ms")
            if not won:
                break
            gemv_rows = m
    else:
        gemv_rows = default.gemv_rows
    gemm = []
    for bound, m in GEMM_BUCKETS:
        path = default.gemm_path(m)
        if {"onednn", "linear"} <= paths.keys() and 2 * m * K * N <= PROBE_MAX_FLOP:
            x = rows(m)
            ms = race(paths, ("onednn", "linear"), x)
            path = pick(path, ms)
            notes.append(f"{m} rows oneDNN {ms['onednn']:.2f} / MKL {ms['linear']:.2f} ms")
        gemm.append((bound, path))
    return LinearPlan(gemv_rows, tuple(gemm), f"[{N}, {K}]: " + "; ".join(notes), "measured")


def measure_prefill(H: int, D: int, race: Callable[[int], tuple[float, float]],
                    default: PrefillPlan) -> PrefillPlan:
    """The longest of PREFILL_LENGTHS up to which the C kernel won every race; past the last one
    raced (the FLOP budget), the default's limit if that is longer; no limit where it won them
    all."""
    longest, notes = 0, []
    for T in PREFILL_LENGTHS:
        if 2 * H * D * T * T > PROBE_MAX_FLOP:  # QK^T and PV over the causal half: 4 H D T^2 / 2
            notes.append(f"{T} tokens and more not raced (the probe's FLOP budget)")
            return PrefillPlan(max(longest, default.max_tokens), "; ".join(notes), "measured")
        ms = dict(zip(("c", "torch"), race(T), strict=True))
        notes.append(f"{T} tokens C {ms['c']:.2f} / torch {ms['torch']:.2f} ms")
        if pick("c" if T <= default.max_tokens else "torch", ms) != "c":
            return PrefillPlan(longest, "; ".join(notes), "measured")
        longest = T
    return PrefillPlan(NO_LIMIT, "; ".join(notes), "measured")


__all__ = ["LinearPlan", "PrefillPlan", "TUNING_ENV", "Tuning", "machine_facts",
           "remeasure_on_build", "tuning_mode"]

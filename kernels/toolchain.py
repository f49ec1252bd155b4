"""What a kernel backend needs from the machine, asked in one place: Triton, a CUDA GPU, nvcc, a C
compiler.

Every kernel folder (`paged_attention/`, `flash_prefill/`, `quant_matmul/`) picks a backend by name
and falls back to its PyTorch reference with a warning that says why the chosen one cannot run; the
reasons, and the nvcc call that reports a kernel's registers and spills, live here so that they are
written once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

NVCC_TIMEOUT_S = 300  # a cold nvcc on a slow laptop; it usually takes a couple of seconds
CC_TIMEOUT_S = 120  # a C kernel compiles in about a second
C_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11")
# added where torch reports the CPU can run AVX2 (torch.backends.cpu)
AVX2_FLAGS = ("-mavx2", "-mfma")
# AVX-512 VNNI's one-instruction byte dot product (vpdpbusd) on 256-bit registers, where
# /proc/cpuinfo lists every one of these flags (AMD Zen 4, Intel Ice Lake and later); the compiler
# flags that enable it:
VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
VNNI_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
# a header of ours, e.g. "../cpu_vectors.h"
LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)
CACHE_ENV = "SERVELAB_CACHE"  # where compiled C kernels are kept (default ~/.cache/servelab)
# "avx2": build the C kernels for AVX2 + FMA at most, even where the CPU has AVX-512 (an AVX2-only
# CPU's code paths on a newer one: benchmarks/repeatability.py --isa avx2); "native": all it has
ISA_ENV, ISA_CHOICES = "SERVELAB_MAX_ISA", ("native", "avx2")


def why_triton_cannot_run(device, triton_module: str) -> str | None:
    """None if the Triton kernels of `triton_module` (e.g. "kernels.paged_attention.triton") can run
    on tensors on `device`, else the reason. On a CPU they run only in Triton's interpreter
    (TRITON_INTERPRET=1)."""
    try:
        module = importlib.import_module(triton_module)
    except (ImportError, RuntimeError) as err:  # triton not installed, or broken
        return f"Triton could not be imported ({err})"
    if device.type == "cpu" and not module.runs_on_cpu():
        return "tensors are on the CPU and Triton was imported without TRITON_INTERPRET=1"
    return None


def why_cuda_cannot_run(device) -> str | None:
    """None if a CUDA kernel can run on tensors on `device`, else the reason."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if device.type != "cuda":
        return f"tensors are on {device}, not on a CUDA device"
    return None


def ptxas_lines(cu_file: Path, arch: str) -> list[str]:
    """Compile `cu_file` for `arch` with ``nvcc -cubin -Xptxas -v`` (no GPU needed) and return
    ptxas's lines: registers, spills and barriers of every kernel. Raises RuntimeError when nvcc is
    missing or fails."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH: install the CUDA toolkit to get a resource report")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-O3", "-Xptxas", "-v",
               "-o", str(Path(tmp) / f"{Path(cu_file).stem}.cubin"), str(cu_file)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}")
    return [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines()
            if "ptxas info" in ln or "stack frame" in ln]


def demangle(text: str) -> str:
    """C++ kernel names made readable with c++filt (or cu++filt) where one exists; the text as it is
    otherwise."""
    cxxfilt = shutil.which("c++filt") or shutil.which("cu++filt")
    if cxxfilt is None:
        return text
    proc = subprocess.run([cxxfilt], input=text, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else text


def chosen_backend(backend: str, backends: tuple, device, triton_module: str, what: str) -> str:
    """The backend that will really run for tensors on `device`: `backend` itself, or "torch" with a
    RuntimeWarning that says why (`what` names the op in the message). Unknown names are a
    ValueError."""
    import warnings

    if backend not in backends:
        raise ValueError(f"backend: {backend!r} is not one of {backends}")
    why = None
    if backend == "triton":
        why = why_triton_cannot_run(device, triton_module)
    elif backend == "cuda":
        why = why_cuda_cannot_run(device)
    if why is None:
        return backend
    warnings.warn(f"{what} backend {backend!r} cannot run here: {why}; using 'torch' instead",
                  RuntimeWarning, stacklevel=4)
    return "torch"


def build_cuda_extension(name: str, cu_file: Path, what: str):
    """Compile `cu_file` into a PyTorch extension (or load it from torch's build cache): needs a
    CUDA GPU, a CUDA build of torch, nvcc and ninja. Callers cache the module (`functools.cache`),
    so it compiles once per process."""
    import torch
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        raise RuntimeError(f"the CUDA {what} needs a CUDA GPU and a CUDA build of torch")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("torch.utils.cpp_extension needs ninja to build the kernel: "
                           "pip install ninja")
    return cpp_extension.load(name=name, sources=[str(cu_file)],
                              extra_cuda_cflags=["-O3", "-DSERVELAB_TORCH_EXTENSION"],
                              verbose=False)


# ---- C kernels for the CPU -----------------------------------------------------------------------


def c_compiler() -> str | None:
    """The C compiler to use: $CC, else cc or gcc on PATH (None if there is none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def c_flags() -> tuple[str, ...]:
    """Flags for this machine: AVX2 and FMA where torch says the CPU has them (and AVX-512 VNNI
    where the CPU lists it, unless SERVELAB_MAX_ISA=avx2), plain C otherwise. The flags are part of
    the compiled library's cache key, so a cache folder that moves to another CPU never hands it a
    library built for instructions it lacks."""
    import torch

    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_CHOICES)}; got {isa!r}")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return C_FLAGS
    vnni = isa == "native" and set(VNNI_CPU_FLAGS) <= cpu_flags()
    return C_FLAGS + AVX2_FLAGS + (VNNI_FLAGS if vnni else ())


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "servelab") / "kernels"


def why_cannot_load(load) -> str | None:
    """None if `load()` (a kernel module's compile-and-load function) succeeds, else the first line
    of why not: no compiler, a failed compile, a library the loader refuses."""
    try:
        load()
    except (RuntimeError, OSError, FileNotFoundError, TimeoutError) as err:
        return str(err).splitlines()[0]
    return None


def cached_library(load_library):
    """(library, why_library_cannot_load) for a kernel module whose `load_library(flags=None)`
    compiles and loads its C file: `library()` is that library with this machine's flags, built once
    per process; `why_library_cannot_load()` is None where it builds and loads, else the reason
    (asked once)."""
    library = functools.cache(lambda: load_library())
    return library, functools.cache(lambda: why_cannot_load(library))


def source_with_headers(c_file: Path) -> bytes:
    """The C file's text followed by that of every header of ours it includes ("...", beside it):
    what the compiled library's cache key hashes, so that editing a shared header rebuilds every
    kernel that uses it."""
    source = Path(c_file).read_bytes()
    return source + b"".join((Path(c_file).parent / name.decode()).read_bytes()
                             for name in LOCAL_INCLUDE.findall(source))


def build_c_library(c_file: Path, what: str, flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile `c_file` into a shared library (once per source, flags and compiler: the result is
    cached on disk) and load it with ctypes. torch must be imported first so that the library's
    OpenMP is torch's own. `flags` None: `c_flags()`. Raises RuntimeError with the reason when there
    is no compiler or it fails."""
    cc = c_compiler()
    if cc is None:
        raise RuntimeError(f"the C {what} needs a C compiler (cc or gcc on PATH, or $CC)")
    source = source_with_headers(c_file)
    flags = c_flags() if flags is None else tuple(flags)
    key = hashlib.sha256(source + " ".join((cc, *flags)).encode()).hexdigest()[:16]
    out = kernel_cache_dir() / f"{Path(c_file).stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        # then renamed: parallel test workers never see half a file
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, *flags, "-o", str(tmp), str(c_file)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling the C {what} took over {CC_TIMEOUT_S} s "
                               f"({' '.join(cmd)})") from None
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling the C {what} failed ({' '.join(cmd)}):\n{proc.stderr}")
        os.replace(tmp, out)
    return ctypes.CDLL(str(out))

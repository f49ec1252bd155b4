"""Shared pytest setup: Triton runs in its CPU interpreter when there is no GPU, and tests that need
hardware or tools this machine lacks are skipped with a reason (never silently passed)."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before anything imports triton: kernels then run in Triton's interpreter on CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SERVELAB_FAST", "1")
# The fast wing's measured choices (engine/fast/tuning.py) depend on how busy the machine is when it
# measures: tests that check which path a step takes would pass or fail with the noise. They run on
# probes.py's constants; tests/test_tuning.py measures (in its own cache folder) and plants answers.
os.environ.setdefault("SERVELAB_TUNING", "defaults")
sys.path.insert(0, str(Path(__file__).parent))  # so tests can import their helpers (hf_oracle, ...)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny matmuls run faster on one thread, and two threads per worker oversubscribe a 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """The C kernels share torch's OpenMP pool: a test taking this fixture runs with one and with two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=["plain C", "AVX2"])
def other_build(request, monkeypatch, tmp_path):
    """A C kernel build this CPU would not pick by itself (the plain-C loops, or AVX2's 8 lanes where the CPU has
    AVX-512), compiled here on purpose into a scratch cache: ``other_build(module)`` makes that kernel module
    (kernels/<op>/cpu_native.py) run it for the rest of the test, and returns the library."""
    from kernels import toolchain

    if request.param == "AVX2" and "avx2" not in toolchain.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    flags = toolchain.C_FLAGS + (toolchain.AVX2_FLAGS if request.param == "AVX2" else ())
    monkeypatch.setenv(toolchain.CACHE_ENV, str(tmp_path))

    def use(module):
        lib = module.load_library(flags=flags)
        monkeypatch.setattr(module, "_library", lambda: lib)
        return lib
    use.name = request.param
    return use


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    no_nvcc = pytest.mark.skip(reason="needs the CUDA compiler nvcc on PATH")
    have_gpu, have_nvcc = torch.cuda.is_available(), shutil.which("nvcc") is not None
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(no_gpu)
        if "nvcc" in item.keywords and not have_nvcc:
            item.add_marker(no_nvcc)

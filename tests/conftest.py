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


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    no_nvcc = pytest.mark.skip(reason="needs the CUDA compiler nvcc on PATH")
    have_gpu, have_nvcc = torch.cuda.is_available(), shutil.which("nvcc") is not None
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(no_gpu)
        if "nvcc" in item.keywords and not have_nvcc:
            item.add_marker(no_nvcc)

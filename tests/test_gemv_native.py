"""kernels/gemv: the C matrix-vector product equals its reference (kernels/gemv/reference.py, the
exact sum of the fp32 products) for fp32 and bf16 weights, 1 to 16 rows (blocks of four and what
is left), K and N that are not multiples of the vector width or of the four rows per pass, with
and without bias, one and two threads, in every build (this machine's, AVX2 only, plain C)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import toolchain
from kernels.gemv import cpu_native
from kernels.gemv.cpu_native import gemv_native, why_gemv_cannot_run
from kernels.gemv.reference import gemv_ref

pytestmark = pytest.mark.skipif(cpu_native.why_library_cannot_load() is not None,
                                reason=f"the C kernel cannot be built here: {cpu_native.why_library_cannot_load()}")

# C against the exact sum (fp64, rounded once): the kernel's fp32 sums in their own order, by
# weight dtype. A bf16 weight is widened exactly, so both dtypes share one arithmetic and one bound.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=1e-4, rtol=1e-5)}


def oracle(x, w, b):
    """The exact y = x W^T + b of the kernel's fp32 inputs (kernels/gemv/reference.py)."""
    return gemv_ref(x, w, b, accumulate=torch.float64)


def assert_matches(got, x, w, b, what=""):
    want = oracle(x, w, b)
    torch.testing.assert_close(got, want, **TOLERANCE[w.dtype], msg=lambda m: (
        f"gemv {what} {w.dtype}: x {tuple(x.shape)} @ W {tuple(w.shape)}^T, bias {b is not None}"
        f": {m}"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 11, 16])
@pytest.mark.parametrize("n,k", [(4, 16), (13, 40), (1536, 576), (7, 3), (3, 33)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_equals_linear(dtype, m, n, k, bias, threads):
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gemv_native(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert_matches(got, x, w, b, f"{threads} thread(s)")


def test_a_row_sums_alike_whatever_rides_along_with_it():
    """Row m's output does not depend on how many other rows share its block of four: the same bits at M = 1 and as
    row 5 of 16 (each output is one dot product, summed in one order)."""
    w, x = torch.randn(1000, 576).bfloat16(), torch.randn(16, 576)
    assert torch.equal(gemv_native(x[5:6].contiguous(), w), gemv_native(x, w)[5:6])


def test_the_thread_count_does_not_change_a_bit():
    w, x = torch.randn(1000, 576), torch.randn(7, 576)
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(gemv_native(x, w))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*outs)


def test_the_other_builds_equal_linear_too(other_build):
    """The AVX2 loop (8 lanes) that CPUs without AVX-512 run, and the plain-C loop, built here on purpose."""
    other_build(cpu_native)
    for dtype in (torch.float32, torch.bfloat16):
        w, x, b = torch.randn(13, 45).to(dtype), torch.randn(6, 45), torch.randn(13)
        assert_matches(gemv_native(x, w, b), x, w, b, other_build.name)


def test_bad_rows_and_weights_are_named():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"x: expected fp32 contiguous \[1..16, 16\]"):
        gemv_native(torch.randn(17, 16), w)
    with pytest.raises(ValueError, match="x: expected"):
        gemv_native(torch.randn(1, 15), w)
    assert "fp32 and bf16" in why_gemv_cannot_run(w.half())
    assert "contiguous" in why_gemv_cannot_run(w.t())
    assert why_gemv_cannot_run(w) is None


def test_editing_a_shared_header_rebuilds_the_kernels_that_include_it(monkeypatch, tmp_path):
    """The compiled library's cache key covers the headers a C file includes ("../cpu_vectors.h" for the kernels):
    a stale library built from the old header would otherwise be loaded again."""
    monkeypatch.setenv(toolchain.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "k").mkdir()
    (tmp_path / "shared.h").write_text("#define ANSWER 41\n")
    c_file = tmp_path / "k" / "kernel.c"
    c_file.write_text('#include "../shared.h"\nint answer(void) { return ANSWER; }\n')
    assert toolchain.build_c_library(c_file, "test kernel", toolchain.C_FLAGS).answer() == 41
    (tmp_path / "shared.h").write_text("#define ANSWER 42\n")
    assert toolchain.build_c_library(c_file, "test kernel", toolchain.C_FLAGS).answer() == 42


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_linear_on_the_widened_weight(dtype):
    """gemv_ref in fp32 is F.linear on the fp32 copy of the weight, bit for bit; summed in fp64, it
    is within fp32 rounding of that."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(13, 45, generator=g).to(dtype)
    x, b = torch.randn(3, 45, generator=g), torch.randn(13, generator=g)
    assert torch.equal(gemv_ref(x, w, b), F.linear(x, w.float(), b))
    exact = gemv_ref(x, w, b, accumulate=torch.float64)
    torch.testing.assert_close(exact, F.linear(x, w.float(), b))


def test_the_reference_names_a_bad_input():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"^x: expected fp32 \[M >= 1, K = 16\]"):
        gemv_ref(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="^x: expected fp32"):
        gemv_ref(torch.randn(2, 16).bfloat16(), w)
    with pytest.raises(ValueError, match="^weight: expected fp32 or bf16"):
        gemv_ref(torch.randn(2, 16), w.half())
    with pytest.raises(ValueError, match=r"^bias: expected None or fp32 \[N = 8\]"):
        gemv_ref(torch.randn(2, 16), w, torch.randn(9))


def test_an_isa_cap_drops_the_avx512_flags_and_a_bad_cap_is_named(monkeypatch):
    """SERVELAB_MAX_ISA=avx2 builds an AVX2-only CPU's code paths (benchmarks/repeatability.py --isa avx2)."""
    monkeypatch.setenv("SERVELAB_MAX_ISA", "avx2")
    assert not any(flag.startswith("-mavx512") for flag in toolchain.c_flags())
    monkeypatch.setenv("SERVELAB_MAX_ISA", "native")
    native = toolchain.c_flags()
    assert all(f in native for f in toolchain.C_FLAGS)
    monkeypatch.setenv("SERVELAB_MAX_ISA", "avx9")
    with pytest.raises(ValueError, match="SERVELAB_MAX_ISA must be one of native, avx2; got 'avx9'"):
        toolchain.c_flags()

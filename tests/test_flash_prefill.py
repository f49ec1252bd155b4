"""Flash prefill attention: the tiled reference against the naive oracle and against PyTorch's own
causal SDPA, every kernel against the reference, bad input, backend choice, and the CUDA file.

Without a GPU the Triton kernel runs in Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1), so its shapes here are small and fp32 mostly.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from kernels.flash_prefill import flash_prefill_attention, resolve_backend
from kernels.flash_prefill import triton as triton_backend
from kernels.flash_prefill.cuda import nvcc_resource_report
from kernels.flash_prefill.reference import causal_attention_naive, flash_attention_ref
from kernels.paged_attention.cuda import registers_per_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs compiled on a GPU, interpreted on CPU
TOLERANCE = {  # accumulation is fp32 everywhere; the storage type (output rounding) sets the error
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = list(TOLERANCE)
LENGTHS = [1, 7, 64, 100]  # one token, less than a tile, tiles that divide T, tiles that do not
GQA = [(4, 4), (4, 2), (4, 1)]  # (H, Hkv): multi-head, groups of 2, multi-query
TILES = [(16, 16), (16, 32), (32, 16), (64, 64)]  # 64 divides 64 but not 100; 32 x 16: BQ > BK


def assert_close(actual, expected, dtype, what=""):
    """Compare in fp32 with ``dtype``'s tolerance; print the max error so a failure shows its size."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    assert not actual.isnan().any(), f"{what}: NaN in the output"
    err = (actual - expected).abs().max().item()
    print(f"{what} {dtype}: max abs error {err:.3g} (atol {TOLERANCE[dtype]['atol']})")
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype], msg=lambda m: f"{what}: max err {err}\n{m}")


def make_qkv(num_tokens, num_heads, num_kv_heads, head_dim=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    return dict(q=q.to(dtype=dtype, device=device), k=k.to(dtype=dtype, device=device),
                v=v.to(dtype=dtype, device=device), scale=1.0 / math.sqrt(head_dim))


def sdpa_causal(q, k, v, scale):
    """PyTorch's causal SDPA in fp32 with K/V repeated for GQA: an oracle we did not write."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [H, T, D]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, scale=scale, is_causal=True)
    return out.transpose(0, 1)  # [T, H, D]


# ---- the tiled reference against two oracles --------------------------------------------------


@pytest.mark.parametrize("block_q,block_k", TILES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_tokens", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_reference_equals_naive_and_torch_sdpa(dtype, num_tokens, num_heads, num_kv_heads,
                                                     block_q, block_k):
    inputs = make_qkv(num_tokens, num_heads, num_kv_heads, dtype=dtype)
    out = flash_attention_ref(**inputs, block_q=block_q, block_k=block_k)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert_close(out, causal_attention_naive(**inputs), dtype, "tiled vs naive")
    assert_close(out, sdpa_causal(**inputs), dtype, "tiled vs SDPA")


def test_naive_oracle_equals_torch_sdpa_with_an_odd_head_dim():
    inputs = make_qkv(33, 6, 2, head_dim=24)
    assert_close(causal_attention_naive(**inputs), sdpa_causal(**inputs), torch.float32, "naive vs SDPA")


def test_first_token_attends_only_to_itself():
    inputs = make_qkv(5, 4, 2)
    out = flash_attention_ref(**inputs, block_q=2, block_k=2)
    assert torch.allclose(out[0], inputs["v"][0].repeat_interleave(2, dim=0))  # softmax of one score is 1


def test_query_tile_never_reads_key_tiles_above_the_diagonal():
    inputs = make_qkv(48, 4, 2)
    clean = flash_attention_ref(**inputs, block_q=16, block_k=16)
    for name in ("k", "v"):
        inputs[name][16:] = float("nan")  # the future of the first query tile
    poisoned = flash_attention_ref(**inputs, block_q=16, block_k=16)
    assert torch.equal(poisoned[:16], clean[:16])  # a masked-but-read NaN would give NaN (0 * NaN)


# ---- Triton against the reference -------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_tokens", LENGTHS)
def test_triton_matches_reference_across_lengths_and_gqa(num_tokens, num_heads, num_kv_heads):
    inputs = make_qkv(num_tokens, num_heads, num_kv_heads, device=DEVICE, seed=1)
    out = triton_backend.flash_attention_triton(**inputs, block_q=16, block_k=32)
    assert_close(out, flash_attention_ref(**inputs), torch.float32, "triton")


@pytest.mark.parametrize("block_q,block_k", [(16, 16), (32, 16), (64, 64)])
def test_triton_matches_reference_for_tiles_that_do_and_do_not_divide_t(block_q, block_k):
    inputs = make_qkv(100, 4, 2, device=DEVICE, seed=2)
    out = triton_backend.flash_attention_triton(**inputs, block_q=block_q, block_k=block_k)
    assert_close(out, causal_attention_naive(**inputs), torch.float32, "triton")


def test_triton_handles_a_head_dim_that_is_not_a_power_of_two():
    inputs = make_qkv(21, 6, 2, head_dim=24, device=DEVICE, seed=3)
    assert_close(triton_backend.flash_attention_triton(**inputs, block_q=16, block_k=16),
                 causal_attention_naive(**inputs), torch.float32, "triton D=24")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_matches_reference_in_16_bit(dtype):
    inputs = make_qkv(37, 4, 2, dtype=dtype, device=DEVICE, seed=4)
    assert_close(triton_backend.flash_attention_triton(**inputs, block_q=16, block_k=16),
                 causal_attention_naive(**inputs), dtype, "triton")


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # later query tiles do read the NaN keys: they see them
def test_triton_query_tile_never_reads_key_tiles_above_the_diagonal():
    inputs = make_qkv(48, 4, 2, device=DEVICE)
    clean = triton_backend.flash_attention_triton(**inputs, block_q=16, block_k=16)
    for name in ("k", "v"):
        inputs[name][16:] = float("nan")
    poisoned = triton_backend.flash_attention_triton(**inputs, block_q=16, block_k=16)
    assert torch.equal(poisoned[:16], clean[:16])


# ---- bad input is a ValueError naming the field, before any kernel runs -----------------------

RUNNERS = {"naive": causal_attention_naive, "torch": flash_attention_ref,
           "triton": triton_backend.flash_attention_triton}


def _break(inputs, how):
    if how == "q 2-D":
        inputs["q"] = inputs["q"][0]
    elif how == "k other T":
        inputs["k"] = inputs["k"][:3]
    elif how == "v other shape":
        inputs["v"] = inputs["v"][:, :1]
    elif how == "H not a multiple of Hkv":
        inputs["q"] = inputs["q"][:, :3]
    elif how == "float64 q":
        inputs["q"] = inputs["q"].double()
    elif how == "k dtype":
        inputs["k"] = inputs["k"].half()
    elif how == "scale 0":
        inputs["scale"] = 0.0
    elif how == "scale nan":
        inputs["scale"] = float("nan")


BAD_INPUTS = {  # what we break -> what the message must say
    "q 2-D": r"q: expected \[T, H, D\] with T >= 1 tokens, got shape \(4, 8\)",
    "k other T": r"k: expected \[T, Hkv, D\] = \[5, Hkv, 8\]",
    "v other shape": r"v: shape \(5, 1, 8\) must equal k's \(5, 2, 8\)",
    "H not a multiple of Hkv": r"k: Hkv = 2 KV heads must divide H = 3",
    "float64 q": r"q: dtype torch.float64 is not one of",
    "k dtype": r"k: torch.float16 on cpu must match q's torch.float32",
    "scale 0": r"scale: must be a finite float > 0 .*got 0.0",
    "scale nan": r"scale: must be a finite float > 0 .*got nan",
}


@pytest.mark.parametrize("backend", sorted(RUNNERS))
@pytest.mark.parametrize("how", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_the_field(backend, how):
    inputs = make_qkv(5, 4, 2, head_dim=8)
    RUNNERS[backend](**inputs)  # the clean version runs
    _break(inputs, how)
    with pytest.raises(ValueError, match=BAD_INPUTS[how]):
        RUNNERS[backend](**inputs)


def test_bad_tile_sizes_raise_value_error_naming_the_field():
    inputs = make_qkv(5, 4, 2, head_dim=8)
    with pytest.raises(ValueError, match=r"block_k: must be an integer >= 1 .*got 0"):
        flash_attention_ref(**inputs, block_k=0)
    with pytest.raises(ValueError, match=r"block_q: must be a power of two >= 16 .*got 24"):
        triton_backend.flash_attention_triton(**inputs, block_q=24)


# ---- choosing a backend -----------------------------------------------------------------------


def test_cuda_backend_on_cpu_tensors_falls_back_to_torch_with_a_warning():
    inputs = make_qkv(9, 4, 2)
    with pytest.warns(RuntimeWarning, match="backend 'cuda' cannot run here"):
        out = flash_prefill_attention(**inputs, backend="cuda")
    assert torch.equal(out, flash_attention_ref(**inputs))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton runs compiled, not interpreted")
def test_triton_and_naive_backends_run_on_cpu():
    inputs = make_qkv(9, 4, 2)
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    assert_close(flash_prefill_attention(**inputs, backend="triton"), flash_attention_ref(**inputs),
                 torch.float32, "backend triton")
    assert torch.equal(flash_prefill_attention(**inputs, backend="naive"), causal_attention_naive(**inputs))


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="backend: 'paged' is not one of"):
        flash_prefill_attention(**make_qkv(3, 4, 2), backend="paged")


def test_prefill_traffic_matches_the_worked_example_in_the_docstring():
    mib = 2**20
    traffic = triton_backend.prefill_traffic_bytes(4096, 32, 8, 128, elem_bytes=2, block_q=64, block_k=64)
    # By hand: U = 4096 * 128 * 2 B = 1 MiB; scores = 32 * 4096^2 * 4 B = 2048 MiB, 4 passes;
    # naive = 4 * 32 U + 4 * 2048 MiB = 8320 MiB. Fused: q + out = 64 MiB; query tile i (1..64) reads
    # 64 i keys of K and V: 32 heads * 2 * (64 * 2080 keys) * 256 B = 2080 MiB.
    assert traffic == {"naive": 8320 * mib, "fused": 2144 * mib}


# ---- CUDA: compiled wherever nvcc exists, run wherever a GPU exists ---------------------------


@pytest.mark.nvcc
def test_cuda_kernel_compiles_without_spills_and_reports_registers():
    report = nvcc_resource_report(arch="sm_90")
    counts = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert len(counts) == 3, report  # float, half, bfloat16 instantiations
    assert all(1 <= n <= 255 for n in counts), report  # 255: the most a thread can address
    assert "0 bytes spill stores" in report and not re.search(r"[1-9]\d* bytes spill", report), report
    kernels = registers_per_kernel(report)
    assert sorted(kernels.values()) == sorted(counts)
    assert any("__half" in name for name in kernels) and any("bfloat16" in name for name in kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim",
                         [(1, 4, 4, 64), (100, 8, 2, 128), (515, 4, 1, 96), (77, 4, 2, 256)])
def test_cuda_matches_reference_on_gpu(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    from kernels.flash_prefill.cuda import flash_attention_cuda

    inputs = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    assert_close(flash_attention_cuda(**inputs), causal_attention_naive(**inputs), dtype, "cuda")

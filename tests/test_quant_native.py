"""Chapter 07: the "native" backend, our C kernel (kernels/quant_matmul/cpu_native.c).

Its contract: y = quant_matmul_ref(round_activations(x), qw) up to the order of the float additions, for
every granularity, for the fused rows (<= FUSED_MAX_ROWS) and the dequantize-then-GEMM rows alike, in the
AVX2 build and in the plain-C build. The rounding of x is held to its own PyTorch oracle, and the whole
thing to the unrounded reference within the rounding's documented size. Then: it shares torch's OpenMP
threads, its answer does not depend on the thread count, what it cannot run falls back with the reason,
and a model on it generates the naive loop's tokens through the engine.
"""

import copy
import re
from pathlib import Path

import pytest
import torch

from engine import LLM, load_model
from engine.companions.naive import generate_naive
from engine.loading.quantization import (
    QuantLinear,
    quantize_lm_head,
    quantize_model,
    set_backend,
    weight_bytes_breakdown,
)
from engine.sampling import SamplingParams
from kernels import toolchain
from kernels.quant_matmul import cpu_native, quant_matmul, quant_matmul_ref, quantize

# (bits, group_size, per_tensor), as in test_quant_matmul.py
LAYOUTS = [(8, None, False), (8, None, True), (8, 32, False), (4, 32, False), (4, 64, False),
           (4, None, False), (4, None, True)]
LAYOUT_IDS = ["int8-channel", "int8-tensor", "int8-g32", "int4-g32", "int4-g64", "int4-channel", "int4-tensor"]
ORDER_TOL = 1e-5  # max |diff| / max |ref| against the oracle on the same rounded x: float summation order only
# Against the UNROUNDED reference: each x is off by at most half a step, max|x_block| / 254, so the relative
# error of a sum of K products is about 1/254 / sqrt(3) per term, averaging down; measured below 0.01 here.
ROUNDING_TOL = 0.02

pytestmark = pytest.mark.skipif(cpu_native.why_library_cannot_load() is not None,
                                reason=f"the C kernel cannot be built here: {cpu_native.why_library_cannot_load()}")


def rel_err(actual, expected) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-6)).item()


def make(n, k, m, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g), torch.randn(m, k, generator=g).to(dtype)


# ---- the rounding of x ------------------------------------------------------------------------------


def test_the_c_rounding_equals_the_pytorch_rounding_exactly():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 256)
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, stays 0
    x[3, :32] = 2.5  # ties of the rounding: every element is its block's max
    assert torch.equal(cpu_native.round_activations_native(x), cpu_native.round_activations(x))


def test_rounding_is_off_by_at_most_half_a_step_per_block():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    xr = cpu_native.round_activations(x)
    step = x.reshape(4, -1, 32).abs().amax(-1, keepdim=True) / cpu_native.QX_MAX  # [4, K/32, 1]
    assert ((xr - x).reshape(4, -1, 32).abs() <= step / 2 * (1 + 1e-6)).all()
    assert not torch.equal(xr, x)  # it does round
    assert torch.equal(cpu_native.round_activations(torch.zeros(1, 64)), torch.zeros(1, 64))


def test_rounding_needs_whole_blocks():
    with pytest.raises(ValueError, match=r"x: last dim must be a multiple of 32"):
        cpu_native.round_activations(torch.randn(2, 48))


# ---- the kernel against its oracle ------------------------------------------------------------------


@pytest.mark.parametrize("bits,group_size,per_tensor", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("n,k", [(48, 128), (704, 256), (96, 704)])
@pytest.mark.parametrize("m", [1, 3, cpu_native.FUSED_MAX_ROWS, cpu_native.FUSED_MAX_ROWS + 1, 40])
def test_native_matches_the_reference_on_rounded_activations(bits, group_size, per_tensor, n, k, m):
    w, x = make(n, k, m)
    qw = quantize(w, bits, group_size, per_tensor)
    y = quant_matmul(x, qw, backend="native")
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_err(y, quant_matmul_ref(cpu_native.round_activations(x), qw)) <= ORDER_TOL
    assert rel_err(y, quant_matmul_ref(x, qw)) <= ROUNDING_TOL


@pytest.mark.parametrize("k,group_size", [(96, 32), (96, None), (192, 96), (576, 64), (576, 32)])
def test_int4_pairs_of_blocks_and_the_odd_ones_out_both_match_the_reference(k, group_size):
    """With AVX-512 VNNI, int4 takes two blocks per instruction where the blocks pair up (K / 32 even, groups of
    one block or an even number); 3 blocks, or groups of 3, take the 256-bit loop. Both meet the oracle."""
    w, x = make(52, k, 2)
    qw = quantize(w, 4, group_size)
    y = quant_matmul(x, qw, backend="native")
    assert rel_err(y, quant_matmul_ref(cpu_native.round_activations(x), qw)) <= ORDER_TOL


def test_rounding_is_the_only_difference_from_the_reference():
    """Planted check: the oracle with the rounding left out must be measurably farther than ORDER_TOL,
    or the first assertion above could not catch a kernel that ignored it."""
    w, x = make(256, 512, 2)
    qw = quantize(w, 4, 64)
    assert rel_err(quant_matmul(x, qw, backend="native"), quant_matmul_ref(x, qw)) > 10 * ORDER_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_native_keeps_the_activation_dtype(dtype):
    w, x = make(64, 128, 2, dtype=dtype)
    qw = quantize(w, 4, 32)
    y = quant_matmul(x, qw, backend="native")
    assert y.dtype == dtype
    assert rel_err(y, quant_matmul_ref(cpu_native.round_activations(x.float()), qw)) < 1.5e-2  # y stored in dtype


def test_native_handles_batched_activations_bias_and_a_prepared_weight():
    w, x = make(64, 128, 6)
    qw = quantize(w, 8)
    bias = torch.randn(64)
    x3 = x.reshape(2, 3, 128)
    y = cpu_native.quant_matmul_native(x3, qw, bias, prepared=cpu_native.prepare_native(qw))
    expected = quant_matmul_ref(cpu_native.round_activations(x3), qw, bias)
    assert y.shape == (2, 3, 64) and rel_err(y, expected) <= ORDER_TOL


def test_dequantize_in_c_equals_the_reference_dequantize():
    from kernels.quant_matmul import dequantize

    for bits, g, pt in LAYOUTS:
        qw = quantize(make(48, 128, 1)[0], bits, g, pt)
        assert torch.equal(cpu_native.dequantize_native(cpu_native.prepare_native(qw)), dequantize(qw)), (bits, g, pt)


VNNI_HERE = set(toolchain.VNNI_CPU_FLAGS) <= toolchain.cpu_flags()


@pytest.mark.parametrize("build", [
    "plain C",
    pytest.param("AVX2 without VNNI", marks=pytest.mark.skipif(
        not VNNI_HERE, reason="on a CPU without AVX-512 VNNI the default build is this one, tested above")),
])
def test_the_other_builds_match_the_reference_too(build, monkeypatch, tmp_path):
    """The loops for CPUs without AVX2 (compiled here without -mavx2), and where this CPU has VNNI (the default
    build uses vpdpbusd) the AVX2 instructions that other CPUs run: each meets the same oracle."""
    monkeypatch.setenv(toolchain.CACHE_ENV, str(tmp_path))
    flags = toolchain.C_FLAGS if build == "plain C" else toolchain.C_FLAGS + toolchain.AVX2_FLAGS
    assert "avx512" not in " ".join(flags) and ("avx2" in " ".join(flags)) == (build != "plain C")
    plain = cpu_native.load_library(flags=flags)
    monkeypatch.setattr(cpu_native, "_library", lambda: plain)
    for bits, g, pt in LAYOUTS:
        w, x = make(96, 256, 3, seed=bits)
        qw = quantize(w, bits, g, pt)
        y = cpu_native.quant_matmul_native(x, qw)
        assert rel_err(y, quant_matmul_ref(cpu_native.round_activations(x), qw)) <= ORDER_TOL, (bits, g, pt)


def test_the_answer_does_not_depend_on_the_thread_count():
    """Each output is summed by one thread in one order: 1 and 2 threads give the same bits."""
    w, x = make(512, 576, 2)
    qw = quantize(w, 4, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_matmul(x, qw, backend="native")
        torch.set_num_threads(2)
        two = quant_matmul(x, qw, backend="native")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_the_kernel_shares_torchs_openmp_runtime():
    """Two OpenMP runtimes in one process would keep two pools of spinning threads on two cores."""
    cpu_native._library()
    maps = Path("/proc/self/maps").read_text()
    runtimes = {line.split()[-1] for line in maps.splitlines() if re.search(r"lib(g|i)omp[^/]*\.so", line)}
    assert len(runtimes) == 1, runtimes


# ---- what it cannot run, and bad input ----------------------------------------------------------------


@pytest.mark.parametrize("k,group_size,reason", [
    (48, None, "K = 48 and the group size 48 must both be multiples of 32"),
    (64, 16, "the group size 16 must both be multiples of 32"),
])
def test_layouts_outside_the_blocks_are_refused_and_fall_back(k, group_size, reason):
    w, x = make(16, k, 2)
    qw = quantize(w, 4, group_size)
    assert reason in cpu_native.why_native_cannot_run(qw, torch.device("cpu"))
    with pytest.raises(ValueError, match=re.escape(reason)):
        cpu_native.prepare_native(qw)
    with pytest.warns(RuntimeWarning, match=f"backend 'native' cannot run here: .*{re.escape(reason)}"):
        y = quant_matmul(x, qw, backend="native")
    assert torch.equal(y, quant_matmul_ref(x, qw))


def test_bad_activations_and_weights_name_the_field():
    w, x = make(32, 64, 2)
    qw = quantize(w, 8)
    with pytest.raises(ValueError, match=r"x: last dim must be K = 64"):
        cpu_native.quant_matmul_native(x[:, :32], qw)
    with pytest.raises(ValueError, match=r"x: dtype torch.float64 is not supported"):
        cpu_native.quant_matmul_native(x.double(), qw)
    qw.qweight = qw.qweight.t().contiguous().t()  # same shape, not contiguous
    with pytest.raises(ValueError, match=r"qw.qweight: the native kernel needs contiguous tensors"):
        cpu_native.prepare_native(qw)


def test_a_missing_or_failing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(toolchain.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(RuntimeError, match=r"compiling the C quantized matmul kernel failed"):
        cpu_native.load_library()
    assert not list(tmp_path.rglob("*.tmp"))  # nothing half-written left behind


# ---- a whole model on it --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tinylab_int4():
    model, tok = load_model("tinylab")
    with pytest.warns(RuntimeWarning, match="smaller groups"):  # K = 704: groups of 64
        quantize_model(model, "int4-g128", backend="native")
    return model, tok


def test_every_quantized_layer_really_runs_native(tinylab_int4):
    model, _ = tinylab_int4
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.backend == "native" and m._prepared is not None for m in layers)


def test_native_logits_stay_near_the_torch_backends(tinylab_int4):
    model, tok = tinylab_int4
    ids = torch.tensor([tok.encode("Q: What is 12+30? A:")])
    with torch.no_grad():
        native = model(ids)
        set_backend(model, "torch")
        reference = model(ids)
        set_backend(model, "native")
    err = ((native - reference).abs().mean() / reference.std()).item()
    assert 0 < err < 0.01, err  # measured 0.001-0.002: the rounding of x, nothing else


def test_the_engine_on_native_layers_equals_the_naive_loop(tinylab_int4):
    model, tok = tinylab_int4
    prompts = ["Q: What is 12+30? A:", "Once upon a time", "Write JSON for a person called Ada."]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model, tok)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == generate_naive(model, tok, prompt, params).token_ids, prompt


def test_an_int8_lm_head_reads_a_quarter_of_the_bytes_and_keeps_greedy_text():
    model, tok = load_model("tinylab")
    ids = torch.tensor([tok.encode("Once upon a time")])
    with torch.no_grad():
        before = model(ids)
    quantize_lm_head(model, backend="native")
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.bits == 8 and head.group_size == 32
    assert head.qweight.nbytes * 4 == model.embed_tokens.weight.nbytes  # the embedding stays fp32
    parts = weight_bytes_breakdown(model)
    assert parts["quantized lm_head"] == head.qw.nbytes() and parts["embedding and lm_head"] == head.qweight.nbytes * 4
    with torch.no_grad():
        after = model(ids)
    assert torch.equal(after[0, -1].argmax(), before[0, -1].argmax())
    assert 0 < ((after - before).abs().mean() / before.std()).item() < 0.01
    with pytest.raises(ValueError, match="its LM head is already quantized"):
        quantize_lm_head(model)


def test_an_int4_lm_head_reads_about_a_fifth_of_the_bytes_and_keeps_the_top_token():
    """bits=4: the head in int4 groups of 32 (a scale and a zero each), on the native kernel, still picks
    the fp32 head's greedy token on tinylab; a bits value other than 8 or 4 is refused by name."""
    model, tok = load_model("tinylab")
    ids = torch.tensor([tok.encode("Once upon a time")])
    with torch.no_grad():
        before = model(ids)
    int8_model = quantize_lm_head(copy.deepcopy(model), backend="native")
    quantize_lm_head(model, backend="native", bits=4)
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.bits == 4 and head.group_size == 32
    assert 5 * head.qw.nbytes() < model.embed_tokens.weight.nbytes < 7 * head.qw.nbytes()
    assert head.qw.nbytes() < 0.7 * int8_model.lm_head.qw.nbytes()
    with torch.no_grad():
        after, after_int8 = model(ids), int8_model(ids)
    assert torch.equal(after[0, -1].argmax(), before[0, -1].argmax())
    error, error_int8 = (((a - before).abs().mean() / before.std()).item() for a in (after, after_int8))
    assert 3 * error_int8 < error < 0.1  # coarser than the int8 head (~9x here), still close to fp32
    for bad in (2, 16, "4"):
        with pytest.raises(ValueError, match="bits: the LM head is quantized to one of"):
            quantize_lm_head(model.__class__(model.config), bits=bad)


@pytest.mark.parametrize("argv, message", [
    (["eval", "--quant-head"], "--quant-head quantizes the LM head beside --quant"),
    (["eval", "--quant", "gguf", "--quant-head"], "--quant-head quantizes the LM head beside --quant"),
    (["eval", "--quant", "int4-g128", "--quant-head-bits", "4"], "--quant-head-bits 4 needs --quant-head"),
])
def test_eval_refuses_a_head_option_it_would_otherwise_ignore(argv, message):
    from engine.__main__ import main

    with pytest.raises(SystemExit, match=re.escape(message)):
        main(argv)

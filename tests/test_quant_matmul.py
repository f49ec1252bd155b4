"""Chapter 07: quantized matmul kernels. The quantizers against what they promise (half a step of
error, zeros stay zero, the right number of scales), then every backend against the reference
(dequantize, then matmul), then the input contract. Triton runs in its CPU interpreter here
(conftest.py sets TRITON_INTERPRET=1 without a GPU), so shapes are small.
"""

import re

import pytest
import torch

from kernels.quant_matmul import (
    cpu_packed,
    dequantize,
    pack_int4,
    quant_matmul,
    quant_matmul_ref,
    quantize,
    quantize_per_token_int8,
    resolve_backend,
    unpack_int4,
    w8a8_matmul_ref,
)
from kernels.quant_matmul import triton as triton_backend
from kernels.quant_matmul.cuda import nvcc_resource_report, registers_per_kernel
from kernels.quant_matmul.reference import QuantizedWeight, check_quantized_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max |kernel - reference| / max |reference|. Every backend accumulates in fp32; what differs is the
# storage of x and y: fp32 rounds at 2^-24, fp16 at 2^-11, bf16 at 2^-8 (plus a few ulps of summing).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
PACKED_TOLERANCE = TOLERANCE[torch.bfloat16]  # the packed ops compute with bf16 activations inside

# (bits, group_size, per_tensor): the granularities chapter 07 compares
LAYOUTS = [(8, None, False), (8, None, True), (8, 32, False), (4, 32, False), (4, 64, False),
           (4, None, False), (4, None, True)]
LAYOUT_IDS = ["int8-channel", "int8-tensor", "int8-g32", "int4-g32", "int4-g64", "int4-channel", "int4-tensor"]


def assert_close(actual, expected, rel_tol, what=""):
    scale = expected.float().abs().max().clamp(min=1e-6)
    err = ((actual.float() - expected.float()).abs().max() / scale).item()
    assert err <= rel_tol, f"{what}: max |diff| / max |ref| = {err:.2e} > {rel_tol:.0e}"


def make(n=48, k=128, m=3, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    return w, x.to(dtype=dtype, device=device)


def to_device(qw: QuantizedWeight, device) -> QuantizedWeight:
    def move(t):
        return None if t is None else t.to(device)

    return QuantizedWeight(qw.bits, move(qw.qweight), move(qw.scales), move(qw.zeros), qw.group_size, qw.shape)


# ---- the formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,group_size,per_tensor", LAYOUTS, ids=LAYOUT_IDS)
def test_round_to_nearest_is_off_by_at_most_half_a_step(bits, group_size, per_tensor):
    w, _ = make()
    qw = quantize(w, bits, group_size, per_tensor)
    step = qw.scales.expand(w.shape[0], -1).repeat_interleave(w.shape[1] // qw.scales.shape[1], dim=1)
    assert ((dequantize(qw) - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("bits,group_size,per_tensor,num_scales", [
    (8, None, False, 48), (8, None, True, 1), (4, 32, False, 48 * 4), (4, None, True, 1)])
def test_granularity_sets_how_many_scales_there_are(bits, group_size, per_tensor, num_scales):
    w, _ = make()
    qw = quantize(w, bits, group_size, per_tensor)
    assert qw.scales.numel() == num_scales
    zeros = 0 if qw.zeros is None else qw.zeros.nbytes
    assert qw.nbytes() == 48 * 128 * bits // 8 + qw.scales.nbytes + zeros


def test_int8_scale_is_the_rows_absmax_over_127():
    w = torch.tensor([[0.5, -2.54, 1.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    qw = quantize(w, 8)
    assert torch.allclose(qw.scales[:, 0], torch.tensor([0.02, 0.4 / 127]))
    assert qw.qweight[0].tolist() == [25, -127, 50, 0]


def test_int4_zero_point_maps_zero_exactly_and_spans_min_to_max():
    w = torch.tensor([[-1.5, 0.0, 3.0, 1.0]])  # min -1.5, max 3: scale 0.3, zero point 5
    qw = quantize(w, 4, group_size=4)
    assert torch.allclose(qw.scales, torch.tensor([[0.3]])) and qw.zeros.item() == 5
    assert unpack_int4(qw.qweight).tolist() == [[0, 5, 15, 8]]
    assert dequantize(qw)[0, 1] == 0.0


def test_int4_packs_even_inputs_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x0F]]
    q = torch.randint(0, 16, (5, 12), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_per_tensor_int4_loses_to_per_group_on_a_matrix_with_an_outlier_row():
    w, x = make(k=256)
    w[3] *= 20  # one output channel with large weights stretches a shared range
    errors = {}
    for name, kw in {"per-tensor": dict(per_tensor=True), "g32": dict(group_size=32)}.items():
        errors[name] = (quant_matmul_ref(x, quantize(w, 4, **kw)) - x @ w.T).abs().mean().item()
    print(errors)
    assert errors["per-tensor"] > 5 * errors["g32"]


def test_w8a8_equals_the_matmul_of_the_dequantized_operands():
    w, x = make()
    qw = quantize(w, 8)
    qx, sx = quantize_per_token_int8(x)
    assert qx.abs().amax(-1).eq(127).all()  # each token's largest entry uses the full range
    expected = (qx.float() * sx) @ dequantize(qw).T
    assert_close(w8a8_matmul_ref(x, qw), expected, TOLERANCE[torch.float32], "w8a8")


# ---- backends against the reference --------------------------------------------------------------


@pytest.mark.parametrize("bits,group_size,per_tensor", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("n,k,m", [(48, 128, 1), (20, 192, 3)])
def test_triton_dequant_gemv_matches_reference(bits, group_size, per_tensor, n, k, m):
    w, x = make(n, k, m, device=DEVICE)
    qw = to_device(quantize(w, bits, group_size, per_tensor), DEVICE)
    assert_close(triton_backend.quant_matmul_triton(x, qw), quant_matmul_ref(x, qw), TOLERANCE[torch.float32],
                 f"triton int{bits}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_keeps_the_activation_dtype_and_its_tolerance(dtype):
    w, x = make(32, 64, 2, dtype=dtype, device=DEVICE)
    qw = to_device(quantize(w, 4, 32), DEVICE)
    y = triton_backend.quant_matmul_triton(x, qw)
    assert y.dtype == dtype
    assert_close(y, quant_matmul_ref(x.float(), qw), TOLERANCE[dtype], f"triton {dtype}")


def test_triton_handles_batched_activations_and_bias():
    w, _ = make(16, 64)
    x, bias = torch.randn(2, 5, 64).to(DEVICE), torch.randn(16).to(DEVICE)
    qw = to_device(quantize(w, 8), DEVICE)
    y = triton_backend.quant_matmul_triton(x, qw, bias)
    assert y.shape == (2, 5, 16)
    assert_close(y, quant_matmul_ref(x, qw, bias), TOLERANCE[torch.float32], "triton bias")


@pytest.mark.parametrize("bits,group_size,per_tensor", [l for l in LAYOUTS if l != (8, 32, False)],
                         ids=[i for i in LAYOUT_IDS if i != "int8-g32"])
@pytest.mark.parametrize("n,k", [(48, 128), (704, 256), (256, 704)])
def test_torch_packed_cpu_ops_match_reference(bits, group_size, per_tensor, n, k):
    w, x = make(n, k, 4)
    qw = quantize(w, bits, group_size if group_size is None or k % group_size == 0 else 32, per_tensor)
    y = cpu_packed.quant_matmul_packed(x, qw, cpu_packed.prepack(qw))
    assert y.dtype == torch.float32
    assert_close(y, quant_matmul_ref(x, qw), PACKED_TOLERANCE, f"packed int{bits}")


def test_torch_int4_op_adds_its_zero_after_centring_q_at_8():
    """The layout fact cpu_packed.prepack relies on, checked on the raw op: w = (q - 8) * s + zero."""
    q = torch.randint(0, 16, (16, 32), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    scale, zero = torch.full((1, 16), 0.5), torch.full((1, 16), 1.0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.eye(32).bfloat16()  # row i of the output is column i of W
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, torch.stack((scale, zero), -1).bfloat16())
    assert torch.equal(y.float(), ((q - 8) * 0.5 + 1.0).T.float())


@pytest.mark.parametrize("bits,group_size,k,n,reason", [
    (8, 32, 64, 16, "one scale per output channel"),
    (8, None, 100, 16, "K to be a multiple of 8"),
    (4, 32, 64, 20, "N to be a multiple of 16"),
    (4, 16, 64, 16, "group size divisible by 32"),
])
def test_packed_backend_refuses_layouts_torch_cannot_run_and_falls_back(bits, group_size, k, n, reason):
    w, x = make(n, k)
    qw = quantize(w, bits, group_size)
    assert reason in cpu_packed.why_packed_cannot_run(qw, torch.device("cpu"))
    with pytest.raises(ValueError, match=reason):
        cpu_packed.prepack(qw)
    with pytest.warns(RuntimeWarning, match=f"backend 'packed' cannot run here: .*{reason}"):
        y = quant_matmul(x, qw, backend="packed")
    assert torch.equal(y, quant_matmul_ref(x, qw))


def test_cuda_backend_on_cpu_falls_back_to_torch_with_a_warning():
    w, x = make()
    qw = quantize(w, 4, 32)
    with pytest.warns(RuntimeWarning, match="backend 'cuda' cannot run here"):
        y = quant_matmul(x, qw, backend="cuda")
    assert torch.equal(y, quant_matmul_ref(x, qw))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton runs compiled, not interpreted")
def test_triton_backend_runs_on_cpu_under_the_interpreter():
    w, x = make(16, 64)
    qw = quantize(w, 4, 32)
    assert resolve_backend("triton", qw) == "triton"
    assert_close(quant_matmul(x, qw, backend="triton"), quant_matmul_ref(x, qw), TOLERANCE[torch.float32])


def test_gemv_bytes_match_the_worked_example_in_the_docstring():
    # By hand, K = 4096, int4, G = 128: integers 4096 / 2 = 2048 B, 32 groups x (4 + 4) B = 256 B;
    # naive adds an fp32 row written and read back: 2 * 4096 * 4 = 32768 B.
    assert triton_backend.gemv_bytes_per_output(4096, 4, 128) == {
        "fp32": 16384, "bf16": 8192, "naive": 2048 + 256 + 32768, "fused": 2304}
    assert triton_backend.gemv_bytes_per_output(4096, 8, 4096)["fused"] == 4096 + 4  # one fp32 scale


# ---- bad input is a ValueError naming the field ---------------------------------------------------


@pytest.mark.parametrize("call,match", [
    (lambda w: quantize(w, 4, group_size=48), r"group_size: 48 does not divide the input width K = 128"),
    (lambda w: quantize(w, 3), r"bits: 3 is not supported"),
    (lambda w: quantize(w.to(torch.int32), 8), r"weight: dtype torch.int32 is not floating point"),
    (lambda w: quantize(w[0], 8), r"weight: expected a 2-D \[N, K\] matrix"),
    (lambda w: quantize(w[:, :127], 4, group_size=127), r"weight: int4 packs two inputs per byte"),
], ids=["group", "bits", "int weight", "1-D", "odd K int4"])
def test_bad_quantize_input_names_the_field(call, match):
    w, _ = make()
    with pytest.raises(ValueError, match=match):
        call(w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("how,match", [
    ("x width", r"x: last dim must be K = 128"),
    ("x float64", r"x: dtype torch.float64 is not supported"),
    ("scales shape", r"scales: expected float32 \[48, 4\]"),
    ("qweight dtype", r"qweight: 4-bit weights are torch.uint8 \[48, 64\]"),
    ("no zeros", r"zeros: int4 needs zero points"),
])
def test_bad_matmul_input_names_the_field(backend, how, match):
    w, x = make()
    qw = quantize(w, 4, 32)
    if how == "x width":
        x = x[:, :100]
    elif how == "x float64":
        x = x.double()
    elif how == "scales shape":
        qw.scales = qw.scales[:, :2]
    elif how == "qweight dtype":
        qw.qweight = qw.qweight.to(torch.int8)
    elif how == "no zeros":
        qw.zeros = None
    run = quant_matmul_ref if backend == "torch" else triton_backend.quant_matmul_triton
    with pytest.raises(ValueError, match=match):
        run(x, qw)


def test_unknown_backend_is_a_value_error_listing_the_backends():
    w, x = make()
    with pytest.raises(ValueError, match=r"backend: 'marlin' is not one of \('torch', 'packed'"):
        quant_matmul(x, quantize(w, 8), backend="marlin")


def test_w8a8_refuses_a_grouped_weight():
    w, x = make()
    with pytest.raises(ValueError, match="W8A8 needs an int8 per-channel or per-tensor weight"):
        w8a8_matmul_ref(x, quantize(w, 8, group_size=32))
    check_quantized_weight(quantize(w, 8))  # the clean one passes the contract


# ---- CUDA: compiled wherever nvcc exists, run wherever a GPU exists -------------------------------


@pytest.mark.nvcc
def test_cuda_kernel_compiles_without_spills_and_reports_registers():
    report = nvcc_resource_report(arch="sm_90")
    counts = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    print(report)
    assert len(counts) == 6, report  # float, half, bfloat16 x int8, int4
    assert all(1 <= n <= 255 for n in counts), report
    assert not re.search(r"[1-9]\d* bytes spill", report), report
    kernels = registers_per_kernel(report)
    assert sorted(kernels.values()) == sorted(counts)
    assert any("__half, 4>" in name for name in kernels) and any("float, 8>" in name for name in kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group_size,per_tensor", LAYOUTS, ids=LAYOUT_IDS)
def test_cuda_dequant_gemv_matches_reference_on_gpu(dtype, bits, group_size, per_tensor):
    from kernels.quant_matmul.cuda import quant_matmul_cuda

    w, x = make(200, 512, 3, dtype=dtype, device="cuda")
    qw = to_device(quantize(w, bits, group_size, per_tensor), "cuda")
    assert_close(quant_matmul_cuda(x, qw), quant_matmul_ref(x.float(), qw), TOLERANCE[dtype], f"cuda {dtype}")

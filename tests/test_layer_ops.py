"""The fused C layer ops (kernels/layer_ops, engine/fast/native_ops.py) against their references
(kernels/layer_ops/reference.py), and those references against their PyTorch twins in
engine/model.py (RMSNorm, apply_rope), F.silu and torch.argmax, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.fast.native_ops import NativeAttention, NativeMLP, NativeRMSNorm
from engine.model import RMSNorm, apply_rope
from engine_fixtures import mixed_workload, naive_outputs, random_model, run_engine
from kernels.layer_ops import (
    argmax_rows_native,
    rms_norm_native,
    rope_native_,
    silu_mul_native,
    why_layer_ops_cannot_run,
)
from kernels.layer_ops import cpu_native as layer_ops_native
from kernels.layer_ops.reference import argmax_rows_ref, rms_norm_ref, rope_ref_, silu_mul_ref

pytestmark = pytest.mark.skipif(why_layer_ops_cannot_run(torch.zeros(1)) is not None,
                                reason=f"no C layer ops here: {why_layer_ops_cannot_run(torch.zeros(1))}")
BF16_STEP = 2.0 ** -7  # one bf16 rounding step, relative to the value
# C against the reference, by dtype. fp32: float rounding (RMSNorm sums its squares in another
# order). bf16: every value within one rounding step, and nearly all equal (a sum in another
# order can land on the other side of a rounding boundary).
TOLERANCE = {torch.float32: dict(rtol=2e-6, atol=1e-6),
             torch.bfloat16: dict(step=BF16_STEP, equal_fraction=0.99)}


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, what: str = ""):
    """ours (C) against ref within the dtype's tolerance; on failure, say where and by how much."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.shape, ref.dtype, ref.shape)
    tol = TOLERANCE[ref.dtype]
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, **tol, msg=lambda m: f"{what} fp32: {m}")
        return
    a, b = ours.float(), ref.float()
    excess = (a - b).abs() - (tol["step"] * b.abs() + 1e-30)  # > 0: outside one rounding step
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), a.shape))
    assert not (excess > 0).any(), (
        f"{what} bf16: {int((excess > 0).sum())} of {a.numel()} values more than one rounding "
        f"step from the reference; worst at {worst}: C {float(a[worst])}, ref {float(b[worst])}")
    equal = float((a == b).float().mean())
    assert equal >= tol["equal_fraction"], (
        f"{what} bf16: only {equal:.2%} of the values equal the reference's "
        f"(want >= {tol['equal_fraction']:.0%})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_models(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = (torch.randn(3, 7, 96) * 4).to(dtype)
    w = norm.weight.detach()
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, w, norm.eps), norm(x))  # the reference is the model's
    assert_matches(rms_norm_native(x, w, norm.eps), rms_norm_ref(x, w, norm.eps), "RMSNorm")
    strided = x[:, :, :48]  # rows with a stride: read in place
    small = RMSNorm(48, 1e-5).to(dtype)
    w = small.weight.detach()
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(strided, w, small.eps), small(strided))
    assert_matches(rms_norm_native(strided, w, small.eps), rms_norm_ref(strided, w, small.eps),
                   "RMSNorm, strided rows")


@pytest.mark.parametrize("width", [5, 40, 300])  # the scalar tail alone; vectors and a tail (8 or 16 lanes)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_silu_of_gate_times_up(dtype, width):
    torch.manual_seed(1)
    gu = (torch.randn(2, 5, 2 * width) * 3).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(silu_mul_ref(gu), F.silu(gate) * up)
    assert_matches(silu_mul_native(gu), silu_mul_ref(gu), f"SiLU times up, width {width}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_other_builds_of_silu_mul_equal_torch_too(dtype, other_build):
    """SiLU's vector loop (8 lanes on AVX2, with its own bf16 rounding and packing) and the plain-C loop."""
    other_build(layer_ops_native)
    torch.manual_seed(2)
    gu = (torch.randn(3, 2 * 300) * 3).to(dtype)
    assert_matches(silu_mul_native(gu), silu_mul_ref(gu), f"SiLU times up, {other_build.name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_equals_apply_rope(dtype):
    """Every op of RoPE is one exactly rounded multiply or add, in the same order as torch's: bit for bit."""
    torch.manual_seed(2)
    T, H, Hkv, D = 6, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    angles = torch.arange(T)[:, None].float() * torch.rand(D // 2)
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    want_q = apply_rope(q.reshape(1, T, H, D), cos[None, :, None], sin[None, :, None]).reshape(T, H * D)
    want_k = apply_rope(k.reshape(1, T, Hkv, D), cos[None, :, None], sin[None, :, None]).reshape(T, Hkv * D)
    v_before, rows, ref_rows = v.clone(), qkv.clone(), qkv.clone()
    for x, rope_ in ((rows, rope_native_), (ref_rows, rope_ref_)):
        rope_(x, cos.float(), sin.float(), H)  # the q heads
        rope_(x[:, H * D:], cos.float(), sin.float(), Hkv)  # the k heads, right after them
    assert torch.equal(ref_rows[:, :H * D], want_q)  # the reference is the model's apply_rope
    assert torch.equal(ref_rows[:, H * D:(H + Hkv) * D], want_k)
    assert torch.equal(rows, ref_rows), f"RoPE: {int((rows != ref_rows).sum())} values differ"
    assert torch.equal(rows[:, (H + Hkv) * D:], v_before)  # v is not touched


@pytest.mark.parametrize("side", ["C", "reference"])
def test_bad_inputs_name_the_field(side):
    """The C ops and their references refuse the same inputs, naming the same field."""
    rms_norm, silu_mul, rope_ = ((rms_norm_native, silu_mul_native, rope_native_) if side == "C"
                                 else (rms_norm_ref, silu_mul_ref, rope_ref_))
    with pytest.raises(ValueError, match="^x:"):
        rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="^weight:"):
        rms_norm(torch.zeros(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="^gu:"):
        silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="^cos:"):
        rope_(torch.zeros(3, 16), torch.ones(3, 16, dtype=torch.float64), torch.zeros(3, 16), 1)
    with pytest.raises(ValueError, match="^x:"):
        rope_(torch.zeros(3, 8), torch.ones(3, 16), torch.zeros(3, 16), 1)  # narrower than one head


@pytest.mark.parametrize("layer_backend", ["auto", "python"])
def test_the_engine_uses_them_and_equals_the_naive_loop(layer_backend):
    model = random_model(seed=4)
    workload = mixed_workload(6, seed=3, max_out=10)
    engine, outputs = run_engine(model, workload, max_num_seqs=4, layer_backend=layer_backend)
    layer = engine.runner.model.layers[0]
    uses_c = layer_backend == "auto"
    assert isinstance(layer.input_layernorm, NativeRMSNorm) == uses_c
    assert isinstance(layer.mlp, NativeMLP) == uses_c and isinstance(layer.self_attn, NativeAttention) == uses_c
    assert type(model.layers[0].input_layernorm) is RMSNorm  # the model passed in keeps its PyTorch modules
    assert list(outputs.values()) == naive_outputs(model, workload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 63, 64, 65, 49_152])
def test_argmax_rows_follows_torch_argmax_rules(dtype, width):
    """The first of equal maxima (bf16 logits tie often), a NaN counting as the largest, rows with a stride,
    a maximum in the last chunk, every row -inf: the same index as torch.argmax."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=g).to(dtype)
    x[1] = x[1].round()  # many equal values: ties everywhere
    x[2, width // 2:] = x[2].max() + 1  # the maximum repeated from the middle on
    x[3, -1] = 100.0  # in the last (maybe short) chunk
    x[4] = float("-inf")
    x[5, width // 3] = float("nan")
    x[5, -1] = float("nan")
    assert torch.equal(argmax_rows_ref(x), x.argmax(dim=-1))  # the reference keeps torch's rules
    assert torch.equal(argmax_rows_native(x), argmax_rows_ref(x)), (argmax_rows_native(x),
                                                                    argmax_rows_ref(x))
    wide = torch.randn(3, width + 5, generator=g).to(dtype)
    assert torch.equal(argmax_rows_ref(wide[:, :width]), wide[:, :width].argmax(dim=-1))
    assert torch.equal(argmax_rows_native(wide[:, :width]), argmax_rows_ref(wide[:, :width]))


def test_argmax_rows_names_a_bad_input():
    with pytest.raises(ValueError, match=r"logits: expected \[R, V\] with V >= 1"):
        argmax_rows_native(torch.zeros(3))
    with pytest.raises(ValueError, match="logits: expected a CPU fp32 or bf16 tensor"):
        argmax_rows_native(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^logits: expected \[R, V\] with V >= 1"):
        argmax_rows_ref(torch.zeros(3))
    with pytest.raises(ValueError, match="^logits: expected an fp32 or bf16 tensor"):
        argmax_rows_ref(torch.zeros(2, 4, dtype=torch.float16))

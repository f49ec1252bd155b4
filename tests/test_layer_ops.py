"""The fused C layer ops (kernels/layer_ops, engine/fast/native_ops.py) against their PyTorch twins in engine/model.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_fixtures import mixed_workload, naive_outputs, random_model, run_engine

from engine.model import RMSNorm, apply_rope
from engine.fast.native_ops import NativeAttention, NativeMLP, NativeRMSNorm
from kernels.layer_ops import (
    argmax_rows_native,
    rms_norm_native,
    rope_native_,
    silu_mul_native,
    why_layer_ops_cannot_run,
)
from kernels.layer_ops import cpu_native as layer_ops_native

pytestmark = pytest.mark.skipif(why_layer_ops_cannot_run(torch.zeros(1)) is not None,
                                reason=f"no C layer ops here: {why_layer_ops_cannot_run(torch.zeros(1))}")
BF16_STEP = 2.0 ** -7  # one bf16 rounding step, relative to the value


def assert_matches(ours: torch.Tensor, torchs: torch.Tensor):
    """fp32: equal up to float rounding. bf16: every value within one rounding step of torch's, nearly all equal
    (a sum in another order can land on the other side of a rounding boundary)."""
    assert ours.dtype == torchs.dtype and ours.shape == torchs.shape
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, torchs, rtol=2e-6, atol=1e-6)
        return
    a, b = ours.float(), torchs.float()
    assert ((a - b).abs() <= BF16_STEP * b.abs() + 1e-30).all()
    assert (a == b).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_models(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = (torch.randn(3, 7, 96) * 4).to(dtype)
    assert_matches(rms_norm_native(x, norm.weight.detach(), norm.eps), norm(x))
    strided = x[:, :, :48]  # rows with a stride: read in place
    small = RMSNorm(48, 1e-5).to(dtype)
    assert_matches(rms_norm_native(strided, small.weight.detach(), small.eps), small(strided))


@pytest.mark.parametrize("width", [5, 40, 300])  # the scalar tail alone; vectors and a tail (8 or 16 lanes)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_silu_of_gate_times_up(dtype, width):
    torch.manual_seed(1)
    gu = (torch.randn(2, 5, 2 * width) * 3).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert_matches(silu_mul_native(gu), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_other_builds_of_silu_mul_equal_torch_too(dtype, other_build):
    """SiLU's vector loop (8 lanes on AVX2, with its own bf16 rounding and packing) and the plain-C loop."""
    other_build(layer_ops_native)
    torch.manual_seed(2)
    gu = (torch.randn(3, 2 * 300) * 3).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert_matches(silu_mul_native(gu), F.silu(gate) * up)


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
    v_before, rows = v.clone(), qkv.clone()
    rope_native_(rows, cos.float(), sin.float(), H)
    rope_native_(rows[:, H * D:], cos.float(), sin.float(), Hkv)
    assert torch.equal(rows[:, :H * D], want_q) and torch.equal(rows[:, H * D:(H + Hkv) * D], want_k)
    assert torch.equal(rows[:, (H + Hkv) * D:], v_before)  # v is not touched


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="^x:"):
        rms_norm_native(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="^weight:"):
        rms_norm_native(torch.zeros(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="^gu:"):
        silu_mul_native(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="^cos:"):
        rope_native_(torch.zeros(3, 16), torch.ones(3, 16, dtype=torch.float64), torch.zeros(3, 16), 1)
    with pytest.raises(ValueError, match="^x:"):
        rope_native_(torch.zeros(3, 8), torch.ones(3, 16), torch.zeros(3, 16), 1)  # narrower than one head


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
    assert torch.equal(argmax_rows_native(x), x.argmax(dim=-1))
    wide = torch.randn(3, width + 5, generator=g).to(dtype)
    assert torch.equal(argmax_rows_native(wide[:, :width]), wide[:, :width].argmax(dim=-1))


def test_argmax_rows_names_a_bad_input():
    with pytest.raises(ValueError, match=r"logits: expected \[R, V\] with V >= 1"):
        argmax_rows_native(torch.zeros(3))
    with pytest.raises(ValueError, match="logits: expected a CPU fp32 or bf16 tensor"):
        argmax_rows_native(torch.zeros(2, 4, dtype=torch.float16))

"""Packed weights (engine/fast/packed_linear.py): the same numbers as nn.Linear, in the layout the CPU streams fastest.

The claims: a PackedLinear computes what its nn.Linear computes (any batch shape, with and without bias, any
block count, N divisible or not); packing copies the model and leaves the original alone; only plain
nn.Linear layers are packed (quantized ones keep their kernels); the engine with packed weights gives the
naive loop's greedy tokens; and after weights change in place, `refresh_model_id` re-packs them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.companions.naive import generate_naive
from engine.fast import packed_linear
from engine.fast.packed_linear import PackedLinear, pack_linears
from engine.fast.probes import bf16_instructions, onednn_available, use_packed
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.quantization import QuantLinear, quantize_model
from engine.sampling import SamplingParams
from engine_fixtures import mixed_workload, naive_outputs, random_model, run_engine
from kernels.gemv import GEMV_MAX_ROWS, why_gemv_cannot_run

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max |packed - linear| / max |linear|


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (GEMV_MAX_ROWS,), (5,), (2, 7), (1, 1, 3)])  # GEMV rows, then oneDNN
@pytest.mark.parametrize("c_kernel", [True, False], ids=["C gemv", "torch fallback"])
def test_packed_linear_equals_nn_linear(dtype, blocks, bias, lead, c_kernel, monkeypatch):
    if not c_kernel:
        monkeypatch.setattr(packed_linear, "why_gemv_cannot_run", lambda w: "no C compiler (simulated)")
    torch.manual_seed(0)
    for n_out in (12, 13):  # 13 is not divisible by 2 or 3: one block
        linear = nn.Linear(10, n_out, bias=bias).to(dtype)
        packed = PackedLinear(linear, blocks)
        x = torch.randn(*lead, 10, dtype=dtype)
        with torch.no_grad():
            want, got = linear(x), packed(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert err <= TOLERANCE[dtype], f"blocks={blocks} N={n_out}: relative error {err:.2e}"
        assert packed.blocks == (blocks if n_out % blocks == 0 else 1)
        assert (packed.onednn is not None) == onednn_available()


def test_packed_weight_is_the_transpose_cut_into_column_blocks(monkeypatch):
    """Where the C matrix-vector kernel cannot be built, fp32 decode rows use column blocks of W^T."""
    monkeypatch.setattr(packed_linear, "why_gemv_cannot_run", lambda w: "no C compiler (simulated)")
    linear = nn.Linear(3, 4, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.arange(12.0).view(4, 3))  # W [N=4, K=3]
    packed = PackedLinear(linear, blocks=2).packed  # [P=2, K=3, N/P=2]
    assert packed.shape == (2, 3, 2) and packed.is_contiguous()
    assert torch.equal(packed[0], linear.weight[:2].t()) and torch.equal(packed[1], linear.weight[2:].t())


@pytest.mark.skipif(why_gemv_cannot_run(torch.ones(1, 1)) is not None, reason="the C gemv kernel cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_read_the_original_weight_through_the_c_kernel(dtype):
    linear = nn.Linear(40, 9).to(dtype)
    packed = PackedLinear(linear, blocks=2)
    assert packed.gemv_weight.data_ptr() == linear.weight.data_ptr() and packed.packed is None  # no copy
    x = torch.randn(2, 40, dtype=dtype)
    with torch.no_grad():
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        got = packed(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **({} if dtype == torch.float32 else
                                                                      dict(atol=1e-2, rtol=1e-2)))


def test_bf16_gemv_reads_the_original_weight_and_the_gemm_runs_in_a_dtype_the_cpu_has():
    linear = nn.Linear(8, 6).to(torch.bfloat16)
    packed = PackedLinear(linear, blocks=2)
    assert packed.weight is not None and packed.weight.data_ptr() == linear.weight.data_ptr()  # no copy
    assert packed.gemm_dtype == (torch.bfloat16 if bf16_instructions() else torch.float32)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        want = linear(x).float()
        got = packed(x)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max() / want.abs().max()) <= TOLERANCE[torch.bfloat16]


def test_bad_block_count_is_refused():
    with pytest.raises(ValueError, match="blocks must be >= 1"):
        PackedLinear(nn.Linear(4, 4), blocks=0)


def test_pack_linears_copies_and_leaves_the_model_alone():
    model = random_model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    packed = pack_linears(model, blocks=2)
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear  # the original keeps its modules
    assert isinstance(packed.layers[0].self_attn.q_proj, PackedLinear)
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(packed.layers[1].mlp.down_proj, PackedLinear)
    assert packed.embed_tokens is model.embed_tokens  # everything else is shared, not copied
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ids = torch.randint(2, 101, (2, 9))
    assert torch.allclose(packed(ids), model(ids), atol=1e-4, rtol=1e-4)


def test_quantized_layers_are_not_packed():
    model = quantize_model(random_model(seed=2), "int8")
    packed = pack_linears(model, blocks=2)
    layer = packed.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantLinear) and layer is model.layers[0].self_attn.q_proj


@pytest.mark.parametrize("layout, dtype, device, expected", [
    ("auto", torch.float32, "cpu", True), ("auto", torch.bfloat16, "cpu", True), ("auto", torch.float16, "cpu", False),
    ("auto", torch.float32, "cuda", False), ("packed", torch.bfloat16, "cpu", True),
    ("linear", torch.float32, "cpu", False)])
def test_auto_packs_fp32_on_a_cpu_only(layout, dtype, device, expected):
    assert use_packed(layout, dtype, torch.device(device)) is expected


def test_a_bad_weight_layout_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"weight_layout must be one of auto, linear, packed; got 'kn'"):
        engine_config(weight_layout="kn")
    with pytest.raises(ValueError, match=r"weight_layout='packed': fast-wing options, but speed='reference'"):
        engine_config(speed="reference", weight_layout="packed")


@pytest.mark.parametrize("num_threads", [1, 2])
def test_engine_with_packed_weights_equals_the_naive_loop(num_threads):
    model = random_model(seed=3)
    workload = mixed_workload(12, seed=3)
    engine, outputs = run_engine(model, workload, weight_layout="packed", num_threads=num_threads)
    assert engine.weight_layout == "packed"
    assert isinstance(engine.runner.model.layers[0].mlp.gate_up_proj, PackedLinear)  # fused, then packed
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert list(outputs.values()) == naive_outputs(model, workload)


def test_linear_layout_runs_the_model_as_given():
    model = random_model(seed=4)
    engine = LLMEngine(model, None, engine_config(model="random", weight_layout="linear"))
    assert engine.weight_layout == "linear" and engine.runner.model is model


def test_refresh_model_id_repacks_weights_changed_in_place():
    model = random_model(seed=5)
    engine = LLMEngine(model, None, engine_config(model="random", weight_layout="packed"))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = list(range(2, 14))

    def run() -> list[int]:
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.get_request(rid).output_token_ids

    old = run()
    model.load_state_dict(random_model(seed=6).state_dict())
    engine.refresh_model_id()
    new = run()
    assert new == generate_naive(model, None, prompt, params).token_ids
    assert new != old  # the new weights really answer otherwise, so the check above can fail

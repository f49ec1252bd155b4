"""Fused projections (engine/fast/fused_projections.py): q/k/v stacked into one matrix and gate/up into another give
the model's own logits; the model passed in is left alone; layers that cannot be stacked stay separate; the
engine (which fuses, then packs) still gives the naive loop's greedy tokens, quantized models included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.config import ModelConfig
from engine.fast.fused_projections import fuse_projections, stack_linears
from engine.loading.quantization import QuantLinear, quantize_model
from engine.model import LlamaModel
from engine_fixtures import mixed_workload, naive_outputs, random_model, run_engine

IDS = torch.tensor([[5, 17, 3, 99, 42, 8, 61]])


def logits(model):
    with torch.inference_mode():
        return model(IDS)


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def biased_model() -> LlamaModel:
    """Qwen2-style: biases on q/k/v and in the MLP, so the stacked bias is tested too."""
    cfg = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, qkv_bias=True,
                      mlp_bias=True)
    torch.manual_seed(2)
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("make", [lambda: random_model(seed=1), biased_model], ids=["llama", "biases"])
def test_fused_float_model_gives_the_models_logits(make):
    model = make()
    fused = fuse_projections(model)
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert type(attn.qkv_proj) is nn.Linear and attn.qkv_proj.out_features == 4 * 16 + 2 * 2 * 16
    assert type(mlp.gate_up_proj) is nn.Linear and not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    assert rel_err(logits(fused), logits(model)) < 1e-5


def test_the_model_passed_in_is_left_alone_and_the_rest_is_shared():
    model = random_model(seed=2)
    before = copy.deepcopy(model.state_dict())
    fused = fuse_projections(model)
    for layer, twin in zip(model.layers, fused.layers, strict=True):
        assert not hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.mlp, "gate_up_proj")
        assert isinstance(layer.self_attn.q_proj, nn.Linear)
        assert twin is not layer and twin.self_attn.o_proj is layer.self_attn.o_proj
        assert twin.input_layernorm is layer.input_layernorm and twin.mlp.down_proj is layer.mlp.down_proj
    assert fused.embed_tokens is model.embed_tokens
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("scheme,backend", [("int8", "torch"), ("int4-g32", "torch"), ("int8", "native"),
                                            ("int4-g32", "native")])
def test_fused_quantized_layers_give_the_same_numbers(scheme, backend):
    model = quantize_model(random_model(seed=3), scheme, backend=backend)
    fused = fuse_projections(model)
    qkv = fused.layers[1].self_attn.qkv_proj
    assert type(qkv) is QuantLinear and (qkv.bits, qkv.backend) == (model.layers[1].self_attn.q_proj.bits, backend)
    got, want = logits(fused), logits(model)
    if backend == "native":  # every output row is summed by one thread in one order, from the same rounded x
        assert torch.equal(got, want)
    else:
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("scheme", ["int8-per-tensor", "w8a8"])
def test_layers_with_their_own_scaling_stay_separate(scheme):
    """A per-tensor scale is one number per matrix, and W8A8 layers quantize their input on their own."""
    model = quantize_model(random_model(seed=4), scheme)
    fused = fuse_projections(model)
    assert fused.layers[0].self_attn is model.layers[0].self_attn  # not fused: shared as it is
    assert fused.layers[0].mlp is model.layers[0].mlp and fused is model
    assert torch.equal(logits(fused), logits(model))


def test_mixed_layer_kinds_and_dtypes_are_not_stacked():
    model = random_model(seed=5)
    attn = model.layers[0].self_attn
    assert stack_linears((attn.q_proj, attn.k_proj, attn.v_proj)) is not None
    quantize_model(model, "int8")
    mixed = (nn.Linear(64, 8), model.layers[0].self_attn.k_proj)
    assert stack_linears(mixed) is None
    assert stack_linears((nn.Linear(64, 8), nn.Linear(64, 8).to(torch.bfloat16))) is None
    assert stack_linears((nn.Linear(64, 8), nn.Linear(64, 8, bias=False))) is None


@pytest.mark.parametrize("scheme", [None, "int4-g32"])
def test_the_engine_computes_with_the_fused_copy_and_still_equals_the_naive_loop(scheme):
    model = random_model(seed=6)
    if scheme:
        quantize_model(model, scheme, backend="native")
    workload = mixed_workload(10, seed=6)
    engine, outputs = run_engine(model, workload, weight_layout="packed")
    assert engine.runner.model.layers[0].self_attn.qkv_proj is not None and engine.model is model
    assert list(outputs.values()) == naive_outputs(model, workload)

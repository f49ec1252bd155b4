"""Chapter 07's measuring tools: the inputs a layer saw, a relative error, a quantized model compared with
its float self, and W8A8 through a real integer GEMM, each checked against a direct computation."""

import copy

import pytest
import torch

from engine.fast.w8a8_matmul import prepare_w8a8, w8a8_linear
from engine.loading.quantization import (
    compare_logits,
    gptq_quantize,
    layer_inputs,
    quantize_lm_head,
    relative_error,
)
from kernels.quant_matmul import dequantize, quantize, w8a8_matmul_ref


class TwoLayers(torch.nn.Module):
    """A toy with the engine's naming: layers.0 and layers.1, an LM head over V = 10."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(10, 16)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16, bias=False) for _ in range(2)])
        self.lm_head = torch.nn.Linear(16, 10, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, ids):
        return self.lm_head(self.layers[1](torch.relu(self.layers[0](self.embed(ids)))))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 10, (2, 5), generator=g) for _ in range(3)]


def test_layer_inputs_are_every_row_each_layer_saw():
    model, batches = TwoLayers(), _batches()
    got = layer_inputs(model, ["layers.0", "layers.1"], batches)
    embeddings = torch.cat([model.embed(b).reshape(-1, 16) for b in batches]).detach()  # [30, 16]
    assert torch.equal(got["layers.0"], embeddings)
    assert torch.allclose(got["layers.1"], torch.relu(model.layers[0](embeddings)).detach())


def test_relative_error_is_the_norm_ratio():
    exact = torch.tensor([3.0, 4.0])
    assert relative_error(torch.tensor([3.0, 5.0]), exact) == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="approx"):
        relative_error(torch.ones(3), exact)


def test_a_model_agrees_fully_with_itself_and_its_perplexity_is_the_mean_nll():
    model, batches = TwoLayers(), _batches()
    same = compare_logits(model, model, batches)
    assert same["top1_agreement"] == 1.0 and same["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)
    assert same["tokens"] == 30
    logp = torch.cat([torch.log_softmax(model(b)[:, :-1], -1).gather(-1, b[:, 1:, None]).flatten() for b in batches])
    assert same["perplexity"] == pytest.approx(torch.exp(-logp.mean()).item(), rel=1e-5)
    with torch.no_grad():
        logits = [model(b) for b in batches]
    assert compare_logits(logits, model, batches) == same  # the reference's logits, computed once


def test_perplexity_can_skip_a_target_no_model_predicts():
    model, batches = TwoLayers(), _batches()
    skip = int(batches[0][0, 1])  # a token id that occurs as a target
    logp = torch.cat([torch.log_softmax(model(b)[:, :-1], -1).gather(-1, b[:, 1:, None])[..., 0][b[:, 1:] != skip]
                      for b in batches])
    got = compare_logits(model, model, batches, ignore_target=skip)
    assert got["perplexity"] == pytest.approx(torch.exp(-logp.mean()).item(), rel=1e-5)
    assert got["perplexity"] != pytest.approx(compare_logits(model, model, batches)["perplexity"])


def test_a_coarser_lm_head_strays_further_from_the_float_model():
    model, batches = TwoLayers(), _batches()
    int8 = quantize_lm_head(copy.deepcopy(model))
    int4 = quantize_lm_head(copy.deepcopy(model), qw=quantize(model.lm_head.weight.detach(), 4, per_tensor=True))
    near, far = compare_logits(model, int8, batches), compare_logits(model, int4, batches)
    assert 0 < near["kl_to_reference"] < far["kl_to_reference"]
    assert near["top1_agreement"] >= far["top1_agreement"]


def test_compare_logits_names_a_bad_batch():
    with pytest.raises(ValueError, match="batches"):
        compare_logits(TwoLayers(), TwoLayers(), [torch.zeros(2, 1, dtype=torch.long)])


def test_gptq_on_its_own_calibration_inputs_beats_round_to_nearest():
    """The lesson of the chapter's GPTQ cell on a small correlated input: lower output error than RTN on the
    data whose Hessian it used."""
    g = torch.Generator().manual_seed(2)
    mix = torch.randn(64, 64, generator=g)
    x = torch.randn(512, 64, generator=g) @ mix  # correlated inputs, as a layer's are
    w = torch.randn(32, 64, generator=g)
    hessian = 2 * x.T @ x / len(x)
    rtn = relative_error(x @ dequantize(quantize(w, 4, 32)).T, x @ w.T)
    gptq = relative_error(x @ dequantize(gptq_quantize(w, hessian, 4, 32)).T, x @ w.T)
    assert gptq < 0.8 * rtn


@pytest.mark.parametrize("m, k, n", [(1, 256, 704), (3, 576, 1536), (64, 704, 256)])
def test_w8a8_integer_gemm_equals_the_readable_reference(m, k, n):
    g = torch.Generator().manual_seed(3)
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g) * 3, torch.randn(n, generator=g)
    qw = quantize(w, 8)
    got, want = w8a8_linear(x, prepare_w8a8(qw), bias), w8a8_matmul_ref(x, qw, bias)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_w8a8_needs_a_per_channel_int8_weight():
    with pytest.raises(ValueError, match="qw"):
        prepare_w8a8(quantize(torch.randn(8, 64), 4, 32))
    with pytest.raises(ValueError, match="qw"):
        prepare_w8a8(quantize(torch.randn(8, 64), 8, 32))

"""Chapter 07: quantizing a whole model. Every scheme's logits stay within a documented distance of
the fp32 model (random oracle configs and tinylab), greedy text survives int8, granularity and GPTQ
matter by measured factors, bytes add up, and bad options are named.

The distance is the mean |logit error| divided by the std of the fp32 logits (scale-free, so one
number means the same for a random model and a trained one). Measured on 2026-11-30 (tinylab as of
that day; oracle configs: the worst of the five), with each bound about 2-3x the measurement:

    scheme            tinylab   bound   | oracle (worst)  bound
    int8              0.0027    0.01    | 0.0068          0.015
    int8-per-tensor   0.0042    0.015   | 0.0091          0.025
    int4-g32          0.026     0.08    | 0.081           0.2
    int4-g64          0.035     0.08    | 0.107           0.2
    int4-g128         0.032     0.08    | 0.107           0.2
    int4-per-channel  0.043     0.1     | 0.108           0.2
    int4-per-tensor   0.085     0.2     | 0.130           0.3
    gptq-int4-g128    0.014     0.04    | 0.072           0.15
    w8a8              0.015     0.04    | 0.0078          0.03
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from engine import load_model
from engine.companions.kv_cache import generate_cached
from engine.lab import tasks
from engine.loading.quantization import (
    SCHEMES,
    QuantLinear,
    calibration_batches,
    quantize_linear,
    quantize_model,
    quantized_weight_bytes,
    set_backend,
    smoothing_factors,
    weight_bytes_breakdown,
)
from engine.sampling import SamplingParams
from hf_oracle import ORACLE_CONFIGS, save_tiny_hf_model

# The third tinylab (trained four times longer than the second) has outlier input channels: plain W8A8 measured
# 0.074 on it (0.019 with SmoothQuant, tested below) and per-tensor int4 0.202; the other schemes moved little.
TINYLAB_BOUND = {"int8": 0.01, "int8-per-tensor": 0.015, "int4-g32": 0.08, "int4-g64": 0.08, "int4-g128": 0.08,
                 "int4-per-channel": 0.1, "int4-per-tensor": 0.25, "gptq-int4-g128": 0.04, "w8a8": 0.1}
ORACLE_BOUND = {"int8": 0.015, "int8-per-tensor": 0.025, "int4-g32": 0.2, "int4-g64": 0.2, "int4-g128": 0.2,
                "int4-per-channel": 0.2, "int4-per-tensor": 0.3, "gptq-int4-g128": 0.15, "w8a8": 0.03}
CAL_BATCHES, CAL_BATCH, CAL_LEN = 2, 4, 64  # 512 calibration tokens: enough for tinylab's 256..704-wide layers
EVAL_BATCH, EVAL_LEN = 8, 48


def relative_error(logits, reference) -> float:
    return ((logits - reference).abs().mean() / reference.std()).item()


def quantized(model, scheme, **kw):
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # smaller groups for tinylab's K = 704 (tested below)
        return quantize_model(m, scheme, **kw)


@pytest.fixture(scope="module")
def tinylab():
    """The model, calibration batches from the training side of the corpus, held-out eval batches."""
    model, tok = load_model("tinylab")
    train = [i for text in tasks.training_corpus(n_examples=150) for i in tok.encode(text)]
    held_out = [i for t in ("arith", "story", "json", "refuse") for e in tasks.eval_examples(t, 8)
                for i in tok.encode(e.text)]
    cal = calibration_batches(train, CAL_BATCH, CAL_LEN)[:CAL_BATCHES]
    ids = calibration_batches(held_out, EVAL_BATCH, EVAL_LEN)[0]
    with torch.no_grad():
        reference = model(ids)
    errors = {}  # scheme -> relative error, filled by the tests and reused by the comparisons
    return dict(model=model, tok=tok, cal=cal, ids=ids, reference=reference, errors=errors)


def tinylab_error(lab, scheme, **kw) -> float:
    key = (scheme, tuple(sorted(kw.items())))
    if key not in lab["errors"]:
        needs_cal = scheme.startswith("gptq") or "alpha" in kw
        m = quantized(lab["model"], scheme, calibration=lab["cal"] if needs_cal else None, **kw)
        with torch.no_grad():
            lab["errors"][key] = relative_error(m(lab["ids"]), lab["reference"])
    return lab["errors"][key]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_scheme_keeps_tinylab_logits_within_its_bound(tinylab, scheme):
    err = tinylab_error(tinylab, scheme)
    print(f"tinylab {scheme}: {err:.4f}")
    assert err <= TINYLAB_BOUND[scheme], f"{scheme}: relative logit error {err:.4f} > {TINYLAB_BOUND[scheme]}"
    assert err > 0  # the layers really were replaced


@pytest.mark.parametrize("config", list(ORACLE_CONFIGS))
def test_every_scheme_keeps_oracle_config_logits_within_its_bound(config, tmp_path):
    save_tiny_hf_model(config, tmp_path)
    model, _ = load_model(tmp_path)
    g = torch.Generator().manual_seed(0)
    cal = [torch.randint(0, 128, (2, 32), generator=g) for _ in range(2)]
    ids = torch.randint(0, 128, (2, 24), generator=g)
    with torch.no_grad():
        reference = model(ids)
    for scheme in SCHEMES:
        with torch.no_grad():
            err = relative_error(quantized(model, scheme, calibration=cal)(ids), reference)
        print(f"{config} {scheme}: {err:.4f}")
        assert 0 < err <= ORACLE_BOUND[scheme], f"{config} {scheme}: {err:.4f} > {ORACLE_BOUND[scheme]}"


def test_per_tensor_int4_is_far_worse_than_per_group(tinylab):
    """Measured: per-tensor 0.085 vs g32 0.026 (3.3x). One (scale, zero) per matrix gives every weight
    the range of the matrix's largest one; groups of 32 each get their own."""
    ratio = tinylab_error(tinylab, "int4-per-tensor") / tinylab_error(tinylab, "int4-g32")
    print(f"per-tensor / g32 error ratio: {ratio:.2f}")
    assert ratio > 2


def test_gptq_beats_round_to_nearest_on_calibration_like_text(tinylab):
    """Same format (int4, groups of 128), different rounding. Measured 0.014 vs 0.032 (2.3x lower)."""
    gptq, rtn = tinylab_error(tinylab, "gptq-int4-g128"), tinylab_error(tinylab, "int4-g128")
    print(f"gptq {gptq:.4f} vs rtn {rtn:.4f}")
    assert gptq < 0.75 * rtn


def test_tinylab_greedy_text_survives_int8(tinylab):
    """Measured: 16 of 16 held-out prompts give identical 12-token greedy completions. We assert 14:
    a retrained tinylab may have a near-tie between its top two tokens somewhere, where any
    rounding can flip the choice and the rest of the text with it."""
    model, tok = tinylab["model"], tinylab["tok"]
    int8 = quantized(model, "int8")
    prompts = [e.prompt for t in ("arith", "json", "refuse", "story") for e in tasks.eval_examples(t, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    same = sum(generate_cached(model, tok, p, params).token_ids == generate_cached(int8, tok, p, params).token_ids
               for p in prompts)
    print(f"int8 greedy identical on {same}/{len(prompts)} prompts")
    assert same >= 14


def test_smoothquant_halves_w8a8_error_on_tinylab_s_outlier_channels(tinylab):
    plain, smooth = tinylab_error(tinylab, "w8a8"), tinylab_error(tinylab, "w8a8", alpha=0.5)
    assert smooth < 0.5 * plain, f"SmoothQuant {smooth:.4f} vs plain W8A8 {plain:.4f}"


def test_smoothquant_tames_an_outlier_input_channel():
    """Activation channel 3 is 50x larger than the others (the outliers SmoothQuant was made for):
    per-token int8 spends its whole range on it. Smoothing moves the range into the weight."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 32, bias=False))])
    model.forward = lambda ids: model.layers[0](ids_to_x[ids[0, 0].item()])  # a "model" fed activations
    ids_to_x = {0: torch.randn(64, 64, generator=g)}
    ids_to_x[0][:, 3] *= 50
    x, w = ids_to_x[0], model.layers[0][0].weight.detach()
    errors = {}
    for alpha in (None, 0.5):
        smooth = smoothing_factors(model, [torch.zeros(1, 1, dtype=torch.long)], alpha) if alpha else {}
        layer = quantize_linear("layers.0.0", model.layers[0][0], SCHEMES["w8a8"], smooth=smooth.get("layers.0.0"))
        errors[alpha] = ((layer(x) - x @ w.T).abs().mean() / (x @ w.T).std()).item()
    print(errors)
    assert errors[0.5] < errors[None] / 3


def test_quantized_bytes_are_the_integers_plus_scales_and_zero_points(tinylab):
    model = tinylab["model"]
    before = weight_bytes_breakdown(model)
    linears = [(m.out_features, m.in_features) for n, m in model.named_modules()
               if n.startswith("layers.") and isinstance(m, nn.Linear)]
    int8, int4 = quantized(model, "int8"), quantized(model, "int4-g32")
    # int8: N*K bytes + one fp32 scale per row; int4-g32: N*K/2 bytes + fp32 scale and zero per 32 weights
    assert weight_bytes_breakdown(int8)["quantized linears"] == sum(n * k + 4 * n for n, k in linears)
    assert weight_bytes_breakdown(int4)["quantized linears"] == sum(n * k // 2 + 8 * n * k // 32 for n, k in linears)
    assert before["float linears"] == sum(4 * n * k for n, k in linears)
    for q in (int8, int4):  # embedding (tied LM head counted once) and norms stay as they were
        after = weight_bytes_breakdown(q)
        assert after["float linears"] == 0 and after["embedding and lm_head"] == before["embedding and lm_head"]
    assert quantized_weight_bytes(model) == sum(p.numel() for p in model.parameters()) * 4
    print({s: quantized_weight_bytes(quantized(model, s)) for s in ("int8", "int4-g32", "int4-g128")})


def test_packed_backend_gives_the_reference_logits_up_to_bf16(tinylab):
    model = quantized(tinylab["model"], "int4-g32")
    with torch.no_grad():
        reference = model(tinylab["ids"])
        set_backend(model, "packed")
        assert all(m.backend == "packed" for m in model.modules() if isinstance(m, QuantLinear))
        packed = model(tinylab["ids"])
    err = relative_error(packed, reference)
    print(f"packed vs torch backend: {err:.4f}")
    assert err < 0.02  # bf16 activations inside torch's ops; the integers are the same


def test_a_group_size_that_does_not_divide_a_layer_uses_smaller_groups_and_says_so(tinylab):
    with pytest.warns(RuntimeWarning, match=r"int4-g128.*down_proj \(K=704\): 64"):
        model = quantize_model(copy.deepcopy(tinylab["model"]), "int4-g128")
    assert model.layers[0].mlp.down_proj.group_size == 64 and model.layers[0].mlp.up_proj.group_size == 128


# ---- bad options ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(scheme="int3"), r"scheme: 'int3' is not a quantization scheme; use one of \['int8', 'int8-per-tensor'"),
    (dict(scheme="gptq-int4-g128"), r"calibration: scheme 'gptq-int4-g128' needs a few batches"),
    (dict(scheme="int8", alpha=0.5), r"alpha: SmoothQuant smoothing applies to 'w8a8' only"),
    (dict(scheme="w8a8", alpha=1.5, calibration=[torch.zeros(1, 4, dtype=torch.long)]), r"alpha: must be in \[0, 1\]"),
    (dict(scheme="int8", backend="marlin"), r"backend: 'marlin' is not one of"),
    (dict(scheme="w8a8", alpha=0.5, calibration=[torch.zeros(4)]), r"calibration: each batch must be token ids"),
], ids=["scheme", "gptq no data", "alpha not w8a8", "alpha range", "backend", "calibration dtype"])
def test_bad_options_are_named_and_change_nothing(tinylab, kwargs, match):
    model = copy.deepcopy(tinylab["model"])
    scheme = kwargs.pop("scheme")
    with pytest.raises(ValueError, match=match):
        quantize_model(model, scheme, **kwargs)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_quantizing_twice_says_to_load_a_fresh_model(tinylab):
    model = quantized(tinylab["model"], "int8")
    with pytest.raises(ValueError, match="already quantized: load a fresh model"):
        quantize_model(model, "int4-g32")


def test_a_layer_without_a_weight_is_named():
    with pytest.raises(ValueError, match=r"layers.0.act: has no 2-D weight to quantize"):
        quantize_linear("layers.0.act", nn.ReLU(), SCHEMES["int8"])


# ---- GGUF blocks on the int8/int4 path --------------------------------------------------------------


def test_gguf_blocks_load_as_int8_and_int4_layers_with_the_fp32_conversions_logits(tmp_path, monkeypatch):
    """The synthetic file of tests/test_gguf.py stores q_proj as Q4_1, k_proj as Q4_0, gate_proj as
    Q8_0 and v_proj as F16: the first three must become QuantLinears, v_proj must stay float, and the
    logits must equal those of the dequantized (fp32) conversion up to fp32 rounding."""
    from test_gguf import tiny_llama, write_tiny_gguf

    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    fp32, _ = load_model(tmp_path / "tiny.gguf")
    blocks, _ = load_model(tmp_path / "tiny.gguf", quantization="gguf")
    attn, mlp = blocks.layers[0].self_attn, blocks.layers[0].mlp
    assert (attn.q_proj.bits, attn.q_proj.group_size, attn.k_proj.bits, mlp.gate_proj.bits) == (4, 32, 4, 8)
    assert torch.equal(attn.k_proj.zeros, torch.full_like(attn.k_proj.zeros, 8.0))  # Q4_0: w = d * (q - 8)
    assert type(attn.v_proj) is nn.Linear
    ids = torch.randint(0, fp32.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (blocks(ids) - fp32(ids)).abs().max().item()
    assert diff < 1e-4, f"max |diff| {diff:.2e}"


def test_gguf_quantization_needs_a_gguf_source_and_a_known_option():
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a GGUF source"):
        load_model("tinylab", quantization="gguf")
    with pytest.raises(ValueError, match=r"quantization: 'int4' is not a load-time option"):
        load_model("tinylab", quantization="int4")


@pytest.mark.slow
def test_real_model_q4_1_blocks_give_the_fp32_conversions_logits():
    """SmolLM2-135M-Instruct's 210 decoder linears are Q4_1: as int4 g32 layers (80 MB instead of 425 MB
    of fp32) they give the converted model's logits to 4e-5 (measured; logits reach ~27). Its tied head
    is Q8_0 and becomes an int8 layer too (the embedding stays the fp32 conversion). ~30 s."""
    from engine.loading import gguf

    try:
        gguf.packaged_gguf_path("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    fp32, tok = load_model("smollm2-135m-instruct")
    blocks, _ = load_model("smollm2-135m-instruct", quantization="gguf")
    assert sum(isinstance(m, QuantLinear) for m in blocks.modules()) == 210 + 1
    assert (blocks.lm_head.bits, blocks.lm_head.group_size) == (8, 32) and type(blocks.embed_tokens) is nn.Embedding
    parts = weight_bytes_breakdown(blocks)
    assert parts["quantized linears"] * 5 < weight_bytes_breakdown(fp32)["float linears"]
    assert parts["quantized lm_head"] == blocks.lm_head.qw.nbytes()
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        diff = (blocks(ids) - fp32(ids)).abs().max().item()
    assert diff < 1e-3, f"max |diff| {diff:.2e}"

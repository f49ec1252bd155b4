"""The C decoder layers (kernels/decoder_layers, engine/fast/native_layers.py): a decode step of a few sequences runs
every layer in one C call. Oracles: the naive loop (greedy tokens, fp32) and engine/model.py's layers (the
hidden state after all layers, fp32, bf16 and quantized weights)."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.fast.native_layers import NativeLayers, why_native_layers_cannot_run
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.quantization import quantize_model
from engine.runner import run_model
from engine_fixtures import mixed_workload, naive_outputs, random_model, run_engine
from kernels.decoder_layers import decoder_layers_native
from kernels.decoder_layers import why_library_cannot_load as why_c_cannot_load
from kernels.quant_matmul.cpu_native import FUSED_MAX_ROWS

pytestmark = pytest.mark.skipif(why_c_cannot_load() is not None, reason=f"no C layers here: {why_c_cannot_load()}")


def count_native_steps(engine: LLMEngine) -> list[int]:
    """Wrap the engine's C layers so that every step they run is counted (rows per step)."""
    native, rows = engine.runner.decode_step, []
    forward = native.forward

    def counted(x, cos, sin, meta):
        rows.append(x.shape[1])
        return forward(x, cos, sin, meta)
    native.forward = counted
    return rows


@pytest.mark.parametrize("max_num_seqs", [1, 2, 4, 8])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_greedy_outputs_equal_the_naive_loop(max_num_seqs, kv_heads):
    model = random_model(seed=kv_heads, kv_heads=kv_heads)
    workload = mixed_workload(6, seed=max_num_seqs, max_out=12)
    engine = LLMEngine(model, None, engine_config(model="random", max_num_seqs=max_num_seqs))
    rows = count_native_steps(engine)
    ids = [engine.add_request(prompt, params) for prompt, params in workload]
    while engine.has_unfinished_requests():
        engine.step()
    assert [engine.get_request(i).output_token_ids for i in ids] == naive_outputs(model, workload)
    assert rows and max(rows) <= engine.runner.decode_step.max_rows  # the C layers ran, on small decode steps only
    if max_num_seqs >= 2:
        assert max(rows) >= 2  # several sequences in one C call happened too


def test_qkv_bias_and_a_sliding_window_equal_the_naive_loop():
    model = random_model(seed=3)
    cfg = copy.deepcopy(model.config)
    cfg.qkv_bias, cfg.sliding_window = True, 8
    windowed = type(model)(cfg).eval()
    windowed.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for layer in windowed.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    workload = mixed_workload(4, seed=5, max_out=20)  # outputs run past the window of 8
    engine, outputs = run_engine(windowed, workload, max_num_seqs=2)
    assert engine.runner.decode_step is not None
    assert list(outputs.values()) == naive_outputs(windowed, workload)


def hidden_after_layers(engine: LLMEngine, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `prompts` through the engine, then compute the next decode step's hidden state twice, through the
    Python layers and through the C ones, from the same inputs: ([M, E], [M, E])."""
    from engine.sampling import SamplingParams

    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)) for p in prompts]
    engine.step()  # the prefills; the next step is a decode of every prompt
    seen = {}

    def both(model, attention, input_ids, positions, meta, native_layers=None):
        assert native_layers is not None and native_layers.covers(meta)  # the runner's decode step
        x = model.embed_tokens(input_ids)
        cos, sin = model.rope(positions, x.dtype)
        python = x
        for layer in model.layers:
            python = layer(python, cos, sin, attention, meta)
        seen["python"], seen["c"] = python[0], native_layers.forward(x, cos, sin, meta)[0]
        return run_model(model, attention, input_ids, positions, meta)

    import engine.runner as runner_module

    original = runner_module.run_model
    runner_module.run_model = both
    try:
        engine.step()
    finally:
        runner_module.run_model = original
    for i in ids:
        engine.abort_request(i)
    return seen["python"], seen["c"]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("rows", [1, 2])
def test_the_c_layers_compute_what_the_python_layers_compute(dtype, tolerance, rows):
    """bf16: torch rounds after every op, and so does the C file; they differ only where a float sum's order
    flips a rounding (a bf16 step is 1/128 of the value, so 0.05 of the largest |x| is a few steps)."""
    model = random_model(seed=7).to(dtype)
    engine = LLMEngine(model, None, engine_config(model="random", dtype=str(dtype).removeprefix("torch.")))
    python, c = hidden_after_layers(engine, [[5, 9, 12, 40, 7], [3, 3, 8]][:rows])
    assert python.dtype == c.dtype == dtype and python.shape == c.shape == (rows, model.config.hidden_size)
    assert (python.float() - c.float()).abs().max() <= tolerance * python.float().abs().max()


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_quantized_layers_run_in_c_and_agree_with_python(scheme):
    """int8/int4 weights on the native kernel: the C layers call that very kernel. x is rounded to int8 per 32
    inputs inside it, so a last-bit difference upstream can move one rounding step: close, not equal."""
    model = random_model(seed=11)
    quantize_model(model, scheme, backend="native")
    engine = LLMEngine(model, None, engine_config(model="random"))
    assert engine.runner.decode_step is not None
    assert engine.runner.decode_step.max_rows == FUSED_MAX_ROWS  # beyond it, Python dequantizes for a GEMM
    python, c = hidden_after_layers(engine, [[5, 9, 12, 40, 7], [3, 3, 8]])
    assert (python - c).abs().max() <= 0.02 * python.abs().max()
    workload = mixed_workload(4, seed=2, max_out=10)
    _, outputs = run_engine(model, workload, max_num_seqs=2)
    _, python_outputs = run_engine(model, workload, max_num_seqs=2, layer_backend="python")
    assert list(outputs.values()) == list(python_outputs.values())


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_quantized_weights_with_bf16_activations_run_in_c(scheme):
    """Weight-only quantization of a bf16 model (the benchmark's "bf16 activations" rows): integer weights, bf16
    activations and KV pool. The C layers take the bf16 rows through the same quantized kernel; the tolerance is
    the bf16 one above, since x is rounded to bf16 after every op on both sides and to int8 inside the kernel."""
    model = random_model(seed=13).to(torch.bfloat16)
    quantize_model(model, scheme, backend="native")
    engine = LLMEngine(model, None, engine_config(model="random", dtype="bfloat16"))
    assert engine.runner.decode_step is not None
    python, c = hidden_after_layers(engine, [[5, 9, 12, 40, 7], [3, 3, 8]])
    assert python.dtype == c.dtype == torch.bfloat16
    assert (python.float() - c.float()).abs().max() <= 0.05 * python.float().abs().max()


@pytest.mark.parametrize("options,why", [
    (dict(kv_cache_dtype="int8"), "int8 KV"),
    (dict(attention_backend="sdpa"), "attention runs on 'sdpa'"),
    (dict(weight_layout="linear"), "not fused"),
])
def test_what_the_c_layers_cannot_run_keeps_the_python_layers(options, why):
    model = random_model()
    engine = LLMEngine(model, None, engine_config(model="random", **options))
    assert engine.runner.decode_step is None
    assert why in why_native_layers_cannot_run(engine.runner.model, engine.attention)
    workload = mixed_workload(3, seed=1, max_out=6)
    _, outputs = run_engine(model, workload, **options)
    assert list(outputs.values()) == naive_outputs(model, workload)


def test_a_quantized_layer_on_the_torch_backend_keeps_the_python_layers():
    model = random_model()
    quantize_model(model, "int8", backend="torch")
    engine = LLMEngine(model, None, engine_config(model="random"))
    assert engine.runner.decode_step is None
    assert "'torch' backend" in why_native_layers_cannot_run(engine.runner.model, engine.attention)


def test_layer_backend_python_turns_them_off_and_a_bad_name_is_refused():
    engine = LLMEngine(random_model(), None, engine_config(model="random", layer_backend="python"))
    assert engine.runner.decode_step is None
    assert engine.trace.config["layer_backend"] == "python"
    with pytest.raises(ValueError, match=r"layer_backend must be one of auto, python; got 'fast'"):
        engine_config(layer_backend="fast")


def test_a_new_model_in_the_runner_gets_new_descriptors():
    """engine.use_model(a pruned copy) (the lab's incidents do this): the C layers must follow it."""
    engine = LLMEngine(random_model(), None, engine_config(model="random"))
    assert len(engine.runner.decode_step.layers) == 2
    pruned = copy.copy(engine.model)
    pruned.layers = pruned.layers[:1]
    engine.use_model(pruned)
    assert len(engine.runner.decode_step.layers) == 1
    with pytest.raises(ValueError, match="cannot run this model"):
        NativeLayers(random_model(), engine.attention)  # not packed: the Python layers' job


def test_bad_step_arguments_name_the_field():
    engine = LLMEngine(random_model(), None, engine_config(model="random"))
    native, E, D = engine.runner.decode_step, 64, 16
    good = dict(x=torch.zeros(1, E), cos=torch.ones(1, D), sin=torch.zeros(1, D),
                slots=torch.zeros(1, dtype=torch.int64),
                block_tables=torch.zeros(1, 1, dtype=torch.int32), seq_lens=torch.ones(1, dtype=torch.int32))
    for name, bad in (("x", torch.zeros(1, E, dtype=torch.float64)), ("cos", torch.ones(2, D)),
                      ("slots", torch.zeros(1, dtype=torch.int32)), ("seq_lens", torch.ones(2, dtype=torch.int32))):
        with pytest.raises(ValueError, match=f"^{name}:"):
            decoder_layers_native(native.dims, native.layers, **(good | {name: bad}))

"""The whole paged engine on a CUDA GPU: the bundled model on the device, every attention backend, float and
int8 K/V, a sliding window and the host tier; greedy outputs equal the naive loop on the same device.
(Skipped without a GPU: conftest.py marks and says so.)"""

import pytest

from engine.companions.naive import generate_naive
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Q: What is 17 + 25?\nA:", "Once upon a time, a small robot", "Tell me a story about the sea."]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tinylab_on_gpu():
    model, tok = load_model("tinylab")
    return model.to("cuda"), tok


def run(model, tok, prompts, **options):
    engine = LLMEngine(model, tok, engine_config("tinylab", **{"block_size": 16, "num_blocks": 64, **options}))
    ids = [engine.add_request(tok.encode(p), PARAMS) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.usage().used_blocks == 0
    return [engine.get_request(i).output_token_ids for i in ids]


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton", "cuda"])
def test_engine_on_gpu_equals_the_naive_loop(tinylab_on_gpu, backend):
    model, tok = tinylab_on_gpu
    expected = [generate_naive(model, None, tok.encode(p), PARAMS).token_ids for p in PROMPTS]
    assert run(model, tok, PROMPTS, attention_backend=backend) == expected


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_engine_on_gpu_with_a_window_equals_the_naive_loop_with_that_window(tinylab_on_gpu, backend):
    model, tok = tinylab_on_gpu
    model.config.sliding_window = 8
    try:
        expected = [generate_naive(model, None, tok.encode(p), PARAMS).token_ids for p in PROMPTS]
    finally:
        model.config.sliding_window = None
    assert run(model, tok, PROMPTS, attention_backend=backend, sliding_window=8) == expected


def test_int8_kv_on_gpu_triton_equals_torch(tinylab_on_gpu):
    model, tok = tinylab_on_gpu
    assert run(model, tok, PROMPTS, attention_backend="triton", kv_cache_dtype="int8") == \
        run(model, tok, PROMPTS, attention_backend="torch", kv_cache_dtype="int8")


def one_at_a_time(model, tok, prompts, **options):
    """Each request alone (the next starts when the last finished): every forward has the same shape in
    any configuration whose prefix hits are the same, so the outputs must be bit-identical."""
    engine = LLMEngine(model, tok, engine_config("tinylab", block_size=16, **options))
    outputs = []
    for p in prompts:
        rid = engine.add_request(tok.encode(p), PARAMS)
        while engine.has_unfinished_requests():
            engine.step()
        outputs.append(engine.get_request(rid).output_token_ids)
    return outputs, engine


def test_host_tier_on_gpu_serves_the_same_hits_as_a_pool_that_holds_everything(tinylab_on_gpu):
    model, tok = tinylab_on_gpu
    docs = [f"Keeper {name} wrote every evening about the ships, the weather and the gulls. " * 3
            for name in ("Ada", "Bo", "Cy")]
    prompts = [d + "Who wrote?" for d in docs] * 2
    common = dict(attention_backend="triton", enable_prefix_caching=True)
    everything, _ = one_at_a_time(model, tok, prompts, num_blocks=64, **common)
    tiered, engine = one_at_a_time(model, tok, prompts, num_blocks=10, kv_offload_blocks=32, **common)
    assert tiered == everything
    assert engine.block_manager.num_reloaded > 0  # the small pool lost the documents; the host had them

"""Chapter 03: the cached loop gives exactly the naive loop's greedy tokens; the cache is the formula."""

import pytest
import torch

from engine.companions.kv_cache import (
    GROW_CHUNK_TOKENS,
    KVCache,
    SlidingWindowKVCache,
    forward_with_cache,
    generate_cached,
)
from engine.companions.memory import kv_cache_bytes
from engine.companions.naive import generate_naive
from engine.config import ModelConfig
from engine.model import LlamaModel
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def random_model(kv_heads: int, heads: int = 4, seed: int = 0, window=None, dtype=torch.float32):
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      sliding_window=window, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaModel(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # a sharper random model: logits far from ties, so greedy is stable
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return model.eval()


def prompts(n: int, vocab: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_cached_greedy_tokens_equal_the_naive_loop(kv_heads):
    model = random_model(kv_heads)
    for p in prompts(8, seed=kv_heads):
        naive = generate_naive(model, None, p, GREEDY)
        cached = generate_cached(model, None, p, GREEDY)
        assert cached.token_ids == naive.token_ids, f"prompt {p}"


def test_sliding_window_cache_equals_the_naive_loop_with_the_same_window():
    window = 8
    model = random_model(2, window=window)
    for p in prompts(6, seed=5):
        naive = generate_naive(model, None, p, GREEDY)  # the model's own windowed mask, full recompute
        ring = generate_cached(model, None, p, GREEDY, window=window)
        assert ring.token_ids == naive.token_ids


def test_the_window_really_forgets_old_tokens():
    """With a window the output differs from full attention once the sequence outgrows it."""
    model = random_model(2)
    p = prompts(1, seed=9)[0] + [5] * 20
    full = generate_cached(model, None, p, GREEDY)
    windowed = generate_cached(model, None, p, GREEDY, window=4)
    assert full.token_ids != windowed.token_ids


def test_batched_cache_matches_one_sequence_at_a_time():
    model = random_model(2)
    ids = torch.randint(2, 97, (3, 10), generator=torch.Generator().manual_seed(1))
    batch_cache = KVCache(model, batch=3)
    batched = forward_with_cache(model, batch_cache, ids)  # [3, V]
    for b in range(3):
        single = forward_with_cache(model, KVCache(model), ids[b:b + 1])
        torch.testing.assert_close(batched[b], single[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cache_bytes_equal_the_memory_formula(kv_heads, dtype):
    model = random_model(kv_heads, dtype=dtype)
    cfg = model.config
    cache = KVCache(model, batch=3, capacity=40)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    expected = kv_cache_bytes(cfg.num_hidden_layers, 3, 40, kv_heads, cfg.head_dim, dtype_bytes)
    assert cache.nbytes == expected


def test_cache_grows_by_chunks_and_keeps_its_contents():
    model = random_model(2, seed=3)
    cache = KVCache(model, capacity=4, max_tokens=128)
    ids = torch.randint(2, 97, (1, 6))
    forward_with_cache(model, cache, ids[:, :3])
    before = cache.k[:, :, :3].clone()
    forward_with_cache(model, cache, ids[:, 3:])  # 6 > 4: grows
    assert cache.capacity == min(128, GROW_CHUNK_TOKENS)
    assert torch.equal(cache.k[:, :, :3], before)


def test_tokens_beyond_capacity_raise_instead_of_corrupting():
    model = random_model(2)
    cache = KVCache(model, capacity=8, max_tokens=8)
    forward_with_cache(model, cache, torch.ones(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="KV cache full"):
        forward_with_cache(model, cache, torch.ones(1, 3, dtype=torch.long))
    assert cache.length == 6


def test_sliding_window_memory_stays_constant():
    model = random_model(2)
    cache = SlidingWindowKVCache(model, window=8)
    size = cache.nbytes
    for _ in range(5):
        forward_with_cache(model, cache, torch.ones(1, 7, dtype=torch.long))
    assert cache.nbytes == size and cache.length == 35

"""Chapter 04-05: the KV pool holds exactly the formula's bytes, is sized by memory as users expect,
does the block copies the scheduler asks for, says what it allocated, and rejects bad options by name."""

import logging
import math

import pytest
import torch

from engine.companions.memory import kv_cache_bytes
from engine.config import DEFAULT_KV_CACHE_MEMORY_BYTES, CacheConfig, ModelConfig
from engine.kv.kv_pool import PagedKVPool, default_kv_cache_memory_bytes, log_kv_cache, plan_num_blocks
from engine.llm_engine import LLMEngine, engine_config
from engine_fixtures import CONTEXT, random_model

GIB = 2**30
# SmolLM2-135M's shape (its config.json): what `LLM("<folder>")` meets with an 8k context.
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True)


def block_bytes_by_hand(cfg: ModelConfig, block_size: int, bytes_per_element: int) -> int:
    """K and V, every layer, block_size tokens, Hkv heads of D numbers each."""
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * bytes_per_element


@pytest.fixture(scope="module")
def model():
    return random_model(seed=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pools_hold_exactly_the_kv_cache_formula(dtype):
    pool = PagedKVPool(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                       num_swap_blocks=2)
    b = torch.tensor([], dtype=dtype).element_size()
    assert pool.nbytes == kv_cache_bytes(3, 1, 5 * 4, 2, 8, b) == 2 * 3 * 20 * 2 * 8 * b
    assert pool.swap_nbytes == kv_cache_bytes(3, 1, 2 * 4, 2, 8, b)
    assert pool.k[0].shape == (5, 4, 2, 8) and pool.k_swap[2].shape == (2, 4, 2, 8)  # [NB, BS, Hkv, D]


def test_move_blocks_swaps_out_swaps_in_and_copies_in_every_layer():
    pool = PagedKVPool(num_layers=2, num_blocks=6, block_size=2, num_kv_heads=1, head_dim=4, num_swap_blocks=3)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape))
    k0, v1 = [t.clone() for t in pool.k], [t.clone() for t in pool.v]
    pool.move_blocks(swap_out=[(4, 0), (1, 2)], swap_in=[], copies=[(3, 5)])
    for layer in range(2):
        assert torch.equal(pool.k_swap[layer][0], k0[layer][4]) and torch.equal(pool.k_swap[layer][2], k0[layer][1])
        assert torch.equal(pool.v_swap[layer][2], v1[layer][1])
        assert torch.equal(pool.k[layer][5], k0[layer][3]) and torch.equal(pool.v[layer][5], v1[layer][3])
        assert torch.equal(pool.k[layer][:5], k0[layer][:5])  # the sources are untouched
    pool.move_blocks(swap_out=[], swap_in=[(2, 0), (0, 3)], copies=[])
    for layer in range(2):
        assert torch.equal(pool.k[layer][0], k0[layer][1]) and torch.equal(pool.v[layer][3], v1[layer][4])


def test_the_engine_pool_is_as_big_as_its_block_tables_say(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=10, block_size=4, preemption_mode="swap",
                                                  swap_space_blocks=3))
    per_block = block_bytes_by_hand(model.config, 4, 4)
    assert engine.kv_pool.nbytes == 10 * per_block and engine.kv_pool.swap_nbytes == 3 * per_block
    assert engine.block_manager.allocator.num_blocks == 10 and engine.block_manager.swap_usage().total_blocks == 3
    assert engine.attention.kv_pool is engine.kv_pool
    assert engine.trace.config["cache"]["kv_cache_bytes"] == 10 * per_block


def test_a_byte_budget_gives_as_many_whole_blocks_as_fit(model):
    per_block = block_bytes_by_hand(model.config, 8, 4)
    budget = 7 * per_block + per_block - 1  # one byte short of an 8th block
    engine = LLMEngine(model, None, engine_config(kv_cache_memory_bytes=budget, block_size=8))
    assert engine.block_manager.allocator.num_blocks == 7
    assert engine.kv_pool.nbytes <= budget < engine.kv_pool.nbytes + per_block


def test_by_default_we_allocate_what_max_num_seqs_requests_need_when_it_is_below_the_budget(model):
    engine = LLMEngine(model, None, engine_config(block_size=8, max_num_seqs=3))
    assert engine.block_manager.allocator.num_blocks == 3 * math.ceil(CONTEXT / 8)


def test_by_default_an_8k_model_gets_the_1_gib_budget_not_16_full_contexts():
    blocks = plan_num_blocks(SMOLLM2, CacheConfig(), max_num_seqs=16, dtype=torch.float32, environ={})
    per_block = block_bytes_by_hand(SMOLLM2, 16, 4)
    assert DEFAULT_KV_CACHE_MEMORY_BYTES == 1 * GIB  # a laptop's share (vLLM's CPU backend takes 4 GiB)
    assert blocks == 1 * GIB // per_block and blocks < 16 * 8192 // 16  # 16 full contexts would need 6 GB
    assert blocks * per_block <= 1 * GIB


def test_the_env_var_sets_the_default_budget_in_gib(model, monkeypatch):
    per_block = block_bytes_by_hand(model.config, 4, 4)
    monkeypatch.setenv("SERVELAB_KVCACHE_SPACE", str(5 * per_block / GIB))  # room for exactly 5 blocks
    engine = LLMEngine(model, None, engine_config(block_size=4))
    assert engine.block_manager.allocator.num_blocks == 5
    assert default_kv_cache_memory_bytes({"SERVELAB_KVCACHE_SPACE": "0.5"}) == GIB // 2
    assert default_kv_cache_memory_bytes({}) == 1 * GIB


@pytest.mark.parametrize("value", ["lots", "0", "-1", "nan", "inf"])
def test_a_bad_env_var_is_rejected_by_name(model, monkeypatch, value):
    monkeypatch.setenv("SERVELAB_KVCACHE_SPACE", value)
    with pytest.raises(ValueError, match=r"SERVELAB_KVCACHE_SPACE=.*positive number of GiB"):
        LLMEngine(model, None, engine_config(block_size=4))


def test_a_budget_below_one_block_says_how_much_one_block_needs(model):
    per_block = block_bytes_by_hand(model.config, 4, 4)
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes = 100 bytes holds no KV block.*{per_block}"):
        LLMEngine(model, None, engine_config(kv_cache_memory_bytes=100, block_size=4))


def test_the_engine_logs_blocks_tokens_bytes_and_the_maximum_concurrency(caplog):
    odd = random_model(seed=5, context=90)  # 90 tokens = 22.5 blocks of 4: a request holds 23 whole blocks
    with caplog.at_level(logging.INFO, logger="engine"):
        LLMEngine(odd, None, engine_config(num_blocks=60, block_size=4))
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "engine")
    per_block = block_bytes_by_hand(odd.config, 4, 4)
    assert "60 blocks of 4 tokens = 240 tokens" in text
    assert f"{60 * per_block / GIB:.3f} GiB" in text
    concurrency = 60 / 23  # as vLLM counts it: whole blocks per full-length request (not 240 / 90)
    assert f"Maximum concurrency for 90 tokens per request: {concurrency:.2f}x" in text


def _small_pool_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "engine" and "fewer than one request" in r.getMessage()]


def test_a_default_sized_cache_smaller_than_one_full_request_is_a_warning(model, monkeypatch, caplog):
    # the default budget, here set too small through the env var: a misconfiguration the user must see
    block = block_bytes_by_hand(model.config, 16, 4)
    monkeypatch.setenv("SERVELAB_KVCACHE_SPACE", str(3 * block / GIB))  # three blocks: 48 tokens
    with caplog.at_level(logging.INFO, logger="engine"):
        LLMEngine(model, None, engine_config())
    [record] = _small_pool_records(caplog)
    assert record.levelno == logging.WARNING and "holds 48 tokens" in record.getMessage()
    assert f"max_model_len={CONTEXT}" in record.getMessage() and "raise kv_cache_memory_bytes" in record.getMessage()


@pytest.mark.parametrize("cache, says", [
    (CacheConfig(num_blocks=5, block_size=4), "num_blocks=5"),
    (CacheConfig(kv_cache_memory_bytes=10**4, block_size=4), "kv_cache_memory_bytes=10000"),
    (None, None),
    (CacheConfig(block_size=4), None),
])
def test_a_pool_sized_small_on_purpose_is_info_and_only_our_own_sizing_warns(cache, says, caplog):
    pool = PagedKVPool(num_layers=1, num_blocks=5, block_size=4, num_kv_heads=1, head_dim=2)
    with caplog.at_level(logging.INFO, logger="engine"):
        log_kv_cache(pool, max_model_len=64, cache=cache)
    [record] = _small_pool_records(caplog)
    assert "holds 20 tokens" in record.getMessage() and "max_model_len=64" in record.getMessage()
    if says is None:
        assert record.levelno == logging.WARNING
    else:
        assert record.levelno == logging.INFO and f"({says})" in record.getMessage()


def test_a_pool_that_holds_one_full_request_says_nothing_about_it(caplog):
    pool = PagedKVPool(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=2)
    with caplog.at_level(logging.INFO, logger="engine"):
        log_kv_cache(pool, max_model_len=64)  # 16 blocks x 4 = 64 tokens: exactly one request
    assert _small_pool_records(caplog) == []


@pytest.mark.parametrize("option, value, allowed", [
    ("num_blocks", 2.5, "integer >= 1 or None"),
    ("num_blocks", True, "integer >= 1 or None"),
    ("num_blocks", 0, "integer >= 1 or None"),
    ("block_size", "4", "power-of-two integer"),
    ("block_size", 3, "power-of-two integer"),
    ("kv_cache_memory_bytes", -1, "integer >= 1 or None"),
    ("kv_cache_memory_bytes", 1.5e9, "integer >= 1 or None"),
    ("swap_space_blocks", "x", "integer >= 0 or None"),
])
def test_a_bad_cache_option_names_the_option_and_the_allowed_values(option, value, allowed):
    with pytest.raises(ValueError) as err:
        engine_config(**{option: value})
    assert option in str(err.value) and allowed in str(err.value) and repr(value) in str(err.value)


def test_num_blocks_and_a_byte_budget_together_are_rejected_naming_both():
    with pytest.raises(ValueError, match="num_blocks=8 and kv_cache_memory_bytes=4096.*only one"):
        CacheConfig(num_blocks=8, kv_cache_memory_bytes=4096)

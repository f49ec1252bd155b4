"""Chapter 02-03: byte counts of weights, KV cache and activations, and capacity planning.

Expected numbers are worked out by hand in the comments (or come from published model cards),
never copied from the code's output.
"""

import dataclasses
import json

import pytest
import torch

from engine.companions.memory import (
    DTYPE_BYTES,
    GPU_MEMORY_GB,
    activation_breakdown,
    activation_bytes,
    cached_tokens_per_sequence,
    dtype_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    max_cached_tokens,
    max_concurrent_sequences,
    plan_memory,
    weight_bytes,
)
from engine.config import MODEL_PRESETS, ModelConfig
from engine.loading.loader import read_config

GB = 10**9

# (layers, batch, tokens, kv_heads, head_dim): a spread of small cache shapes for real tensors.
SMALL_CACHES = [(1, 1, 1, 1, 1), (2, 3, 5, 2, 8), (4, 2, 17, 4, 16), (3, 1, 64, 1, 32)]


def test_kv_formula_matches_hand_computation_for_llama2_7b():
    # 2 (K, V) * 32 layers * 1 seq * 4096 tokens * 32 KV heads * 128 dims * 2 bytes
    # = 2 * 32 * 32 * 128 * 2 bytes per token = 524288 B = 0.5 MiB; * 4096 tokens = 2 GiB.
    assert kv_cache_bytes(32, 1, 4096, 32, 128, 2) == 2 * 2**30


def test_kv_formula_is_linear_in_every_factor():
    base = kv_cache_bytes(2, 3, 5, 2, 8, 2)
    assert kv_cache_bytes(4, 3, 5, 2, 8, 2) == 2 * base
    assert kv_cache_bytes(2, 6, 5, 2, 8, 2) == 2 * base
    assert kv_cache_bytes(2, 3, 10, 2, 8, 2) == 2 * base
    assert kv_cache_bytes(2, 3, 5, 4, 8, 2) == 2 * base
    assert kv_cache_bytes(2, 3, 5, 2, 16, 2) == 2 * base
    assert kv_cache_bytes(2, 3, 5, 2, 8, 4) == 2 * base


@pytest.mark.parametrize("torch_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layers,batch,tokens,kv_heads,head_dim", SMALL_CACHES)
def test_kv_formula_equals_nbytes_of_a_real_cache_tensor(torch_dtype, layers, batch, tokens, kv_heads,
                                                          head_dim):
    cache = torch.empty(layers, 2, batch, tokens, kv_heads, head_dim, dtype=torch_dtype)
    b = dtype_bytes(torch_dtype)
    assert kv_cache_bytes(layers, batch, tokens, kv_heads, head_dim, b) == cache.nbytes


def test_int4_cache_is_half_of_int8_and_a_quarter_of_fp16():
    int8 = kv_cache_bytes(3, 1, 7, 1, 5, 1)  # odd element count: 2*3*7*5 = 210
    assert int8 == 210
    assert kv_cache_bytes(3, 1, 7, 1, 5, 0.5) == 105
    assert kv_cache_bytes(3, 1, 7, 1, 5, 2) == 420


def test_kv_formula_stays_exact_for_huge_caches():
    # Odd factors and int4: 81 * 999_999 * 131_071 * 7 * 127 elements (2 * ... * 0.5 bytes),
    # beyond 2**53, where a float product would round the last digits.
    expected = 81 * 999_999 * 131_071 * 7 * 127
    assert expected > 2**53
    assert kv_cache_bytes(81, 999_999, 131_071, 7, 127, 0.5) == expected


@pytest.mark.parametrize("field,position", [("layers", 0), ("batch", 1), ("tokens", 2), ("kv_heads", 3),
                                             ("head_dim", 4)])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_kv_formula_rejects_a_bad_count_and_names_the_field(field, position, bad):
    args = [2, 3, 5, 2, 8, 2]
    args[position] = bad
    with pytest.raises(ValueError, match=rf"{field} must be a positive int.*got {bad!r}"):
        kv_cache_bytes(*args)


@pytest.mark.parametrize("bad", [3, 0, 8, 0.25, True])
def test_kv_formula_rejects_an_unknown_element_size_and_lists_the_allowed_ones(bad):
    with pytest.raises(ValueError, match=r"dtype_bytes must be one of \(0\.5, 1, 2, 4\)"):
        kv_cache_bytes(2, 3, 5, 2, 8, bad)


def test_dtype_bytes_knows_names_aliases_torch_dtypes_and_numbers():
    assert DTYPE_BYTES == {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1, "int4": 0.5}
    assert [dtype_bytes(n) for n in ("fp32", "BF16", "float16", "bfloat16", "int8", "fp8", "int4")] == \
        [4, 2, 2, 2, 1, 1, 0.5]
    assert dtype_bytes(torch.float32) == 4
    assert dtype_bytes(torch.bfloat16) == 2
    assert dtype_bytes(torch.int8) == 1
    assert dtype_bytes(0.5) == 0.5


@pytest.mark.parametrize("bad", ["fp12", 3, None])
def test_dtype_bytes_rejects_unknown_dtypes_and_says_what_is_allowed(bad):
    with pytest.raises(ValueError, match="dtype_bytes: dtype must be"):
        dtype_bytes(bad)


# Published parameter counts (model cards / Hugging Face "Model size"); we require 1%.
PUBLISHED_PARAMS = {
    "Llama-2-7B": 6.74e9,
    "Llama-3-8B": 8.03e9,
    "Llama-3-70B": 70.6e9,
    "Mistral-7B-v0.1": 7.24e9,
    "Qwen2.5-7B": 7.61e9,
    "SmolLM2-135M": 134.5e6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_matches_the_published_one(name):
    assert MODEL_PRESETS[name].num_params() == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def test_smollm2_parameter_count_by_hand():
    # Embedding 49152 * 576 = 28_311_552 (tied: no separate LM head).
    # Per layer: q, o 576*576 each; k, v 576*192 each (3 KV heads * 64); MLP 3 * 576 * 1536;
    # norms 2 * 576  ->  331_776*2 + 110_592*2 + 2_654_208 + 1_152 = 3_540_096; * 30 = 106_202_880.
    # Final norm 576.  Total 28_311_552 + 106_202_880 + 576 = 134_515_008.
    assert MODEL_PRESETS["SmolLM2-135M"].num_params() == 134_515_008


def test_llama3_8b_parameter_count_is_exactly_the_published_8_030_261_248():
    # Hugging Face lists meta-llama/Meta-Llama-3-8B at 8,030,261,248 parameters.
    assert MODEL_PRESETS["Llama-3-8B"].num_params() == 8_030_261_248


def test_untying_the_embeddings_adds_a_vocab_by_hidden_lm_head():
    tied = MODEL_PRESETS["SmolLM2-135M"]
    untied = dataclasses.replace(tied, tie_word_embeddings=False)
    assert untied.num_params() - tied.num_params() == 49152 * 576


def test_qkv_bias_adds_one_bias_per_projected_output_per_layer():
    qwen = MODEL_PRESETS["Qwen2.5-7B"]
    no_bias = dataclasses.replace(qwen, qkv_bias=False)
    # q has 28 * 128 = 3584 outputs, k and v 4 * 128 = 512 each: 4608 per layer, 28 layers.
    assert qwen.num_params() - no_bias.num_params() == 4608 * 28


def test_presets_carry_the_published_config_json_numbers():
    llama3 = MODEL_PRESETS["Llama-3-8B"]
    assert (llama3.num_hidden_layers, llama3.hidden_size, llama3.num_attention_heads, llama3.num_key_value_heads,
            llama3.head_dim, llama3.intermediate_size, llama3.vocab_size, llama3.max_position_embeddings) == \
        (32, 4096, 32, 8, 128, 14336, 128256, 8192)
    assert MODEL_PRESETS["Mistral-7B-v0.1"].sliding_window == 4096
    assert MODEL_PRESETS["Qwen2.5-7B"].qkv_bias and MODEL_PRESETS["Qwen2.5-7B"].num_key_value_heads == 4
    smol = MODEL_PRESETS["SmolLM2-135M"]
    assert smol.tie_word_embeddings and smol.head_dim == 64
    for name, config in MODEL_PRESETS.items():
        assert config.name == name
        assert config.head_dim * config.num_attention_heads == config.hidden_size


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_num_params_is_the_breakdown_summed_and_the_real_model_count(name):
    # One formula: num_params adds up param_breakdown, and both agree with the parameters of the
    # decoder that engine/model.py builds from the same config (on the meta device: no memory).
    from engine.model import LlamaModel

    config = MODEL_PRESETS[name]
    with torch.device("meta"):
        model = LlamaModel(config)
    assert config.num_params() == sum(config.param_breakdown().values())
    assert config.num_params() == sum(p.numel() for p in model.parameters())


MISTRAL_CONFIG = {  # the fields of mistralai/Mistral-7B-v0.1's config.json that we read
    "model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
    "max_position_embeddings": 32768, "sliding_window": 4096, "tie_word_embeddings": False,
}
QWEN_CONFIG = {  # Qwen/Qwen2.5-7B-Instruct: a window is written down but switched off
    "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
    "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
    "max_position_embeddings": 32768, "sliding_window": 131072, "use_sliding_window": False,
    "tie_word_embeddings": False,
}


def test_reading_the_config_json_rebuilds_the_presets():
    # The presets set only the size-deciding fields; so do these dicts, so everything else is a default.
    mistral = ModelConfig.from_hf_dict(MISTRAL_CONFIG)
    qwen = ModelConfig.from_hf_dict(QWEN_CONFIG)
    assert dataclasses.replace(mistral, name="Mistral-7B-v0.1") == MODEL_PRESETS["Mistral-7B-v0.1"]
    assert dataclasses.replace(qwen, name="Qwen2.5-7B") == MODEL_PRESETS["Qwen2.5-7B"]


def test_a_config_json_without_kv_heads_means_multi_head_attention():
    config = {k: v for k, v in MISTRAL_CONFIG.items() if k not in ("num_key_value_heads", "sliding_window")}
    shape = ModelConfig.from_hf_dict(config)
    assert shape.num_key_value_heads == 32 and shape.sliding_window is None
    assert kv_bytes_per_token(shape, "fp16") == 4 * kv_bytes_per_token(MODEL_PRESETS["Mistral-7B-v0.1"], "fp16")


def test_reading_a_config_json_names_the_missing_field(tmp_path):
    config = {k: v for k, v in MISTRAL_CONFIG.items() if k != "vocab_size"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocab_size"):
        read_config(tmp_path)


def test_a_config_rejects_kv_heads_that_do_not_divide_heads():
    with pytest.raises(ValueError, match=r"num_attention_heads \(32\) must be a multiple of num_key_value_heads \(5\)"):
        dataclasses.replace(MODEL_PRESETS["Llama-3-8B"], num_key_value_heads=5)


def test_a_config_rejects_a_zero_layer_count():
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer, got 0"):
        dataclasses.replace(MODEL_PRESETS["Llama-3-8B"], num_hidden_layers=0)


def test_kv_per_token_shows_what_gqa_saves():
    # Llama-3-8B: 2 * 32 layers * 8 KV heads * 128 dims * 2 bytes = 131072 B per token.
    assert kv_bytes_per_token(MODEL_PRESETS["Llama-3-8B"], "fp16") == 131072
    # Llama-2-7B, same layers and head dim but 32 KV heads: four times as much.
    assert kv_bytes_per_token(MODEL_PRESETS["Llama-2-7B"], "fp16") == 4 * 131072
    assert kv_bytes_per_token(MODEL_PRESETS["Llama-3-8B"], "int8") == 65536


def test_weight_bytes_of_llama3_8b_in_fp16_is_about_16_gb():
    assert weight_bytes(MODEL_PRESETS["Llama-3-8B"], "fp16") == 2 * 8_030_261_248  # 16.06 GB
    assert weight_bytes(MODEL_PRESETS["Llama-3-8B"], "int4") == 8_030_261_248 // 2


def test_activation_bytes_by_hand_for_a_tiny_shape():
    shape = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=2, max_position_embeddings=32,
                        tie_word_embeddings=True)
    # per token: hidden 2*8 = 16, qkv (4 + 2*2) * 2 = 16, attention out 4*2 = 8, mlp 3*16 = 48,
    # logits 10: 98 elements; 5 tokens in fp32 -> 98 * 5 * 4 = 1960 bytes.
    assert activation_bytes(shape, 5, "fp32") == 1960
    assert activation_breakdown(shape, 5, "fp32")["logits"] == 10 * 5 * 4
    assert activation_bytes(shape, 10, "fp16") == 1960


def test_llama3_8b_fp16_on_an_80_gb_card_holds_52_chats_of_8k_tokens():
    # Usable: 80e9 * 0.9 = 72e9 B. Weights 16_060_522_496 B. KV budget 55_939_477_504 B.
    # / 131072 B per token = 426_784.3 -> 426_784 tokens; / 8192 per chat = 52.1 -> 52.
    shape = MODEL_PRESETS["Llama-3-8B"]
    gpu = GPU_MEMORY_GB["80 GB (A100/H100)"] * GB
    assert max_cached_tokens(shape, gpu, "fp16", "fp16", reserve_fraction=0.1) == 426_784
    assert max_concurrent_sequences(shape, gpu, 8192, "fp16", "fp16", reserve_fraction=0.1) == 52
    plan = plan_memory(shape, gpu, "fp16", "fp16", reserve_fraction=0.1)
    assert plan.reserve_bytes == 8 * GB
    assert plan.weight_bytes + plan.reserve_bytes + plan.kv_budget_bytes == gpu


def test_an_int8_kv_cache_doubles_the_capacity():
    # Same budget, 65536 B per token: 55_939_477_504 / 65536 = 853_568.7 -> 853_568 tokens, 104 chats.
    shape = MODEL_PRESETS["Llama-3-8B"]
    assert max_cached_tokens(shape, 80 * GB, "fp16", "int8", reserve_fraction=0.1) == 853_568
    assert max_concurrent_sequences(shape, 80 * GB, 8192, "fp16", "int8", reserve_fraction=0.1) == 104


def test_a_24_gb_card_holds_only_five_8k_chats_of_llama3_8b():
    # 24e9 * 0.9 = 21.6e9; - 16_060_522_496 = 5_539_477_504; / 131072 = 42_262.9 -> 42_262; / 8192 = 5.2.
    shape = MODEL_PRESETS["Llama-3-8B"]
    assert max_cached_tokens(shape, 24 * GB, "fp16", "fp16", reserve_fraction=0.1) == 42_262
    assert max_concurrent_sequences(shape, 24 * GB, 8192, "fp16", "fp16", reserve_fraction=0.1) == 5


def test_the_reserve_fraction_is_taken_before_the_kv_budget():
    # No reserve: 80e9 - 16_060_522_496 = 63_939_477_504; / 131072 = 487_819.5 -> 487_819 tokens.
    assert max_cached_tokens(MODEL_PRESETS["Llama-3-8B"], 80 * GB, "fp16", "fp16", reserve_fraction=0) == 487_819


def test_llama3_70b_in_fp16_does_not_fit_on_one_80_gb_card():
    with pytest.raises(ValueError, match=r"Llama-3-70B: the weights alone need 141\.\d GB"):
        max_concurrent_sequences(MODEL_PRESETS["Llama-3-70B"], 80 * GB, 8192, "fp16", "fp16")


def test_a_sliding_window_caps_what_each_sequence_caches():
    mistral = MODEL_PRESETS["Mistral-7B-v0.1"]
    assert cached_tokens_per_sequence(mistral, 32768) == 4096
    assert cached_tokens_per_sequence(mistral, 1000) == 1000
    tokens = max_cached_tokens(mistral, 80 * GB, "fp16", "fp16")
    assert max_concurrent_sequences(mistral, 80 * GB, 32768, "fp16", "fp16") == tokens // 4096


def test_plan_memory_rejects_a_reserve_fraction_outside_zero_to_one():
    with pytest.raises(ValueError, match="reserve_fraction must be in"):
        plan_memory(MODEL_PRESETS["SmolLM2-135M"], 24 * GB, "fp16", "fp16", reserve_fraction=1.0)

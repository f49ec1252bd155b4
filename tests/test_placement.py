"""Chapter 08: which TP x PP x replica layouts fit, with memory, KV capacity and traffic per token.

Every expected number is worked out here by hand from the published config.json numbers (written
out below), not read back from engine/companions/placement.py.
"""

import re

import pytest

from engine.companions import memory
from engine.companions.placement import (
    DEVICE_PRESETS,
    INTERCONNECT_PRESETS,
    Device,
    Interconnect,
    allreduce_bytes_per_token,
    candidate_layouts,
    explain,
    feasible_layouts,
    layouts_table,
    pipeline_bytes_per_token,
    plan_layout,
    stage_layer_counts,
    stage_memory_plans,
)
from engine.config import MODEL_PRESETS

GB = 10**9
BF16 = 2  # bytes
H100_BYTES = 80 * GB
RESERVE = H100_BYTES // 10  # 10% activation reserve, as vLLM's gpu_memory_utilization=0.9
NVLINK4_PER_DIRECTION = 900e9 / 2  # the H100 datasheet's 900 GB/s counts both directions

# meta-llama/Meta-Llama-3-70B config.json
E70, L70, H70, HKV70, D70, I70, V70 = 8192, 80, 64, 8, 128, 28672, 128256
# meta-llama/Meta-Llama-3-8B config.json
E8, L8, H8, HKV8, D8, I8, V8 = 4096, 32, 32, 8, 128, 14336, 128256
CONTEXT = 8192  # both Llama-3 models' max_position_embeddings


def llama_layer_params(E, H, Hkv, D, I, tp=1):
    """One layer on one of `tp` GPUs: Wq, Wo [E, H*D] and Wk, Wv [E, Hkv*D] and the three MLP
    matrices [E, I], split tp ways; the two RMSNorm weights [E] stay whole on every GPU."""
    return (2 * E * H * D + 2 * E * Hkv * D + 3 * E * I) // tp + 2 * E


def llama70_tp_weight_bytes(tp):
    """Llama-3-70B bf16 on each of `tp` GPUs: 80 layers, embedding and LM head (vocabulary rows
    split tp ways), the final norm [E]."""
    params = L70 * llama_layer_params(E70, H70, HKV70, D70, I70, tp) + 2 * (V70 // tp) * E70 + E70
    return params * BF16


def sequences_by_hand(weight_bytes, kv_bytes_per_token):
    tokens = (H100_BYTES - RESERVE - weight_bytes) // kv_bytes_per_token
    return tokens // CONTEXT


def layout(model, num_devices, tp, pp=1, **kw):
    return plan_layout(model, "H100-SXM-80GB", num_devices, "NVLink4", tp, pp, **kw)


# ---- the 70B story: one card is not enough, two are barely, four and eight leave room ----------------


def test_llama3_70b_in_bf16_does_not_fit_on_one_h100():
    x = layout("Llama-3-70B", 8, tp=1)
    # 80 x 855,654,400 + 2 x 1,050,673,152 + 8192 = 70,553,706,496 parameters = 141.1 GB
    assert x.weight_bytes_per_device == llama70_tp_weight_bytes(1) == 141_107_412_992
    assert not x.fits and "weights need 141.1 GB" in x.reason
    assert all(y.tp * y.pp > 1 for y in feasible_layouts("Llama-3-70B", "H100-SXM-80GB", 8, "NVLink4"))


def test_llama3_70b_tp2_fits_the_weights_but_leaves_room_for_one_sequence():
    x = layout("Llama-3-70B", 8, tp=2)
    weights = llama70_tp_weight_bytes(2)
    assert x.weight_bytes_per_device == weights
    assert 70.5 * GB < weights < 70.6 * GB
    kv_per_token = 2 * L70 * (HKV70 // 2) * D70 * BF16  # K and V, 4 of the 8 KV heads per GPU
    assert x.kv_bytes_per_token_per_device == kv_per_token == 163_840
    assert x.kv_budget_bytes_per_device == H100_BYTES - RESERVE - weights  # about 1.44 GB
    assert x.kv_tokens_per_replica == (H100_BYTES - RESERVE - weights) // kv_per_token
    assert x.fits and x.sequences_per_replica == sequences_by_hand(weights, kv_per_token) == 1
    assert (x.replicas, x.idle_devices, x.sequences) == (4, 0, 4)


@pytest.mark.parametrize("tp, replicas", [(4, 2), (8, 1)])
def test_llama3_70b_tp4_and_tp8_fit_with_far_more_kv(tp, replicas):
    x = layout("Llama-3-70B", 8, tp=tp)
    weights = llama70_tp_weight_bytes(tp)
    kv_per_token = 2 * L70 * (HKV70 // tp) * D70 * BF16
    assert x.weight_bytes_per_device == weights
    assert x.kv_bytes_per_token_per_device == kv_per_token
    assert x.sequences_per_replica == sequences_by_hand(weights, kv_per_token)
    assert x.sequences_per_replica > 50  # TP=4: 54 chats of 8k per replica; TP=8: 162
    assert x.replicas == replicas and x.sequences == replicas * x.sequences_per_replica


def test_a_longer_context_than_the_kv_left_is_rejected_with_its_reason():
    x = layout("Llama-3-70B", 8, tp=2, context_tokens=2 * CONTEXT)
    tokens = (H100_BYTES - RESERVE - llama70_tp_weight_bytes(2)) // 163_840  # 8,819 < 16,384
    assert not x.fits and f"{tokens:,} tokens per replica, less than one sequence" in x.reason


def test_an_8b_model_fits_on_one_h100_with_room_for_dozens_of_chats():
    # 32 x 218,112,000 + 2 x 525,336,576 + 4096 = 8,030,261,248 parameters = 16.1 GB in bf16
    weights = (L8 * llama_layer_params(E8, H8, HKV8, D8, I8) + 2 * V8 * E8 + E8) * BF16
    kv_per_token = 2 * L8 * HKV8 * D8 * BF16  # 131,072 bytes
    x = layout("Llama-3-8B", 8, tp=1)
    assert x.weight_bytes_per_device == weights == 16_060_522_496
    assert x.fits and x.sequences_per_replica == sequences_by_hand(weights, kv_per_token) == 52
    best = feasible_layouts("Llama-3-8B", "H100-SXM-80GB", 8, "NVLink4")[0]
    assert (best.tp, best.pp, best.replicas) == (1, 1, 8)  # fewest GPUs per replica first


def test_a_single_gpu_layout_agrees_with_engine_memory():
    config = MODEL_PRESETS["Qwen2.5-7B"]
    x = plan_layout(config, "L4-24GB", 1, "PCIe4-x16", tp=1, context_tokens=4096)
    plan = memory.plan_memory(config, 24 * GB, "bf16", "bf16")
    assert x.weight_bytes_per_device == memory.weight_bytes(config, "bf16")
    assert x.kv_tokens_per_replica == plan.max_cached_tokens
    assert x.sequences_per_replica == memory.max_concurrent_sequences(config, 24 * GB, 4096, "bf16", "bf16")


# ---- what may not be split ---------------------------------------------------------------------------


def test_tp_that_does_not_divide_the_query_heads_is_rejected_with_its_reason():
    x = layout("Llama-3-70B", 8, tp=3)  # 64 heads / 3
    assert not x.fits and "num_attention_heads=64" in x.reason
    assert x.weight_bytes_per_device is None and x.sequences == 0
    assert all(y.tp in (1, 2, 4, 8) for y in feasible_layouts("Llama-3-70B", "H100-SXM-80GB", 8, "NVLink4"))


def test_tp_that_splits_query_heads_but_not_kv_heads_is_rejected():
    x = plan_layout("Qwen2.5-7B", "L4-24GB", 7, "PCIe4-x16", tp=7)  # 28 query heads / 7 = 4, but 4 KV heads / 7
    assert not x.fits and "num_key_value_heads=4" in x.reason


def test_tp_beyond_the_kv_heads_keeps_one_copied_kv_head_per_gpu():
    tp8, tp16 = layout("Llama-3-8B", 16, tp=8), layout("Llama-3-8B", 16, tp=16)
    assert tp8.kv_heads_per_device == tp16.kv_heads_per_device == 1  # 8 KV heads; at TP=16 each is on 2 GPUs
    assert tp16.fits and tp16.kv_bytes_per_token_per_device == 2 * L8 * 1 * D8 * BF16 == 16_384
    assert tp8.kv_bytes_per_token_per_device == tp16.kv_bytes_per_token_per_device  # stops shrinking


def test_tp_that_does_not_divide_the_mlp_is_rejected():
    # SmolLM2-135M: 9 heads, 3 KV heads (TP=9 would copy them), but intermediate_size 1536 / 9 is not whole
    x = plan_layout("SmolLM2-135M", "L4-24GB", 9, "PCIe4-x16", tp=9)
    assert not x.fits and "intermediate_size=1536" in x.reason


def test_pp_beyond_the_layers_is_rejected_and_pp_equal_to_them_fits():
    assert "num_hidden_layers=30" in plan_layout("SmolLM2-135M", "L4-24GB", 31, "PCIe4-x16", 1, 31).reason
    assert plan_layout("SmolLM2-135M", "L4-24GB", 30, "PCIe4-x16", 1, 30).fits


def test_idle_gpus_are_allowed_and_counted():
    for x in candidate_layouts("SmolLM2-135M", "L4-24GB", 8, "PCIe4-x16"):
        assert x.tp * x.pp * x.replicas + x.idle_devices == 8 and x.idle_devices < x.tp * x.pp
    tp3 = plan_layout("SmolLM2-135M", "L4-24GB", 8, "PCIe4-x16", tp=3)  # 9 heads, 3 KV heads
    assert tp3.fits and (tp3.replicas, tp3.idle_devices) == (2, 2)


# ---- pipeline stages --------------------------------------------------------------------------------------


def test_uneven_pipeline_puts_the_extra_layers_before_the_last_stage():
    assert stage_layer_counts(80, 3) == [27, 27, 26]  # vLLM's get_pp_indices
    assert stage_layer_counts(30, 4) == [7, 8, 8, 7]
    assert stage_layer_counts(80, 8) == [10] * 8


def test_pipeline_ends_carry_the_embedding_and_the_lm_head():
    plans = stage_memory_plans("Llama-3-70B", "H100-SXM-80GB", tp=1, pp=8)
    layer = llama_layer_params(E70, H70, HKV70, D70, I70)
    assert plans[0].weight_bytes == (10 * layer + V70 * E70) * BF16  # embedding
    assert plans[3].weight_bytes == 10 * layer * BF16  # a middle stage: layers only
    assert plans[-1].weight_bytes == (10 * layer + V70 * E70 + E70) * BF16  # LM head and final norm
    assert layout("Llama-3-70B", 8, tp=1, pp=8).weight_bytes_per_device == plans[-1].weight_bytes


def test_the_tightest_stage_decides_the_kv_capacity():
    # PP=3 splits 80 layers 27 / 27 / 26; stage 0 has 27 layers and the embedding: the least KV room
    # and the most KV bytes per token, and every stage must hold each token's KV for its own layers.
    stage0_weights = (27 * llama_layer_params(E70, H70, HKV70, D70, I70) + V70 * E70) * BF16
    stage0_kv_per_token = 2 * 27 * HKV70 * D70 * BF16  # 110,592 bytes
    x = layout("Llama-3-70B", 3, tp=1, pp=3)
    assert x.weight_bytes_per_device == stage0_weights
    assert x.kv_tokens_per_replica == (H100_BYTES - RESERVE - stage0_weights) // stage0_kv_per_token


def test_a_tied_embedding_is_copied_to_the_last_stage():
    config = MODEL_PRESETS["SmolLM2-135M"]  # tie_word_embeddings: true, vocab 49152, hidden 576
    plans = stage_memory_plans(config, "L4-24GB", tp=1, pp=2, weight_dtype="fp32")
    assert sum(p.weight_bytes for p in plans) == memory.weight_bytes(config, "fp32") + 49152 * 576 * 4


# ---- communication per token -------------------------------------------------------------------------


def test_allreduce_bytes_per_token_follow_the_ring_formula():
    # Llama-3-70B, TP=8, bf16: each all-reduce is one token's [8192] output = 16,384 bytes; a ring
    # sends 2 x 7/8 of it per GPU = 28,672; two all-reduces in each of 80 layers = 4,587,520 bytes.
    assert allreduce_bytes_per_token("Llama-3-70B", 8, "bf16") == 80 * 2 * 28_672 == 4_587_520
    assert allreduce_bytes_per_token("Llama-3-70B", 2, "bf16") == 80 * 2 * 16_384  # 2 x 1/2 x message
    assert allreduce_bytes_per_token("Llama-3-70B", 1, "bf16") == 0


def test_pipeline_bytes_per_token_are_one_hidden_state_per_boundary():
    assert pipeline_bytes_per_token("Llama-3-70B", 4, "bf16") == 3 * 8192 * 2
    assert pipeline_bytes_per_token("Llama-3-70B", 1, "bf16") == 0


def test_layout_time_is_bytes_over_the_per_direction_link():
    x = layout("Llama-3-70B", 8, tp=4, pp=2)
    tp_bytes = 80 * 2 * (2 * 3 / 4) * 8192 * 2  # 3,932,160
    pp_bytes = 1 * 8192 * 2
    assert x.tp_bytes_per_token == tp_bytes and x.pp_bytes_per_token == pp_bytes
    assert x.comm_s_per_token == pytest.approx((tp_bytes + pp_bytes) / NVLINK4_PER_DIRECTION)


def test_int4_weights_still_send_bf16_activations():
    x = layout("Llama-3-70B", 8, tp=2, weight_dtype="int4")
    assert x.tp_bytes_per_token == 80 * 2 * 16_384  # activations stay 2 bytes
    assert x.weight_bytes_per_device == llama70_tp_weight_bytes(2) // 4  # 0.5 bytes a parameter


def test_presets_state_the_datasheet_numbers_per_direction():
    assert INTERCONNECT_PRESETS["NVLink4"].bytes_per_s == NVLINK4_PER_DIRECTION
    assert INTERCONNECT_PRESETS["PCIe5-x16"].bytes_per_s == 64e9
    assert INTERCONNECT_PRESETS["100GbE"].bytes_per_s == 12.5e9
    h100 = DEVICE_PRESETS["H100-SXM-80GB"]
    assert (h100.memory_bytes, h100.bandwidth_bytes_per_s) == (80 * GB, 3.35e12)
    assert h100.roofline().peak_flops == h100.peak_flops


# ---- order and reading --------------------------------------------------------------------------------


def test_feasible_layouts_come_fewest_gpus_per_replica_first_then_most_sequences():
    fits = feasible_layouts("Llama-3-70B", "H100-SXM-80GB", 8, "NVLink4")
    keys = [(x.devices_per_replica, -x.sequences) for x in fits]
    assert keys == sorted(keys) and all(x.fits for x in fits)
    everything = candidate_layouts("Llama-3-70B", "H100-SXM-80GB", 8, "NVLink4")
    assert everything[:len(fits)] == fits and not any(x.fits for x in everything[len(fits):])
    assert len(everything) == sum(8 // tp for tp in range(1, 9))  # every (TP, PP) with TP x PP <= 8


def test_explain_and_table_say_what_fits_and_why_not():
    fits, impossible = layout("Llama-3-70B", 8, tp=8), layout("Llama-3-70B", 8, tp=3)
    assert "TP=8" in explain(fits) and "162 sequences of 8,192" in explain(fits)
    assert "impossible" in explain(impossible) and "num_attention_heads" in explain(impossible)
    table = layouts_table([fits, impossible]).splitlines()
    assert len(table) == 4 and table[2].endswith("| yes |") and "| - |" in table[3]


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: Device("x", -1, 1e12, 1e12), "Device.memory_bytes must be a positive int"),
    (lambda: Device("x", 10, 0, 1e12), "Device.bandwidth_bytes_per_s"),
    (lambda: Interconnect("x", -5), "Interconnect.bytes_per_s"),
    (lambda: layout("Llama-3-70B", 0, tp=1), "num_devices must be a positive int"),
    (lambda: layout("Llama-3-70B", 8, tp=4, pp=4), "16 GPUs per replica, but num_devices is 8"),
    (lambda: layout("Llama-3-70B", 8, tp=0), "tp must be a positive int"),
    (lambda: layout("Llama-3-70B", 8, tp=2, reserve_fraction=1.0), "reserve_fraction must be in [0, 1)"),
    (lambda: layout("Llama-3-70B", 8, tp=3, kv_dtype="fp12"), "dtype must be"),
    (lambda: layout("Llama-4-1T", 8, tp=1), "model must be a ModelConfig or one of the preset names"),
    (lambda: plan_layout("Llama-3-8B", "H100", 1, "NVLink4", 1), "device must be a Device or one of"),
    (lambda: plan_layout("Llama-3-8B", "H100-SXM-80GB", 1, "nvlink", 1), "interconnect must be"),
    (lambda: candidate_layouts("Llama-3-8B", "L4-24GB", -2, "PCIe4-x16"), "num_devices"),
    (lambda: stage_memory_plans("Llama-3-70B", "H100-SXM-80GB", tp=3, pp=1), "num_attention_heads=64"),
    (lambda: stage_layer_counts(30, 0), "pp must be a positive int"),
])
def test_bad_inputs_raise_naming_the_field(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()

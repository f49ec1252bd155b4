"""Chapter 08: tensor and pipeline parallel engines give the single process's greedy tokens, on gloo.

Each engine here starts real worker processes (torch.multiprocessing, spawn) joined in a gloo group, so
these tests cost a few seconds each; they share engines through module fixtures where they can.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine.config import ModelConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.model import LlamaModel
from engine.parallel.comm import ring_allreduce_link_bytes
from engine.parallel.pipeline import StageTimeline, split_into_micro_batches, stage_layers
from engine.sampling import SamplingParams

PROMPTS = ["Once upon a time", "12+34=", "The key k7 has value 318. The key k2 has value 771. What is k7?",
           "Alice went to the", "Write the JSON for name Bob, age 7:"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
DEATH_DEADLINE_S = 20.0  # a killed rank must turn into an error well within this (the timeout is 60 s)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tinylab_reference() -> list[list[int]]:
    return tokens(LLM("tinylab"))


@pytest.mark.parametrize("options", [
    {"tensor_parallel_size": 2},
    {"pipeline_parallel_size": 2},
    {"pipeline_parallel_size": 3, "num_micro_batches": 2},
], ids=["tp2", "pp2", "pp3-mb2"])
def test_split_engine_gives_the_single_process_greedy_tokens(tinylab_reference, options):
    llm = LLM("tinylab", **options)
    try:
        assert tokens(llm) == tinylab_reference
    finally:
        llm.engine.shutdown()


def test_tensor_parallel_survives_preemption_by_swap_and_chunked_prefill(tinylab_reference):
    """Block moves (swap out/in) reach every rank's share of the pool: a tiny pool forces them."""
    options = dict(num_blocks=20, block_size=4, max_num_seqs=5, preemption_mode="swap",
                   enable_chunked_prefill=True, max_num_batched_tokens=16)
    single = LLM("tinylab", **options)
    split = LLM("tinylab", tensor_parallel_size=2, **options)
    try:
        assert tokens(split) == tokens(single) == tinylab_reference
        moved = [e for r in split.engine.trace.steps for e in r.events if e["type"] == "blocks_moved"]
        assert any("swap_out" in e for e in moved) and any("swap_in" in e for e in moved)
    finally:
        split.engine.shutdown()


SHARED = "The key k7 has value 318. The key k2 has value 771. The key k9 has value 120. "
MIXED_PROMPTS = [SHARED + "What is k7?", SHARED + "What is k2?", "Once upon a time"]
MIXED_PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2 + [
    SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=10, ignore_eos=True)]  # forks: copy-on-write moves


@pytest.mark.parametrize("split, cache", [
    ({"tensor_parallel_size": 2}, {"enable_prefix_caching": True, "kv_offload_blocks": 8, "num_blocks": 40}),
    ({"pipeline_parallel_size": 2}, {"kv_cache_dtype": "int8", "sliding_window": 16}),
], ids=["tp2-prefix-offload-n2", "pp2-int8-window"])
def test_split_engine_keeps_every_cache_feature(split, cache):
    """Prefix hits, the host tier, forked samples (seeded), int8 K/V and a sliding window: all per rank."""
    def outputs(llm):
        return [[c.token_ids for c in o.outputs] for o in llm.generate(MIXED_PROMPTS, MIXED_PARAMS, use_tqdm=False)]

    reference = outputs(LLM("tinylab", block_size=4, **cache))
    llm = LLM("tinylab", block_size=4, **cache, **split)
    try:
        assert outputs(llm) == reference
    finally:
        llm.engine.shutdown()


def test_tensor_parallel_pads_an_odd_vocabulary_and_splits_an_untied_head_and_biases():
    """V = 101 does not divide by 2 (the last rank's rows are padding), the LM head is its own matrix, and
    every projection carries a bias (added once after a row-parallel all-reduce): greedy tokens still equal the
    whole model's."""
    cfg = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    prompts = [[5, 17, 99, 3], [100, 2, 64], [7] * 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = tokens(LLM(model), prompts, params)
    llm = LLM(model, tensor_parallel_size=2)
    try:
        assert tokens(llm, prompts, params) == reference
    finally:
        llm.engine.shutdown()


def test_all_reduce_bytes_per_step_match_the_formula():
    """Two all-reduces of [N, E] per layer plus one for the embedding; the LM head all-gathers [S, V/W]."""
    model, tok = load_model("tinylab")
    cfg = model.config
    engine = LLMEngine(model, tok, engine_config(tensor_parallel_size=2))
    try:
        engine.add_request(list(range(3, 3 + 10)), SamplingParams(temperature=0, max_tokens=1))
        engine.runner.comm_stats.reset()
        engine.step()  # one prefill of 10 tokens, one sampled row
        stats = engine.runner.comm_stats
        fp32 = 4
        assert stats.bytes["all_reduce"] == (2 * cfg.num_hidden_layers + 1) * 10 * cfg.hidden_size * fp32
        assert stats.calls["all_reduce"] == 2 * cfg.num_hidden_layers + 1
        assert stats.bytes["all_gather"] == 1 * (cfg.vocab_size // 2) * fp32
    finally:
        engine.shutdown()


@pytest.mark.parametrize("options", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}],
                         ids=["tp3", "pp2"])
def test_real_model_split_gives_the_single_process_greedy_tokens(options):
    """SmolLM2-135M has 9 query heads and 3 KV heads: tensor parallel 3 divides them (2 would not)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Q: What is 12 + 30?\nA:"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = tokens(LLM("smollm2-135m-instruct", num_blocks=64), prompts, params)
    llm = LLM("smollm2-135m-instruct", num_blocks=64, **options)
    try:
        assert tokens(llm, prompts, params) == reference
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("options, message", [
    ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 does not divide num_attention_heads=8.*\[1, 2\]"),
    ({"pipeline_parallel_size": 7}, r"pipeline_parallel_size=7 is more stages than .*num_hidden_layers=6"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, r"one way at a time"),
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size must be an integer >= 1"),
    ({"collective_timeout_s": -1}, r"collective_timeout_s must be a positive number"),
])
def test_a_bad_split_is_refused_before_any_process_starts(options, message):
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=message):
        LLM("tinylab", **options)
    assert set(multiprocessing.active_children()) == before


def test_a_rank_that_dies_turns_into_an_error_not_a_hang():
    llm = LLM("tinylab", tensor_parallel_size=2)
    engine = llm.engine
    try:
        engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.step()
        worker = engine.runner.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            engine.step()
        with pytest.raises(RuntimeError, match="lost a rank"):  # and every later step, at once
            engine.step()
        assert time.monotonic() - t0 < DEATH_DEADLINE_S
        assert engine.block_manager.usage().used_blocks == 0  # the failed step's request gave its blocks back
    finally:
        engine.shutdown()


def test_a_rank_that_hangs_times_out_instead_of_blocking_forever():
    """A stopped (not dead) rank: the collective gives up after collective_timeout_s and the step fails."""
    timeout_s = 2.0
    llm = LLM("tinylab", tensor_parallel_size=2, collective_timeout_s=timeout_s)
    engine = llm.engine
    worker = engine.runner.processes[0]
    try:
        engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="parallel step failed"):
            engine.step()
        assert timeout_s * 0.5 <= time.monotonic() - t0 < DEATH_DEADLINE_S
        with pytest.raises(RuntimeError, match="lost a rank"):
            engine.step()
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.shutdown()


# ---- pure pieces: no processes ---------------------------------------------------------------------
def test_stage_layers_cover_every_layer_once_in_order():
    for layers, stages in [(6, 2), (6, 4), (30, 4), (7, 7), (5, 1)]:
        got = [list(stage_layers(layers, stages, s)) for s in range(stages)]
        assert sum(got, []) == list(range(layers))
        assert max(map(len, got)) - min(map(len, got)) <= 1


def test_micro_batches_keep_order_and_balance_weight():
    items = [5, 1, 1, 1, 1, 5, 2, 2]
    groups = split_into_micro_batches(items, 3, weight=lambda x: x)
    assert sum(groups, []) == items and len(groups) == 3 and all(groups)
    assert split_into_micro_batches([4], 3, weight=lambda x: x) == [[4]]
    assert split_into_micro_batches([], 2) == []


def test_bubble_fraction_of_an_ideal_pipeline_is_p_minus_1_over_m_plus_p_minus_1():
    P, M, t = 2, 3, 1.0
    spans = [(s, m, (s + m) * t, (s + m + 1) * t) for s in range(P) for m in range(M)]
    assert StageTimeline(spans).bubble_fraction() == pytest.approx((P - 1) / (M + P - 1))


def test_ring_allreduce_moves_two_w_minus_one_over_w_of_the_tensor():
    assert ring_allreduce_link_bytes(1000, 2) == 1000
    assert ring_allreduce_link_bytes(1000, 4) == 1500
    assert ring_allreduce_link_bytes(1000, 1) == 0

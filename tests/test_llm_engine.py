"""Chapter 05: the continuous-batching engine gives exactly the naive loop's greedy tokens, under every
policy, with chunked prefill, and through preemptions; bad input changes nothing; traces round-trip."""

import copy
import json
import warnings

import pytest
import torch

from engine.companions.naive import generate_naive
from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import bundled_model_path
from engine.sampling import SamplingParams
from engine.trace import Trace
from engine_fixtures import CONTEXT, mixed_workload, naive_outputs, random_model, run_engine

NUM_PROMPTS = 32
TINY_POOL = dict(num_blocks=24, block_size=4)  # the longest request (60 + 24 tokens) just fits alone




@pytest.fixture(scope="module")
def model():
    return random_model(seed=3)


@pytest.fixture(scope="module")
def workload():
    return mixed_workload(NUM_PROMPTS, seed=11)


@pytest.fixture(scope="module")
def expected(model, workload):
    return naive_outputs(model, workload)


def preemptions(engine) -> list[str]:
    return [e["mode"] for s in engine.trace.steps for e in s.events if e["type"] == "preempted"]


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_greedy_outputs_equal_the_naive_loop(model, workload, expected, policy, chunked, speed):
    options = dict(policy=policy, max_num_seqs=8, speed=speed)
    if chunked:
        options |= dict(enable_chunked_prefill=True, max_num_batched_tokens=24, max_prefill_chunk_tokens=16)
    engine, outputs = run_engine(model, workload, **options)
    assert list(outputs.values()) == expected
    if chunked:  # some prompt really was split, and no step went over the budget
        assert any(s.phase == "prefill" and s.start > 0 for r in engine.trace.steps for s in r.scheduled)
        assert max(r.num_tokens for r in engine.trace.steps) <= 24


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_greedy_outputs_survive_preemption(model, workload, expected, mode, policy, speed):
    engine, outputs = run_engine(model, workload, policy=policy, preemption_mode=mode, speed=speed, **TINY_POOL)
    assert list(outputs.values()) == expected
    assert mode in preemptions(engine)  # the tiny pool really forced preemptions of this kind
    assert engine.block_manager.usage().used_blocks == 0


def test_chunked_prefill_with_swap_and_a_small_cpu_pool(model, workload, expected):
    engine, outputs = run_engine(model, workload, preemption_mode="swap", swap_space_blocks=6,
                                 enable_chunked_prefill=True, max_num_batched_tokens=20, **TINY_POOL)
    assert list(outputs.values()) == expected
    assert {"swap", "recompute"} <= set(preemptions(engine))  # a full CPU pool falls back to recompute


def test_one_step_runs_a_decode_and_a_new_prefill_in_the_same_forward(model, workload, expected):
    engine = LLMEngine(model, None, engine_config(max_num_seqs=8))
    (p0, _), (p1, sp1) = workload[0], workload[1]
    a = engine.add_request(p0, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    b = engine.add_request(p1, sp1)
    report = engine.step()
    phases = [(s.request_id, s.phase, s.tokens_in) for s in report.scheduled]
    assert phases == [(a, "decode", 1), (b, "prefill", len(p1))]
    assert report.num_tokens == 1 + len(p1)  # one packed row, no padding
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_request(b).output_token_ids == expected[1]


def test_llm_generate_returns_vllm_shaped_outputs_in_prompt_order(model, workload, expected):
    llm = LLM(model, max_num_seqs=4)
    prompts = [p for p, _ in workload[:6]]
    outputs = llm.generate(prompts, [sp for _, sp in workload[:6]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:6]
    for out, prompt, (_, sp) in zip(outputs, prompts, workload[:6], strict=True):
        assert out.prompt_token_ids == prompt and out.finished
        assert out.outputs[0].finish_reason in ("stop", "length")
        assert len(out.outputs[0].token_ids) <= sp.max_tokens
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert llm.engine.requests == {}  # generate forgets what it returned


def test_triton_attention_backend_gives_the_same_tokens(model, workload, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a fallback to torch would warn; we check the name
        picked = [0, 3]  # short outputs: Triton's CPU interpreter is slow
        engine, outputs = run_engine(model, [workload[i] for i in picked], attention_backend="triton")
    assert list(outputs.values()) == [expected[i] for i in picked]
    assert engine.trace.config["attention_backend"] == "triton"


# ---- n > 1: samples forked from one prompt ------------------------------------------------------


def test_n_samples_share_the_prompt_blocks_and_each_equals_a_seeded_single_request(model):
    prompt = [5 + i for i in range(10)]  # 10 tokens, blocks of 4: the last prompt block is partly filled
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    rid = engine.add_request(prompt, params)
    prefill = engine.step()
    assert [e["request_id"] for e in prefill.events if e["type"] == "forked"] == [f"{rid}#1", f"{rid}#2"]
    first_decode = engine.step()
    tables = first_decode.blocks.tables
    assert len({tuple(t[:2]) for t in tables.values()}) == 1  # the two full prompt blocks: stored once
    assert len({t[2] for t in tables.values()}) == 3  # the partly filled one: copied on write
    assert first_decode.blocks.used == 2 + 3
    while engine.has_unfinished_requests():
        engine.step()
    for i, seq in enumerate(engine.get_request(rid).samples):
        alone = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True)
        assert seq.output_token_ids == generate_naive(model, None, prompt, alone).token_ids
    assert engine.block_manager.usage().used_blocks == 0


def test_aborting_an_n_request_stops_every_sample_and_frees_their_blocks(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=32, block_size=4))
    rid = engine.add_request([5] * 9, SamplingParams(n=3, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests() and engine.block_manager.usage().used_blocks == 0
    assert engine.step().queues.finished == {rid: "abort", f"{rid}#1": "abort", f"{rid}#2": "abort"}


def test_llm_generate_returns_n_completions_per_prompt(model, workload, expected):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=workload[0][1].max_tokens)
    (out,) = LLM(model).generate(workload[0][0], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [expected[0], expected[0]]  # greedy: identical samples


# ---- bad input ---------------------------------------------------------------------------------


def test_llm_refuses_a_tokenizer_beside_a_model_name_instead_of_ignoring_it():
    # LLM("tinylab", "bfloat16") once ran in fp32 with the string silently dropped as a tokenizer
    with pytest.raises(ValueError, match="tokenizer: pass one only with a LlamaModel.*'bfloat16'"):
        LLM("tinylab", "bfloat16")
    assert LLM("tinylab", dtype="bfloat16").engine.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_dtype_that_disagrees_with_the_weights_is_refused_not_recorded(model):
    # the trace records config.dtype: an fp32 engine over bf16 weights would have said the wrong thing
    half = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype: the config says 'float32' but the model's weights are bfloat16"):
        LLMEngine(half, None, engine_config())
    with pytest.raises(ValueError, match="pass dtype='bfloat16'"):
        LLM(half, None, dtype="float32")
    assert LLM(half, None).engine.config.dtype == "bfloat16"  # None: the weights' own


def test_vllm_prompt_dicts_give_the_same_tokens_as_plain_prompts_and_other_keys_are_refused(model):
    llm, params = LLM(model), SamplingParams(temperature=0.0, max_tokens=4)
    plain = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    dicts = llm.generate([{"prompt_token_ids": [5, 6, 7]}, [8, 9]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    (one,) = llm.generate({"prompt_token_ids": [8, 9]}, params, use_tqdm=False)
    assert one.outputs[0].token_ids == plain[1].outputs[0].token_ids
    # a dict read as a sequence would have been the prompt "prompt": refused, and nothing runs
    for bad, words in (({"prompt_token_ids": [5], "multi_modal_data": {}}, "multi_modal_data not supported"),
                       ({"prompt": "a", "prompt_token_ids": [5]}, "exactly one of prompt, prompt_token_ids"),
                       ({}, "got keys none")):
        with pytest.raises(ValueError, match=words):
            llm.generate([[5], bad], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.usage().used_blocks == 0


def test_params_of_the_wrong_kind_are_refused_by_their_type_not_their_keys(model):
    llm = LLM(model)
    with pytest.raises(TypeError, match="params must be a SamplingParams.*got dict"):
        llm.generate([[5, 6]], {"max_tokens": 2}, use_tqdm=False)  # once iterated as its keys
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([[5], [6]], (SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2]


def test_chat_refuses_a_bare_string_instead_of_reading_it_letter_by_letter():
    llm = LLM("tinylab")
    with pytest.raises(ValueError, match="messages must be a list.*got a str: 'hello'"):
        llm.chat("hello", use_tqdm=False)


def test_a_prompt_longer_than_the_context_is_rejected_and_nothing_is_allocated(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=64, block_size=4))
    engine.add_request([5] * 10, SamplingParams(max_tokens=4))
    engine.step()
    used = engine.block_manager.usage().used_blocks
    with pytest.raises(ValueError, match=f"context is {CONTEXT}"):
        engine.add_request([5] * CONTEXT, SamplingParams(max_tokens=4), request_id="too-long")
    assert engine.block_manager.usage().used_blocks == used
    assert "too-long" not in engine.requests and len(engine.scheduler.waiting) == 0
    assert all(e["request_id"] != "too-long" for e in engine.step().events)


def test_a_request_bigger_than_the_whole_pool_is_rejected(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="num_blocks=4"):
        engine.add_request([5] * 10, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests() and engine.requests == {}


def test_max_tokens_beyond_the_context_is_clamped_like_the_naive_loop(model):
    prompt, params = [9] * (CONTEXT - 5), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine, outputs = run_engine(model, [(prompt, params)])
    (tokens,) = outputs.values()
    assert len(tokens) == 5 and tokens == generate_naive(model, None, prompt, params).token_ids
    assert engine.get_request("0").finish_reason == "length"


def test_aborting_an_unknown_id_warns_and_changes_nothing(model):
    engine = LLMEngine(model, None, engine_config())
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.warns(UserWarning, match="unknown request id"):
        assert engine.abort_request("no-such-id") is False
    assert engine.has_unfinished_requests() and engine.get_request(rid).status == "waiting"


def test_abort_frees_every_block_at_once_and_reports_it(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=64, block_size=4))
    rid = engine.add_request([5] * 30, SamplingParams(max_tokens=20))
    engine.step()
    assert engine.block_manager.usage().used_blocks == 8  # 30 prompt tokens -> 8 blocks of 4
    assert engine.abort_request(rid) is True
    assert engine.block_manager.usage().used_blocks == 0 and not engine.has_unfinished_requests()
    report = engine.step()
    assert report.queues.finished == {rid: "abort"}
    assert report.events[0]["type"] == "aborted" and report.events[0]["request_id"] == rid
    with pytest.warns(UserWarning, match="already finished"):
        assert engine.abort_request(rid) is False


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e.add_request([], None), ValueError, "empty"),
    (lambda e: e.add_request([5], SamplingParams(n=17)), ValueError, "max_num_seqs=16"),
    (lambda e: e.add_request("text", None), ValueError, "tokenizer"),
])
def test_bad_requests_are_rejected_with_a_clear_error(model, call, error, match):
    engine = LLMEngine(model, None, engine_config())
    with pytest.raises(error, match=match):
        call(engine)
    assert engine.requests == {}


def test_a_duplicate_request_id_and_an_unknown_option_are_rejected(model):
    engine = LLMEngine(model, None, engine_config())
    engine.add_request([5], None, request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([6], None, request_id="a")
    with pytest.raises(TypeError, match="max_num_seq"):
        engine_config(max_num_seq=4)


# ---- the trace ---------------------------------------------------------------------------------


def test_the_trace_round_trips_through_json_and_reads_back_per_request_times(model, workload, tmp_path):
    engine, outputs = run_engine(model, workload[:10], max_num_seqs=4, **TINY_POOL)
    path = tmp_path / "trace.json"
    engine.trace.save(path)
    loaded = Trace.load(path)
    assert loaded == engine.trace
    json.loads(path.read_text())  # plain JSON, no tensors
    times = loaded.requests()
    assert list(times) == list(outputs)
    for rid, tokens in outputs.items():
        t = times[rid]
        assert t.num_output_tokens == len(tokens) and t.finish_reason in ("stop", "length")
        first = loaded[t.first_token_step]
        (work,) = [s for s in first.scheduled if s.request_id == rid]
        assert work.new_token_ids == tokens[:1] and work.end >= t.num_prompt_tokens
        assert t.arrival_time <= t.first_token_time <= t.finish_time
        assert loaded.state_at(rid, t.first_token_step) == work.phase
        assert loaded.state_at(rid, t.finish_step) in ("prefill", "decode")  # it ran in its last step
        if t.finish_step + 1 < len(loaded):
            assert loaded.state_at(rid, t.finish_step + 1) == "finished"


def test_a_step_report_accounts_for_blocks_and_queues(model):
    engine = LLMEngine(model, None, engine_config(num_blocks=16, block_size=4, max_num_seqs=1))
    a = engine.add_request([5] * 6, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    b = engine.add_request([6] * 3, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    report = engine.step()
    assert report.queues.running == [a] and report.queues.waiting == [b]
    assert report.blocks.tables == {a: report.blocks.tables[a]} and len(report.blocks.tables[a]) == 2
    assert (report.blocks.used, report.blocks.free, report.blocks.wasted_slots) == (2, 14, 2)  # 6 of 8 slots
    # prefix caching is on by default: the admitted request's lookup is a "prefix_hit" event (0 tokens: a miss)
    assert [e["type"] for e in report.events] == ["arrived", "arrived", "admitted", "prefix_hit"]
    assert report.events[-1]["num_tokens"] == 0
    while engine.has_unfinished_requests():
        report = engine.step()
    assert report.queues.finished == {b: "length"}


@pytest.mark.skipif(not bundled_model_path("tinylab").exists(),
                    reason="the bundled tinylab checkpoint is not built yet (engine/models/tinylab)")
@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_tinylab_generate_equals_the_naive_loop(speed):
    from engine.loading.loader import load_model

    llama, tokenizer = load_model("tinylab")
    prompts = ["12+7=", "Once upon a time", "x"]
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = LLM(llama, tokenizer, max_num_seqs=2, speed=speed).generate(prompts, params, use_tqdm=False)
    for out, prompt in zip(outputs, prompts, strict=True):
        naive = generate_naive(llama, tokenizer, prompt, params)
        assert out.outputs[0].token_ids == naive.token_ids and out.outputs[0].text == naive.text

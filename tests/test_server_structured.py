"""Chapter 13: the server's OpenAI surface for structured outputs, logprobs, echo, logit bias and tools, through
the official `openai` client on a loopback port (engine/serving/openai_fields.py).

Constrained answers always parse and fit their schema (checked by hand below; the real model's answers are
checked with jsonschema in tests/test_server_structured_smollm2.py); tool calls come back as `tool_calls` with
schema-valid arguments, streamed in pieces that add up to the whole call; logprobs equal the engine's own
(LLM.generate / LLM.chat on the same weights); echo + logprobs give the prompt's logprobs as lm-eval's `local-
completions` reads them; logit_bias bans and forces tokens; what we do not do (best_of != n, tool_choice "auto",
two constraints, a schema that does not compile) is a 400 naming the field, and the engine keeps nothing of it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx
import openai
import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncLLMEngine
from engine.serving.server import BackgroundServer, build_app

MODEL = "tinylab"
MAX_NUM_SEQS = 4
WAIT_S = 60.0  # a bound against hanging, not a timing claim
TOLERANCE = 1e-5  # fp32 logprobs of the same forward, through JSON (which keeps a float exactly)
JSON_PROMPTS = ["Make JSON: city Oslo, age 7.\nJSON:", "Make JSON: age 31, called Ana.\nJSON:",
                "Once upon a time", "12+7="]  # [2], [3]: prompts that would not answer in JSON
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                      "b": {"type": "integer", "minimum": 0, "maximum": 999}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOL_CHAT = [[{"role": "user", "content": "What is the weather in Oslo?"}],
             [{"role": "user", "content": "Add 12 and 7."}]]
ENOUGH_TOKENS = 64  # every constrained answer below closes well within this


@dataclass
class Served:
    url: str
    front: AsyncLLMEngine
    client: openai.OpenAI
    oracle: LLM  # the same weights behind the offline API


@pytest.fixture(scope="module")
def served():
    model, tok = load_model(MODEL)
    oracle = LLM(model, tok)
    engine = LLMEngine(model, tok, engine_config(MODEL, max_num_seqs=MAX_NUM_SEQS))
    with BackgroundServer(build_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield Served(server.url, server.app.state.front, client, oracle)


def violations(value, schema: dict, where: str = "$") -> list[str]:
    """What in `value` breaks `schema`, for the part of JSON Schema these tests use (type object / string /
    integer, properties, required, additionalProperties false, enum, const, maxLength, minimum, maximum)."""
    if "const" in schema:
        return [] if value == schema["const"] else [f"{where}: {value!r} is not {schema['const']!r}"]
    if "enum" in schema:
        return [] if value in schema["enum"] else [f"{where}: {value!r} not in {schema['enum']}"]
    kind = schema.get("type")
    if kind == "string":
        ok = isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
        return [] if ok else [f"{where}: {value!r} is not a string of at most {schema.get('maxLength')}"]
    if kind == "integer":
        ok = (isinstance(value, int) and not isinstance(value, bool)
              and schema.get("minimum", value) <= value <= schema.get("maximum", value))
        return [] if ok else [f"{where}: {value!r} is not an integer in range"]
    if not isinstance(value, dict):
        return [f"{where}: {value!r} is not an object"]
    problems = [f"{where}: no {k!r}" for k in schema.get("required", []) if k not in value]
    if schema.get("additionalProperties") is False:
        problems += [f"{where}: extra {k!r}" for k in value if k not in schema["properties"]]
    for k, sub in schema.get("properties", {}).items():
        if k in value:
            problems += violations(value[k], sub, f"{where}.{k}")
    return problems


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def engine_state(served: Served) -> tuple:
    def state(engine):
        return sorted(engine.requests), engine.block_manager.usage().used_blocks, engine.has_unfinished_requests()
    return served.front.call(state).result(WAIT_S)


# ---- structured outputs --------------------------------------------------------------------------------------


def test_json_schema_answers_always_parse_and_fit_the_schema_where_free_answers_do_not(served):
    fmt = json_schema_format(PERSON)
    texts = []
    for prompt in JSON_PROMPTS:
        greedy = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=ENOUGH_TOKENS,
                                                  temperature=0, extra_body={"response_format": fmt})
        sampled = served.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=ENOUGH_TOKENS, n=2,
            temperature=1.0, seed=3, response_format=fmt)
        texts += [greedy.choices[0].text] + [c.message.content for c in sampled.choices]
        assert {c.finish_reason for c in [*greedy.choices, *sampled.choices]} == {"stop"}
    for text in texts:
        assert violations(json.loads(text), PERSON) == [], text
    free = [served.oracle.generate(p, SamplingParams(temperature=0, max_tokens=ENOUGH_TOKENS), use_tqdm=False)[0]
            .outputs[0].text for p in JSON_PROMPTS]
    assert not all(_fits(t, PERSON) for t in free), "the prompts must include some the model answers otherwise"


def _fits(text: str, schema: dict) -> bool:
    try:
        return violations(json.loads(text), schema) == []
    except json.JSONDecodeError:
        return False


@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_json_object_answers_are_json_objects(served, field):
    extra = ({"response_format": {"type": "json_object"}} if field == "response_format"
             else {"structured_outputs": {"json_object": True}})
    # Any object: its keys are free text. tinylab starts its JSON answers with " {" (one token); the grammar allows
    # no space before the "{", so the answer must begin with the token '{"', which the model never saw in training,
    # and on most prompts it then writes a story inside the first key until max_tokens. A prompt that already ends
    # in the space recovers.
    r = served.client.completions.create(model=MODEL, prompt="Make JSON: city Oslo, age 7.\nJSON: ", temperature=0,
                                         max_tokens=ENOUGH_TOKENS, extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    free = served.oracle.generate("Make JSON: city Oslo, age 7.\nJSON: ", SamplingParams(temperature=0, max_tokens=8),
                                  use_tqdm=False)[0].outputs[0].text
    assert not free.startswith("{"), f"unconstrained, the model answers otherwise ({free!r})"


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_regex": r"[0-9]{2}-[a-z]{3}"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{3}", t) is not None),
    ({"guided_json": ADD}, lambda t: violations(json.loads(t), ADD) == []),
    ({"guided_grammar": 'start: "ab" ("c" | "d")+'}, lambda t: re.fullmatch(r"ab[cd]+", t) is not None),
], ids=["guided_choice", "structured_outputs.choice", "guided_regex", "guided_json", "guided_grammar"])
def test_vllms_constraint_fields_constrain_the_text(served, extra, check):
    r = served.client.completions.create(model=MODEL, prompt=JSON_PROMPTS[2], max_tokens=ENOUGH_TOKENS, n=2,
                                         temperature=1.0, seed=11, extra_body=extra)
    for choice in r.choices:
        assert check(choice.text), choice.text


def test_a_streamed_constrained_answer_adds_up_to_the_whole_one(served):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": JSON_PROMPTS[0]}], "max_tokens": ENOUGH_TOKENS,
          "temperature": 0, "response_format": json_schema_format(PERSON)}
    whole = served.client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in served.client.chat.completions.create(**kw, stream=True)]
    assert "".join(pieces) == whole and len([p for p in pieces if p]) > 1


# ---- tools --------------------------------------------------------------------------------------------------


def _check_call(message, names: set[str]) -> dict:
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    assert violations(arguments, TOOL_SCHEMAS[call.function.name]) == [], call.function.arguments
    return arguments


def test_tool_choice_required_returns_a_call_of_one_of_the_tools_with_schema_valid_arguments(served):
    for messages in TOOL_CHAT:
        r = served.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                                  max_tokens=ENOUGH_TOKENS, n=2, temperature=1.0, seed=5)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls"
            _check_call(choice.message, set(TOOL_SCHEMAS))


def test_a_named_function_is_called_with_arguments_valid_for_its_schema(served):
    choice = {"type": "function", "function": {"name": "add"}}
    for messages in TOOL_CHAT:
        r = served.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=ENOUGH_TOKENS, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.name == "add"
        _check_call(r.choices[0].message, {"add"})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_streamed_tool_call_names_itself_once_and_its_argument_pieces_add_up(served, tool_choice):
    kw = {"model": MODEL, "messages": TOOL_CHAT[0], "tools": TOOLS, "tool_choice": tool_choice,
          "max_tokens": ENOUGH_TOKENS, "temperature": 0}
    whole = served.client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(served.client.chat.completions.create(**kw, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [bool(tc.id) for tc in calls] == [True] + [False] * (len(calls) - 1)
    assert calls[0].function.name == whole.function.name and calls[0].type == "function"
    assert "".join(tc.function.arguments or "" for tc in calls) == whole.function.arguments
    assert len(calls) > 2, "the arguments arrive in pieces, as they are generated"
    assert all(c.choices[0].delta.content is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text_as_if_there_were_no_tools(served):
    r = served.client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="none",
                                              max_tokens=20, temperature=0)
    expected = served.oracle.chat(CHAT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == expected.outputs[0].text


def test_an_earlier_tool_call_is_part_of_the_conversation(served):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 7}'}}
    history = [*TOOL_CHAT[1], {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "19"}]
    without = [*TOOL_CHAT[1], {"role": "assistant", "content": None}, history[-1]]
    asked = [served.client.chat.completions.create(model=MODEL, messages=m, max_tokens=1, temperature=0)
             for m in (history, without)]
    written = len(served.oracle.tokenizer.encode('{"name": "add", "arguments": {"a": 12, "b": 7}}', False))
    assert asked[0].usage.prompt_tokens - asked[1].usage.prompt_tokens == pytest.approx(written, abs=1)


# ---- logprobs and echo --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs_equal_the_engines_own(served, stream):
    top = 3
    expected = served.oracle.chat(CHAT, SamplingParams(temperature=0, max_tokens=12, logprobs=top),
                                  use_tqdm=False)[0].outputs[0]
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": top}
    if stream:
        content = [e for c in served.client.chat.completions.create(**kw, stream=True)
                   for e in (c.choices[0].logprobs.content if c.choices and c.choices[0].logprobs else [])]
    else:
        content = served.client.chat.completions.create(**kw).choices[0].logprobs.content
    tok = served.oracle.tokenizer
    assert len(content) == len(expected.logprobs) == len(expected.token_ids)
    for entry, want in zip(content, expected.logprobs, strict=True):
        assert entry.token == tok.decode([want.token_id], skip_special_tokens=False)
        assert entry.logprob == pytest.approx(want.logprob, abs=TOLERANCE)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i], skip_special_tokens=False) for i in want.top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(want.top.values()), abs=TOLERANCE)
    assert tok.decode(expected.token_ids, False) == bytes(b for e in content for b in e.bytes).decode()


def test_chat_logprobs_without_top_logprobs_give_no_alternatives(served):
    r = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's local-completions (`parse_logprobs`) reads from a choice: the continuation's summed
    logprob and whether each of its tokens was the most likely one."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops, strict=True))


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_lm_eval_reads_them(served):
    tok = served.oracle.tokenizer
    context, continuation = tok.encode("Make JSON: age 31, called Ana.\nJSON:"), tok.encode(' {"name": "Ana"', False)
    ids = context + continuation
    expected = served.oracle.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1,
                                                          logprobs=1), use_tqdm=False)[0]
    # exactly lm-eval's loglikelihood payload (a batch of one tokenized request)
    body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    choice = httpx.post(served.url + "/v1/completions", json=body, timeout=WAIT_S).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids) + 1 and choice["text"].startswith(tok.decode(ids))
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]],
                                                             abs=TOLERANCE)
    assert lp["token_logprobs"][-1] == pytest.approx(expected.outputs[0].logprobs[0].logprob, abs=TOLERANCE)
    for top, want in zip(lp["top_logprobs"][1:len(ids)], expected.prompt_logprobs[1:], strict=True):
        assert max(top.values()) == pytest.approx(max(want.top.values()), abs=TOLERANCE)
        assert top[tok.decode([want.token_id], skip_special_tokens=False)] == pytest.approx(want.logprob,
                                                                                           abs=TOLERANCE)
    summed, greedy = lm_eval_loglikelihood(choice, len(context))
    want = expected.prompt_logprobs[len(context):]
    assert summed == pytest.approx(sum(e.logprob for e in want), abs=len(want) * TOLERANCE)
    assert greedy == all(e.logprob >= max(e.top.values()) for e in want)


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only(served):
    ids = served.oracle.tokenizer.encode(JSON_PROMPTS[1])
    expected = served.oracle.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                      use_tqdm=False)[0]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True, "temperature": 0,
            "return_token_ids": True}
    choice = httpx.post(served.url + "/v1/completions", json=body, timeout=WAIT_S).json()["choices"][0]
    assert choice["text"] == served.oracle.tokenizer.decode(ids) and choice["token_ids"] == []
    scored = choice["logprobs"]["token_logprobs"]
    assert scored[0] is None and scored[1:] == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]],
                                                             abs=TOLERANCE)
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_streamed_echo_sends_the_prompt_first_then_the_completion(served):
    kw = {"model": MODEL, "prompt": JSON_PROMPTS[1], "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2}
    whole = served.client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in served.client.completions.create(**kw, stream=True)]
    assert chunks[0].text.startswith(JSON_PROMPTS[1]) and "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == whole.logprobs.text_offset
    plain = served.oracle.generate(JSON_PROMPTS[1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert whole.text == JSON_PROMPTS[1] + plain[0].outputs[0].text


# ---- logit_bias ---------------------------------------------------------------------------------------------


def test_logit_bias_minus_100_bans_the_greedy_token_and_plus_100_forces_one(served):
    prompt = JSON_PROMPTS[1]
    greedy = served.oracle.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    first = greedy.outputs[0].token_ids[0]

    def token_ids(bias: dict) -> list[int]:
        r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                             logit_bias=bias, extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    assert token_ids({}) == greedy.outputs[0].token_ids
    assert first not in token_ids({str(first): -100})
    forced = served.oracle.tokenizer.encode("#", False)[0]
    assert token_ids({str(forced): 100}) == [forced] * 4


# ---- refused: a 400 naming the field, nothing held ----------------------------------------------------------


CMPL, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
REFUSED = {  # name -> (path, extra fields, the param the error names)
    "best_of_above_n": (CMPL, {"best_of": 3}, "best_of"),
    "tool_choice_auto": (CHAT_PATH, {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    "tools_without_tool_choice": (CHAT_PATH, {"tools": TOOLS}, "tool_choice"),
    "tool_choice_names_an_unknown_function": (
        CHAT_PATH, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    "tool_choice_required_without_tools": (CHAT_PATH, {"tool_choice": "required"}, "tool_choice"),
    "two_tools_of_one_name": (CHAT_PATH, {"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    "tools_and_response_format": (CHAT_PATH, {"tools": TOOLS, "tool_choice": "required",
                                              "response_format": {"type": "json_object"}}, "response_format"),
    "response_format_and_guided_regex": (CMPL, {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
                                         "response_format"),
    "structured_outputs_with_two_kinds": (CMPL, {"structured_outputs": {"regex": "a", "choice": ["b"]}},
                                          "structured_outputs"),
    "structured_outputs_unknown_key": (CMPL, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    "json_schema_of_an_unknown_type": (CMPL, {"response_format": json_schema_format({"type": "nonsense"})},
                                       "response_format"),
    "json_schema_with_a_dangling_ref": (
        CHAT_PATH, {"response_format": json_schema_format({"properties": {"a": {"$ref": "#/nope"}}})},
        "response_format"),
    "guided_regex_that_does_not_parse": (CMPL, {"guided_regex": "(ab"}, "guided_regex"),
    "guided_json_not_json": (CMPL, {"guided_json": "{not json"}, "guided_json"),
    "tool_parameters_of_an_unknown_type": (
        CHAT_PATH, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                    "tool_choice": "required"}, "tool_choice"),
    "logit_bias_outside_the_vocabulary": (CMPL, {"logit_bias": {"1024": 5}}, "logit_bias"),
    "logit_bias_not_a_token_id": (CMPL, {"logit_bias": {"a": 5}}, "logit_bias"),
    "logit_bias_above_100": (CMPL, {"logit_bias": {"5": 100.5}}, "logit_bias"),
    "completions_logprobs_6": (CMPL, {"logprobs": 6}, "logprobs"),
    "top_logprobs_21": (CHAT_PATH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs_without_logprobs": (CHAT_PATH, {"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs_on_completions": (CMPL, {"top_logprobs": 2}, "top_logprobs"),
    "echo_on_chat": (CHAT_PATH, {"echo": True}, "echo"),
    "prompt_logprobs_still_refused": (CMPL, {"prompt_logprobs": 1}, "prompt_logprobs"),
    "echo_of_a_token_id_outside_the_vocabulary": (CMPL, {"prompt": [5, -1], "echo": True, "logprobs": 1}, "prompt"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_we_do_not_do_is_a_400_naming_the_field_and_the_engine_keeps_nothing(served, case):
    path, extra, param = REFUSED[case]
    base = ({"prompt": JSON_PROMPTS[0]} if path == CMPL else {"messages": CHAT})
    before = engine_state(served)
    resp = httpx.post(served.url + path, json={"model": MODEL, "max_tokens": 4, **base, **extra}, timeout=WAIT_S)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert engine_state(served) == before == ([], 0, False), "a refused request must leave nothing behind"

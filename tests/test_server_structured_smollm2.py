"""Chapter 13 on the real model: SmolLM2-135M-Instruct behind the server answers the official `openai` client's
`response_format` json_schema with JSON that parses and that `jsonschema` validates, and a tool call whose
arguments fit the tool's schema (its free answers mostly do not: benchmarks/results/structured.md)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from engine.lab.structured import extraction_prompts, person_schema
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.serving.server import BackgroundServer, build_app

MODEL = "smollm2-135m-instruct"
NUM_PROMPTS = 3
MAX_TOKENS = 64  # a person record closes well within this


@pytest.fixture(scope="module")
def client():
    model, tok = load_model(MODEL)
    engine = LLMEngine(model, tok, engine_config(MODEL, max_num_seqs=4))
    with BackgroundServer(build_app(engine, MODEL)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("example", extraction_prompts(NUM_PROMPTS), ids=lambda e: e.meta["fields"]["name"])
def test_json_schema_answers_parse_and_validate(client, example):
    schema = person_schema()
    reply = client.chat.completions.create(
        model=MODEL, messages=example.meta["messages"], temperature=0, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_required_tool_call_has_schema_valid_arguments(client):
    weather = {"type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "maxLength": 20}}}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=MAX_TOKENS, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": weather}}])
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)

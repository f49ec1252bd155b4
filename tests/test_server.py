"""Chapter 09: the OpenAI-compatible server, through real clients (the `openai` package, raw HTTP) on a
loopback port: SSE framing, greedy and seeded outputs equal to `LLM.generate`, /metrics, disconnects,
and bad input refused in OpenAI's error shape without touching the engine."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncLLMEngine
from engine.serving.server import BackgroundServer, build_app

MODEL = "tinylab"
PROMPTS = ["12+7=", "Finn lived in a small house near the school.", "The fox"]  # [1]: a story opening, a long answer
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]
MAX_TOKENS = 20
MAX_NUM_SEQS = 4
SEED, SEEDED_TEMPERATURE = 7, 0.9
WAIT_S = 60.0  # a bound against hanging, not a timing claim: the tests wait for states, never for clocks
POLL_S = 0.02


@dataclass
class Served:
    url: str
    front: AsyncLLMEngine
    client: openai.OpenAI
    greedy: list  # LLM.generate's RequestOutput per prompt, greedy
    seeded: list  # ... with temperature SEEDED_TEMPERATURE, seed SEED, n = 2
    chat: object  # LLM.chat's RequestOutput for CHAT
    stop: tuple[str, object]  # a stop string taken from PROMPTS[1]'s greedy text, and LLM.generate's output with it


@pytest.fixture(scope="module")
def served():
    model, tok = load_model(MODEL)
    oracle = LLM(model, tok)  # the same weights behind the offline API, run before the server starts
    greedy = oracle.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    seeded = oracle.generate(PROMPTS[1], SamplingParams(temperature=SEEDED_TEMPERATURE, seed=SEED, n=2,
                                                        max_tokens=MAX_TOKENS), use_tqdm=False)
    chat = oracle.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    text = greedy[1].outputs[0].text
    stop_string = text[len(text) // 2: len(text) // 2 + 3]  # three characters from the middle of the answer
    assert len(text) > 8 and stop_string.strip(), f"the oracle's answer {text!r} is too short to cut"
    stopped = oracle.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop_string]),
                              use_tqdm=False)[0]
    engine = LLMEngine(model, tok, engine_config(MODEL, max_num_seqs=MAX_NUM_SEQS))
    with BackgroundServer(build_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield Served(server.url, server.app.state.front, client, greedy, seeded, chat, (stop_string, stopped))


def on_engine(served: Served, fn):
    """fn(engine) on the engine thread, between two steps: a consistent view."""
    return served.front.call(fn).result(WAIT_S)


def engine_state(engine: LLMEngine) -> dict:
    usage = engine.block_manager.usage()
    return {"requests": sorted(engine.requests), "unfinished": engine.has_unfinished_requests(),
            "used_blocks": usage.used_blocks, "steps": len(engine.trace)}


def wait_for_idle(served: Served) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        state = on_engine(served, engine_state)
        if not state["requests"] or time.monotonic() > deadline:
            return state
        time.sleep(POLL_S)


def sse_events(raw: str) -> list[str]:
    """The `data:` payloads of a server-sent event stream, checking its framing on the way: every event is
    one `data: ...` line followed by a blank line."""
    assert raw.endswith("\n\n"), f"the stream must end with a blank line, got {raw[-20:]!r}"
    events = raw[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, f"not an SSE data event: {e!r}"
    return [e[len("data: "):] for e in events]


# ---- streaming and outputs -----------------------------------------------------------------------------


def test_stream_is_sse_chunks_then_usage_then_done(served):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=WAIT_S) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *token_chunks, usage_chunk = chunks
    expected = served.greedy[0].outputs[0]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in token_chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert [len(c["choices"][0]["token_ids"]) for c in token_chunks] == [1] * len(expected.token_ids)  # 1 per step
    assert [c["choices"][0]["finish_reason"] for c in token_chunks[:-1]] == [None] * (len(token_chunks) - 1)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == expected.finish_reason
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": len(served.greedy[0].prompt_token_ids),
                                    "completion_tokens": len(expected.token_ids),
                                    "total_tokens": len(served.greedy[0].prompt_token_ids) + len(expected.token_ids)}


@pytest.mark.parametrize("stream", [True, False])
def test_greedy_completions_equal_llm_generate_token_for_token(served, stream):
    for prompt, expected in zip(PROMPTS, served.greedy, strict=True):
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
              "extra_body": {"return_token_ids": True}}
        if stream:
            text, ids, reason = "", [], None
            for chunk in served.client.completions.create(**kw, stream=True):
                choice = chunk.choices[0]
                text, ids = text + choice.text, ids + choice.model_extra["token_ids"]
                reason = choice.finish_reason or reason
        else:
            r = served.client.completions.create(**kw)
            choice = r.choices[0]
            text, ids, reason = choice.text, choice.model_extra["token_ids"], choice.finish_reason
            assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert ids == expected.outputs[0].token_ids, f"prompt {prompt!r}"
        assert text == expected.outputs[0].text
        assert reason == expected.outputs[0].finish_reason


def test_seeded_samples_equal_llm_generate(served):
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, n=2, seed=SEED,
                                         temperature=SEEDED_TEMPERATURE, extra_body={"return_token_ids": True})
    got = {c.index: c.model_extra["token_ids"] for c in r.choices}
    assert got == {o.index: o.token_ids for o in served.seeded[0].outputs}
    assert got[0] != got[1], "two samples of one seeded request draw from different generators"


def test_streamed_chat_equals_llm_chat(served):
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == served.chat.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(served.chat.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(served.chat.prompt_token_ids)


def test_stop_string_is_cut_and_never_streamed(served):
    stop, expected = served.stop
    pieces = [c.choices[0].text for c in served.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True)]
    assert "".join(pieces) == expected.outputs[0].text
    assert stop not in "".join(pieces)
    assert expected.outputs[0].finish_reason == "stop"


# ---- endpoints and metrics -----------------------------------------------------------------------------------


def test_models_health_and_unknown_paths(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == on_engine(served, lambda e: e.max_model_len)
    assert httpx.get(served.url + "/health").status_code == 200
    resp = httpx.get(served.url + "/v1/nothing-here")
    assert resp.status_code == 404 and set(resp.json()["error"]) == {"message", "type", "param", "code"}


def scrape(served: Served) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: (sample name, sorted labels) -> value."""
    resp = httpx.get(served.url + "/metrics")
    assert resp.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    want = {"model_name": MODEL, **labels}
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in want.items()))


def test_metrics_parse_and_count_what_was_served(served):
    before = scrape(served)
    replies = [served.client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
               for p in PROMPTS[:2]]
    after = scrape(served)

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt = sum(r.usage.prompt_tokens for r in replies)
    generated = sum(r.usage.completion_tokens for r in replies)
    assert grew("vllm:prompt_tokens_total") == prompt
    assert grew("vllm:generation_tokens_total") == generated
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert grew(name) == len(replies), name
    assert grew("vllm:inter_token_latency_seconds_count") == generated - len(replies)  # one per token gap
    for reason in ("stop", "length"):
        assert grew("vllm:request_success_total", finished_reason=reason) == sum(
            r.choices[0].finish_reason == reason for r in replies)
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    names = {n for n, _ in after}
    assert {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= names


# ---- disconnects ---------------------------------------------------------------------------------------------


# ignore_eos: it would go on for 500 steps; every test below hangs up long before that
LONG = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 500, "ignore_eos": True, "temperature": 0}
GIVE_UP_S = 0.2  # the plain request's client gives up after this long without an answer


def assert_aborted_and_freed(served: Served, request_id: str) -> None:
    state = wait_for_idle(served)
    assert state["requests"] == [] and not state["unfinished"], state
    assert state["used_blocks"] == 0, "the aborted request's KV blocks must be back in the pool"
    events = on_engine(served, lambda e: [ev for r in e.trace.steps for ev in r.events
                                          if ev.get("request_id") == request_id])
    assert [ev["type"] for ev in events if ev["type"] in ("aborted", "finished")] == ["aborted"]
    tokens = on_engine(served, lambda e: sum(s.tokens_out for r in e.trace.steps for s in r.scheduled
                                             if s.request_id == request_id))
    assert tokens < LONG["max_tokens"]


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(served):
    with httpx.stream("POST", served.url + "/v1/completions", json={**LONG, "stream": True}, timeout=WAIT_S) as resp:
        first = next(line for line in resp.iter_lines() if line.startswith("data: "))
    request_id = json.loads(first[len("data: "):])["id"]
    assert_aborted_and_freed(served, request_id)


def arrivals_since(engine: LLMEngine, step: int) -> list[str]:
    return [ev["request_id"] for r in engine.trace.steps[step:] for ev in r.events if ev["type"] == "arrived"]


def test_a_client_giving_up_on_a_plain_request_aborts_it(served):
    seen = on_engine(served, lambda e: len(e.trace))
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting long before 500 tokens are written
        httpx.post(served.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(WAIT_S, read=GIVE_UP_S))
    deadline = time.monotonic() + WAIT_S
    while not (arrived := on_engine(served, lambda e: arrivals_since(e, seen))) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert len(arrived) == 1
    assert_aborted_and_freed(served, arrived[0])


# ---- cancelling by id: POST /v1/requests/{id}/cancel -------------------------------------------------------------


def cancel(served: Served, request_id: str) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/requests/{request_id}/cancel", timeout=WAIT_S)


def wait_for_requests(served: Served, ids: set[str]) -> None:
    """Until every one of `ids` is in the engine (admitted, holding or waiting for blocks)."""
    deadline = time.monotonic() + WAIT_S
    while not ids <= set(on_engine(served, lambda e: e.requests)):
        assert time.monotonic() < deadline, f"gave up waiting for {ids} to reach the engine"
        time.sleep(POLL_S)


def blocks_held(engine: LLMEngine) -> dict:
    """Which sequences hold blocks, and whether they account for every block in use (no leak)."""
    bm = engine.block_manager
    held = {s: bm.num_held_blocks(s) for s in bm.seq_ids()}
    return {"seqs": set(held), "accounted": sum(held.values()) == bm.usage().used_blocks}


def test_cancelling_a_stream_from_a_second_client_ends_it_frees_its_blocks_and_spares_the_others(served):
    before = scrape(served)
    plain = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0,
             "return_token_ids": True}
    with (httpx.stream("POST", served.url + "/v1/completions", json={**LONG, "stream": True}, timeout=WAIT_S) as resp,
          ThreadPoolExecutor(1) as pool):
        lines = resp.iter_lines()
        request_id = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])["id"]
        assert resp.headers["X-Request-Id"] == request_id
        other = pool.submit(httpx.post, served.url + "/v1/completions", json=plain, timeout=WAIT_S)
        wait_for_requests(served, {request_id})
        deadline = time.monotonic() + WAIT_S
        while len(on_engine(served, lambda e: e.requests)) < 2 and not other.done():
            assert time.monotonic() < deadline, "the second request never arrived"
            time.sleep(POLL_S)
        seq = on_engine(served, lambda e: e.get_request(request_id).seq_id)
        cancelled = cancel(served, request_id)
        held = on_engine(served, blocks_held)  # the pool just after the cancel returned
        rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json() == {"id": request_id, "object": "request", "status": "cancelled"}
    assert seq not in held["seqs"] and held["accounted"], "the cancelled request's blocks are free at once"
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert not any("error" in c for c in chunks), "a cancel asked for is not an error"
    reply = other.result(WAIT_S)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == served.greedy[1].outputs[0].token_ids
    assert_aborted_and_freed(served, request_id)
    after = scrape(served)
    assert metric(after, "vllm:request_aborts_total", reason="cancelled") == metric(
        before, "vllm:request_aborts_total", reason="cancelled") + 1
    assert metric(after, "vllm:request_aborts_total", reason="client_disconnect") == metric(
        before, "vllm:request_aborts_total", reason="client_disconnect"), "counted once, as a cancel"


def test_a_plain_request_named_by_its_client_can_be_cancelled_and_answers_abort(served):
    own_id = "my-job_1.a~b"
    with ThreadPoolExecutor(1) as pool:
        waiter = pool.submit(httpx.post, served.url + "/v1/completions", json=LONG,
                             headers={"X-Request-Id": own_id}, timeout=WAIT_S)
        wait_for_requests(served, {own_id})
        twin = httpx.post(served.url + "/v1/completions", json=LONG, headers={"X-Request-Id": own_id},
                          timeout=WAIT_S)
        assert cancel(served, own_id).status_code == 200
        reply = waiter.result(WAIT_S)
    assert twin.status_code == 409 and twin.json()["error"]["code"] == "duplicate_request_id"
    assert reply.status_code == 200 and reply.headers["X-Request-Id"] == own_id
    body = reply.json()
    assert body["id"] == own_id and body["choices"][0]["finish_reason"] == "abort"
    assert 0 <= body["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert_aborted_and_freed(served, own_id)


@pytest.mark.parametrize("request_id", ["cmpl-0123456789abcdef", "finished"])
def test_cancelling_an_unknown_or_finished_request_gets_404(served, request_id):
    if request_id == "finished":
        done = httpx.post(served.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=WAIT_S)
        request_id = done.json()["id"]
        assert done.headers["X-Request-Id"] == request_id
    resp = cancel(served, request_id)
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and request_id in error["message"]
    assert error["code"] == "request_not_found" and error["type"] == "not_found_error"


@pytest.mark.parametrize("bad_id", ["has space", "x" * 129, "slash/inside", ""])
def test_an_unusable_client_request_id_gets_400_and_leaves_no_trace(served, bad_id):
    before = wait_for_idle(served)
    resp = httpx.post(served.url + "/v1/completions", json={**LONG, "max_tokens": 2},
                      headers={"X-Request-Id": bad_id}, timeout=WAIT_S)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request_id", resp.text
    assert on_engine(served, engine_state) == before


# ---- bad input: OpenAI's error shape, no trace in the engine, the server goes on ---------------------------------


BAD = {  # name -> (raw body, expected status, expected param)
    "malformed_json": (b'{"model": "tinylab", "prompt": ', 400, None),
    "not_an_object": (b'["tinylab"]', 400, None),
    "unknown_model": ({"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    "missing_prompt": ({"model": MODEL}, 400, "prompt"),
    "wrong_type_max_tokens": ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    "wrong_type_stream": ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    "float_token_ids": ({"model": MODEL, "prompt": [5, 6.5]}, 400, "prompt"),
    "token_id_outside_vocab": ({"model": MODEL, "prompt": [5, 10**6]}, 400, "prompt"),
    "max_tokens_beyond_context": ({"model": MODEL, "prompt": "hi", "max_tokens": 10**5}, 400, "max_tokens"),
    "prompt_fills_context": ({"model": MODEL, "prompt": [5] * 600}, 400, "prompt"),
    "n_too_large": ({"model": MODEL, "prompt": "hi", "n": MAX_NUM_SEQS + 1}, 400, "n"),
    "negative_temperature": ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    "batch_of_prompts": ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    "huge_body": ({"model": MODEL, "prompt": "x" * (2 << 20)}, 413, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_an_openai_error_and_leaves_no_trace(served, case):
    body, status, param = BAD[case]
    before = wait_for_idle(served)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(served.url + "/v1/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert on_engine(served, engine_state) == before, "a refused request must leave the engine as it was"
    ok = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert ok.choices[0].text == served.greedy[0].outputs[0].text


def test_the_openai_client_raises_its_own_errors(served):
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-5", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10**5)
    with pytest.raises(openai.BadRequestError, match="messages"):
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])

"""Chapter 10: overload protection in the HTTP server, through real clients on a loopback port: 503 past the
queue caps, 429 past a tenant's rate, timeouts that abort and free blocks, everything counted in /metrics, and
a flood of bad requests that leaves the server serving. The requests that were admitted are always served
exactly as `LLM.generate` serves them.

No timing is asserted. Where time matters (rates, deadlines) the engine runs on a clock the test moves by hand;
elsewhere a request is kept busy with `ignore_eos` and hundreds of tokens to go while the test looks at it,
and then aborted."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.sampling import SamplingParams
from engine.serving.admission import AdmissionLimits, RateLimit
from engine.serving.server import BackgroundServer, build_app

MODEL = "tinylab"
TEXT = "Once upon a time there was a little fox who lived in a big green forest near the river and every day"
MAX_TOKENS = 12
# A request that would run for hundreds of steps: each test aborts it (or times it out) long before its end.
BUSY = {"model": MODEL, "prompt": "The fox", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
        "stream": True}
WAIT_S = 60.0  # a bound against hanging, never a timing claim
POLL_S = 0.01
START_TIME = 1000.0  # where the hand-moved clock starts


class HandClock:
    """The engine's clock, moved only by the test: rates and deadlines become deterministic."""

    def __init__(self, now: float = START_TIME):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Lab:
    model: object
    tok: object
    prompts: dict[str, list[int]]  # name -> prompt token ids
    expected: dict[str, list[int]]  # name -> LLM.generate's greedy token ids


@pytest.fixture(scope="module")
def lab() -> Lab:
    model, tok = load_model(MODEL)
    ids = tok.encode(TEXT)
    assert len(ids) >= 20, f"TEXT must have at least 20 tokens, has {len(ids)}"
    prompts = {"short": ids[:5], "long": ids[:20], "other": ids[3:23], "story": tok.encode("Once upon a time")}
    outs = LLM(model, tok).generate(list(prompts.values()), SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                    use_tqdm=False)
    return Lab(model, tok, prompts, {k: o.outputs[0].token_ids for k, o in zip(prompts, outs, strict=True)})


@dataclass
class Served:
    url: str
    front: object  # the app's AsyncLLMEngine

    def on_engine(self, fn: Callable):
        return self.front.call(fn).result(WAIT_S)

    def load(self):
        return self.on_engine(lambda e: self.front.load())

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready():
            assert time.monotonic() < deadline, f"gave up waiting for {what}"
            time.sleep(POLL_S)

    def idle_state(self) -> dict:
        self.wait_for(lambda: not self.on_engine(lambda e: e.requests), "the engine to forget every request")
        return self.on_engine(lambda e: {"unfinished": e.has_unfinished_requests(),
                                         "used_blocks": e.block_manager.usage().used_blocks,
                                         "running": len(e.scheduler.running)})

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.url + "/metrics", timeout=WAIT_S).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@contextmanager
def serving(lab: Lab, clock: Callable[[], float] | None = None, max_num_seqs: int = 1, **app_options):
    engine = LLMEngine(lab.model, lab.tok, engine_config(MODEL, max_num_seqs=max_num_seqs),
                       **({"clock": clock} if clock else {}))
    with BackgroundServer(build_app(engine, **app_options)) as server:
        yield Served(server.url, server.app.state.front)


def completion(lab: Lab, name: str, **extra) -> dict:
    return {"model": MODEL, "prompt": lab.prompts[name], "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}


def post(served: Served, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=WAIT_S)


def token_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def assert_openai_error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code
    return error


@contextmanager
def busy_request(served: Served, **extra):
    """A streamed request that runs (one token per step) while the block is inside; leaving it hangs up."""
    with httpx.stream("POST", served.url + "/v1/completions", json={**BUSY, **extra}, timeout=WAIT_S) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it has its first token: it holds a seat
        yield lines


# ---- 503: the queue caps ---------------------------------------------------------------------------------


def test_past_max_num_queued_reqs_a_new_request_gets_503_and_the_admitted_one_is_served(lab):
    with serving(lab, limits=AdmissionLimits(max_num_queued_reqs=2)) as served, ThreadPoolExecutor(1) as pool:
        with busy_request(served):
            waiting = pool.submit(post, served, completion(lab, "long"))  # max_num_seqs=1: it waits for a seat
            served.wait_for(lambda: served.load().num_requests == 2, "two requests in flight")
            refused = post(served, completion(lab, "short"))
            assert served.load().num_requests == 2, "the busy request ended too early for this test"
        assert_openai_error(refused, 503, "max_num_queued_reqs")
        assert refused.headers["Retry-After"] == "1"
        assert token_ids(waiting.result(WAIT_S)) == lab.expected["long"]
        assert served.metric("vllm:admission_rejections_total", reason="max_num_queued_reqs") == 1
        assert served.metric("vllm:request_aborts_total", reason="client_disconnect") == 1
        assert served.idle_state() == {"unfinished": False, "used_blocks": 0, "running": 0}
        assert token_ids(post(served, completion(lab, "short"))) == lab.expected["short"]  # room again


def test_past_max_num_queued_tokens_a_long_prompt_gets_503_and_a_short_one_gets_in(lab):
    cap = 30  # the busy request decodes (0 prompt tokens left); "long" (20) waits; 20 more would pass the cap
    with serving(lab, limits=AdmissionLimits(max_num_queued_tokens=cap)) as served, ThreadPoolExecutor(2) as pool:
        with busy_request(served):
            waiting = pool.submit(post, served, completion(lab, "long"))
            served.wait_for(lambda: served.load().num_queued_tokens == len(lab.prompts["long"]), "a queued prompt")
            refused = post(served, completion(lab, "other"))
            short = pool.submit(post, served, completion(lab, "short"))  # 20 + 5 <= 30: admitted
            served.wait_for(lambda: served.load().num_requests == 3, "the short prompt admitted")
        assert_openai_error(refused, 503, "max_num_queued_tokens")
        assert "Retry-After" in refused.headers
        assert token_ids(waiting.result(WAIT_S)) == lab.expected["long"]
        assert token_ids(short.result(WAIT_S)) == lab.expected["short"]
        assert served.metric("vllm:admission_rejections_total", reason="max_num_queued_tokens") == 1
        assert served.idle_state()["used_blocks"] == 0


# ---- 429: tenants' rates, tenants from API keys ----------------------------------------------------------------


KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-carol": "carol"}
ALICE_RATE = RateLimit(requests_per_s=0.1, request_burst=2)  # two at once, then one per 10 s
CAROL_TOKENS = RateLimit(tokens_per_s=1.0, token_burst=40)  # one request of <= 40 tokens, then a long wait


def client(served: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=WAIT_S)


def greedy(c: openai.OpenAI, lab: Lab, name: str) -> list[int]:
    r = c.completions.create(model=MODEL, prompt=lab.prompts[name], max_tokens=MAX_TOKENS, temperature=0,
                             extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"]


def test_a_tenant_past_its_rate_gets_429_while_another_tenant_is_served(lab):
    clock = HandClock()
    limits = AdmissionLimits(tenant_rate=ALICE_RATE, tenant_rates={"carol": CAROL_TOKENS})
    with serving(lab, clock, max_num_seqs=2, limits=limits, api_keys=KEYS) as served:
        alice, bob = client(served, "sk-alice"), client(served, "sk-bob")
        assert [greedy(alice, lab, "short"), greedy(alice, lab, "long")] == [lab.expected["short"],
                                                                            lab.expected["long"]]
        with pytest.raises(openai.RateLimitError) as refused:
            greedy(alice, lab, "short")
        assert refused.value.response.headers["Retry-After"] == str(round(1 / ALICE_RATE.requests_per_s))
        assert refused.value.body["code"] == "tenant_request_rate"
        assert greedy(bob, lab, "long") == lab.expected["long"]  # bob has a bucket of his own
        clock.advance(1 / ALICE_RATE.requests_per_s)
        assert greedy(alice, lab, "short") == lab.expected["short"]  # alice's bucket refilled
        tenants = served.on_engine(lambda e: [ev["tenant"] for r in e.trace.steps for ev in r.events
                                              if ev["type"] == "arrived"])
        assert tenants == ["alice", "alice", "bob", "alice"]  # the scheduler's tenants are the keys' tenants
        assert served.metric("vllm:admission_rejections_total", reason="tenant_request_rate") == 1


def test_a_tenant_past_its_token_rate_gets_429(lab):
    limits = AdmissionLimits(tenant_rates={"carol": CAROL_TOKENS})
    with serving(lab, HandClock(), limits=limits, api_keys=KEYS) as served:
        carol = client(served, "sk-carol")
        assert greedy(carol, lab, "short") == lab.expected["short"]  # 5 + 12 tokens of carol's 40
        with pytest.raises(openai.RateLimitError) as refused:
            greedy(carol, lab, "long")  # 20 + 12 > the 23 left
        assert refused.value.body["code"] == "tenant_token_rate"
        assert served.metric("vllm:admission_rejections_total", reason="tenant_token_rate") == 1


def test_a_server_with_keys_refuses_unknown_and_missing_keys_with_401(lab):
    with serving(lab, api_keys=KEYS) as served:
        with pytest.raises(openai.AuthenticationError):
            greedy(client(served, "sk-mallory"), lab, "short")
        assert_openai_error(post(served, completion(lab, "short")), 401, "invalid_api_key")
        assert served.idle_state()["used_blocks"] == 0


def data_events(lines) -> list[dict | str]:
    """The rest of an SSE stream's `data:` payloads, JSON-decoded (except the final "[DONE]")."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_a_tenant_can_cancel_only_its_own_requests_even_under_the_same_id(lab):
    """Alice's request has a server-given id; bob names his own request with that very id. Bob's cancel reaches
    only his; alice's request is out of his reach (404, the answer for an unknown id) and of a keyless call (401)."""
    alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    with serving(lab, max_num_seqs=2, api_keys=KEYS) as served:

        def cancel(request_id: str, headers: dict) -> httpx.Response:
            return httpx.post(f"{served.url}/v1/requests/{request_id}/cancel", headers=headers, timeout=WAIT_S)

        def running() -> list[str]:
            return served.on_engine(lambda e: sorted(r.request_id for r in e.scheduler.running))

        with httpx.stream("POST", served.url + "/v1/completions", json=BUSY, headers=alice, timeout=WAIT_S) as a:
            alice_lines = a.iter_lines()
            request_id = json.loads(next(x for x in alice_lines if x.startswith("data: "))[len("data: "):])["id"]
            with httpx.stream("POST", served.url + "/v1/completions", json=BUSY, timeout=WAIT_S,
                              headers={**bob, "X-Request-Id": request_id}) as b:
                bob_lines = b.iter_lines()
                first = next(x for x in bob_lines if x.startswith("data: "))
                assert json.loads(first[len("data: "):])["id"] == request_id
                assert running() == [f"alice/{request_id}", f"bob/{request_id}"]  # one id, two namespaces
                assert_openai_error(cancel(request_id, {}), 401, "invalid_api_key")
                assert cancel(request_id, bob).json() == {"id": request_id, "object": "request", "status": "cancelled"}
                bob_events = data_events(bob_lines)
            assert bob_events[-1] == "[DONE]" and bob_events[-2]["choices"][0]["finish_reason"] == "abort"
            assert running() == [f"alice/{request_id}"], "alice's request runs on"
            assert_openai_error(cancel(request_id, bob), 404, "request_not_found")  # alice's is not bob's to see
            assert running() == [f"alice/{request_id}"]
            assert cancel(request_id, alice).status_code == 200
            alice_events = data_events(alice_lines)
        assert alice_events[-2]["choices"][0]["finish_reason"] == "abort"
        assert served.metric("vllm:request_aborts_total", reason="cancelled") == 2
        assert served.idle_state() == {"unfinished": False, "used_blocks": 0, "running": 0}


# ---- timeouts: abort, free the blocks, tell the client, count it ------------------------------------------------


def test_timeouts_abort_their_requests_and_free_every_block(lab):
    clock, queue_s, total_s = HandClock(), 5.0, 100.0
    limits = AdmissionLimits(queue_timeout_s=queue_s, request_timeout_s=total_s)
    with serving(lab, clock, limits=limits) as served, ThreadPoolExecutor(1) as pool:
        with busy_request(served) as busy:
            # the waiting request asks for a shorter queue timeout than the server's: it applies
            waiting = pool.submit(post, served, completion(lab, "long", queue_timeout_s=queue_s / 2))
            served.wait_for(lambda: served.load().num_requests == 2, "the second request waiting")
            clock.advance(queue_s / 2 + 1)  # past the waiting request's deadline, not the server's
            error = assert_openai_error(waiting.result(WAIT_S), 503, "queue_timeout")
            assert "queue" in error["message"] and waiting.result().headers["Retry-After"]
            assert served.load().num_requests == 1, "the busy request is still running"
            clock.advance(total_s)  # past the busy request's total deadline
            events = [line[len("data: "):] for line in busy if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
        assert served.idle_state() == {"unfinished": False, "used_blocks": 0, "running": 0}
        for reason in ("queue_timeout", "request_timeout"):
            assert served.metric("vllm:request_aborts_total", reason=reason) == 1, reason
        assert served.metric("vllm:request_aborts_total", reason="client_disconnect") == 0
        assert served.metric("vllm:request_success_total", finished_reason="abort") == 2


# ---- a flood of bad requests ------------------------------------------------------------------------------------


FLOOD_ROUNDS = 20  # each bad request this many times, eight at once


def bad_requests(lab: Lab) -> list[tuple[dict | bytes, dict, int]]:
    """(body, headers, expected status): each refused before it could cost anything."""
    alice = {"Authorization": "Bearer sk-alice"}
    good = completion(lab, "short")
    return [
        (b'{"model": "tinylab", "prompt": ', alice, 400),
        (good, {}, 401),
        (good, {"Authorization": "Bearer nope"}, 401),
        (good, {"Authorization": "Basic sk-alice"}, 401),
        ({**good, "prompt": [5, 10**7]}, alice, 400),  # reaches the engine, which refuses it
        ({**good, "max_tokens": "many"}, alice, 400),
        ({**good, "queue_timeout_s": -1.0}, alice, 400),
        ({**good, "request_timeout_s": "soon"}, alice, 400),
        ({**good, "n": 99}, alice, 400),
        ({**good, "model": "gpt-5"}, alice, 404),
    ]


def test_a_flood_of_bad_requests_leaves_the_server_serving_and_the_tenants_rate_unspent(lab):
    limits = AdmissionLimits(max_num_queued_reqs=4, tenant_rate=RateLimit(requests_per_s=0.1, request_burst=1))
    with (serving(lab, HandClock(), limits=limits, api_keys=KEYS) as served, ThreadPoolExecutor(8) as pool,
          httpx.Client(base_url=served.url, timeout=WAIT_S) as http):
        huge = ({**completion(lab, "short"), "prompt": "x" * (2 << 20)}, {"Authorization": "Bearer sk-alice"}, 413)
        cases = bad_requests(lab) * FLOOD_ROUNDS + [huge]

        def send(case):
            body, headers, _ = case
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return http.post("/v1/completions", content=content,
                             headers={"content-type": "application/json", **headers}).status_code

        statuses = list(pool.map(send, cases))
        assert statuses == [status for _, _, status in cases]
        assert httpx.get(served.url + "/health").status_code == 200
        assert served.idle_state() == {"unfinished": False, "used_blocks": 0, "running": 0}
        assert served.metric("vllm:admission_rejections_total") == 0
        # alice's one request of this 10 s window is still hers: refused requests never spent it
        assert greedy(client(served, "sk-alice"), lab, "story") == lab.expected["story"]

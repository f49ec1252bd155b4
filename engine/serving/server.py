"""An OpenAI-compatible HTTP server over the step-through engine (chapter 09), on FastAPI + uvicorn.

    python -m engine serve --model tinylab --port 8000
    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tinylab", "prompt": "12+7=", "max_tokens": 8,
              "temperature": 0, "stream": true}'

Endpoints: POST /v1/completions and /v1/chat/completions (OpenAI's request and response shapes; with
"stream": true, server-sent events), POST /v1/requests/{request_id}/cancel (below), GET /v1/models,
/health and /metrics (Prometheus text in vLLM's names: engine/serving/prometheus.py).

A request's way through the server, one direction only:

    HTTP body ──► read (at most max_request_bytes, else 413) ──► JSON (else 400)
      ──► typed fields (else 400) ──► model name (else 404)
      ──► tokenize, check the context and n (else 400) ──► SamplingParams
      ──► AsyncLLMEngine.add_request (the engine's own checks, else 400)
      ──► one update per engine step
      ──► SSE chunks `data: {...}` ... `data: [DONE]`   (or one JSON body when "stream" is false)

Every refusal happens before the engine is touched, or inside `LLMEngine.add_request`, which keeps
nothing from a request it rejects: a bad request leaves no trace, and everybody else is served as
before. Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so clients
raise their usual exceptions (`openai.BadRequestError`, `openai.NotFoundError`, ...).

A client that hangs up (closes the stream, or gives up on a non-streamed request) aborts its
request: its KV blocks are back in the pool before the engine's next step.

Cancelling by id (chapter 10). Every request has an id: the response's "id" (in every stream chunk),
also sent as the `X-Request-Id` response header, which a stream's client has at once. A non-streamed
answer (and its id) only arrives at the end, so a client may name its request itself: send
`X-Request-Id: <id>` (1 to 128 of the characters A-Z a-z 0-9 . _ ~ -, so the id goes into a URL as
it is) and that is the request's id; an id still in flight gets 409. Then anyone holding the id
(another connection, a gateway, a "stop" button) may call

    POST /v1/requests/{request_id}/cancel
        ->  200 {"id": ..., "object": "request", "status": "cancelled"}

We use OpenAI's verb for stopping work it started (POST /v1/responses/{id}/cancel,
/v1/batches/{id}/cancel); vLLM has no such route (it aborts on disconnect only), SGLang has
POST /abort_request with the id in the body. The request is aborted on the engine thread before the
cancel returns, so its KV blocks are free before the next step. Its stream ends like any aborted
one: a last chunk with finish_reason "abort" (then usage, if asked, and `data: [DONE]`), with no
error event, because the stop was asked for; a non-streamed waiter gets 200 with the text so far and
finish_reason "abort". It counts in `vllm:request_aborts_total{reason="cancelled"}`. An id that is
unknown or finished already gets 404 ("request_not_found"). With API keys, ids live in a namespace
per tenant (two tenants may both say "job-1"; the engine's id is "<tenant>/<id>"): a key can only
reach its own tenant's requests, and another tenant's id is answered 404 exactly like an unknown one
(not 403), so a key cannot probe which ids others use. Without keys there is no identity to check:
the id is the permission (the server's own ids are random UUIDs; a client's own ids are as guessable
as the client makes them).

Extras beyond OpenAI's fields, with vLLM's names: top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, and return_token_ids (each choice then carries its "token_ids").
OpenAI's `user` becomes the engine's tenant (per-tenant quotas, prefix-cache scope, and per-tenant
metrics buckets), unless the server was given API keys (`api_keys`, key -> tenant): then the tenant
is the bearer key's, and a request without a known key gets 401.

Structured outputs, logprobs, echo, logit_bias and tools (chapter 13): OpenAI's response_format,
logit_bias, logprobs / top_logprobs, echo, tools + tool_choice ("none", "required", a named
function; "auto" is refused), and vLLM's structured_outputs / guided_json, _regex, _choice,
_grammar. engine/serving/openai_fields.py maps them to SamplingParams and shapes their answers
(logprobs, tool_calls); a field of either API that we do not implement is refused by name
(request_body.py).

Overload protection (chapter 10; the policy is engine/serving/admission.py, `AdmissionLimits`): past
`max_num_queued_reqs` requests in flight or `max_num_queued_tokens` prompt tokens still to prefill,
a new request gets 503 with Retry-After at once; past its tenant's rate, 429 with Retry-After (that
tenant only); a request not started within `queue_timeout_s` gets 503, one not finished within
`request_timeout_s` 504 (a stream gets an error event instead), and both are aborted, their blocks
freed. A request may ask for shorter timeouts with the extra fields `queue_timeout_s` /
`request_timeout_s`. /metrics counts rejections (`vllm:admission_rejections_total{reason}`) and
aborts (`vllm:request_aborts_total{reason}`: timeouts, client disconnects, cancels).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.serving.admission import Admission, AdmissionLimits, Rejected
from engine.serving.async_engine import AsyncLLMEngine, RequestStream, RequestUpdate
from engine.serving.openai_fields import (
    Asked,
    ConstraintFields,
    NamedToolChoice,
    ResponseExtras,
    TokenPieces,
    Tool,
    ToolCallIn,
    chat_asked,
    completion_asked,
    tool_calls_text,
)
from engine.serving.prometheus import ServerMetrics
from engine.serving.request_body import (
    SHOWN_INPUT_CHARS,
    BadBody,
    parse_json_body,
    refuse_unsupported,
)
from engine.trace import TraceRetention

# 1 MiB: about 250k tokens of English text, far more than any context we serve. A bigger body is
# refused (413) before it is read, so one huge upload cannot fill the server's memory.
MAX_REQUEST_BYTES = 1 << 20
# OpenAI's default for /v1/completions (chat: the rest of the context)
COMPLETION_DEFAULT_MAX_TOKENS = 16
STARTUP_WAIT_S = 30.0  # BackgroundServer: how long to wait for uvicorn to listen
STARTUP_POLL_S = 0.01
# BackgroundServer.stop: how long open streams may go on before they are cut
GRACEFUL_SHUTDOWN_S = 5.0
REQUEST_ID_HEADER = "X-Request-Id"  # vLLM's and most proxies' name for it
SHUTDOWN_ABORT = "shutdown"  # the abort reason of requests still running when a drain ends
# A client's own request id: URL-safe characters only (RFC 3986's unreserved set), so it goes
# into /v1/requests/{id}/cancel as it is; 128 characters hold a UUID with any prefix and still
# fit a log line.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


# ---- errors in OpenAI's shape --------------------------------------------------------------------


class OpenAIError(Exception):
    """An HTTP error with OpenAI's JSON body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)
        # HTTP's Retry-After counts whole seconds: we round up,
        # so a client that obeys it is never early
        self.headers = ({} if retry_after_s is None
                        else {"Retry-After": str(max(1, math.ceil(retry_after_s)))})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def _field_named(message: str, body: BaseModel) -> str | None:
    """The request field an engine error names ("prompt[1] = ...", "queue_timeout_s=-1 ..."), so
    that `param` says it too; None when it names none of the body's fields."""
    fields = set(type(body).model_fields)
    for match in re.finditer(r"\b([a-z_]+)(?:\[\d+\])?\s?=", message):
        if match.group(1) in fields:
            return match.group(1)
    return None


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN_INPUT_CHARS else text[:SHOWN_INPUT_CHARS] + "..."


def _validation_error(e: ValidationError) -> OpenAIError:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"][:1]) or None
    return bad_request(f"{param}: {first['msg']} (got {_short(first.get('input'))}); "
                       "see OpenAI's API reference for the field's type", param, "invalid_type")


# ---- the request bodies (OpenAI's fields, plus vLLM's sampling extras) ---------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Sampling(ConstraintFields):
    """Fields both endpoints share (with chapter 13's response_format, structured_outputs,
    guided_*, logit_bias: engine/serving/openai_fields.py).
    Strict: "16" is not a number; unknown fields are ignored (as vLLM)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = 0  # vLLM's extras from here on
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    # chapter 10: shorter timeouts than the server's, for this request
    queue_timeout_s: float | None = None
    request_timeout_s: float | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None


# ---- the server ----------------------------------------------------------------------------------


class OpenAIServer:
    """The handlers, holding everything they need (no module-level state): the engine front, the
    served model's name, its context length and the metrics.
    `build_app` wires them into a FastAPI app."""

    def __init__(self, engine: LLMEngine, model_name: str,
                 max_request_bytes: int = MAX_REQUEST_BYTES, limits: AdmissionLimits | None = None,
                 api_keys: dict[str, str] | None = None, trace: TraceRetention | None = None):
        if engine.tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer (prompts arrive as text)")
        self.engine, self.model_name, self.max_request_bytes = engine, model_name, max_request_bytes
        self.max_model_len = engine.max_model_len
        self.max_n = engine.config.scheduler.max_num_seqs
        self.metrics = ServerMetrics(model_name)
        self.pieces = TokenPieces(engine.tokenizer)  # token ids -> text and bytes, for logprobs
        self.vocab_size = engine.model.config.vocab_size
        # api_keys: bearer key -> tenant
        self.limits, self.api_keys = limits or AdmissionLimits(), api_keys
        self.front = AsyncLLMEngine(engine, on_step=self.metrics.on_step,
                                    on_finish=self.metrics.on_finish,
                                    admission=Admission(self.limits),
                                    on_abort=self.metrics.on_abort, trace=trace)
        self.created = int(time.time())
        # set by a graceful shutdown (engine/serving/shutdown.py): new requests get 503
        self.draining = False

    # ---- GET endpoints ---------------------------------------------------------------------------
    async def health(self) -> Response:
        """200 while we take requests; 503 once the engine thread stopped or a shutdown began
        (a load balancer then sends new traffic elsewhere)."""
        if self.draining:
            return Response(status_code=503, content=b"shutting down")
        ok = self.front.is_running
        return Response(status_code=200 if ok else 503,
                        content=b"" if ok else b"engine thread is not running")

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "servelab",
                                            "root": self.model_name,
                                            "max_model_len": self.max_model_len}]}

    async def metrics_text(self) -> Response:
        return await self.metrics.scrape(self.front)  # engine/serving/prometheus.py

    # ---- POST endpoints --------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        prompt = self._completion_prompt(body)
        ids = (await asyncio.to_thread(self.engine.tokenizer.encode, prompt)
               if isinstance(prompt, str) else prompt)
        room = self._check_context(len(ids), "prompt")
        max_tokens = (body.max_tokens if body.max_tokens is not None
                      else min(COMPLETION_DEFAULT_MAX_TOKENS, room))
        text = prompt if isinstance(prompt, str) else None  # ids: decoded for echo, once checked
        asked = completion_asked(body, self.pieces, self.vocab_size, text, ids)
        if body.echo and max_tokens == 0:  # the prompt's logprobs alone: the engine draws one
            max_tokens = 1  # token, which the answer leaves out (openai_fields.py)
        return await self._serve(request, body, ids, max_tokens, "cmpl", _CompletionShape(),
                                 asked)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        asked = chat_asked(body, self.pieces, self.vocab_size)
        messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
        tok = self.engine.tokenizer
        try:  # the same prompt as LLM.chat: the model's template, tokenized as it stands
            text = tok.apply_chat_template(messages)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        ids = await asyncio.to_thread(tok.encode, text, False)
        room = self._check_context(len(ids), "messages")
        limit = (body.max_completion_tokens if body.max_completion_tokens is not None
                 else body.max_tokens)
        return await self._serve(request, body, ids, room if limit is None else limit, "chatcmpl",
                                 _ChatShape(), asked)

    async def cancel(self, request: Request, request_id: str) -> dict:
        """POST /v1/requests/{request_id}/cancel: abort a request in flight
        (see the module docstring)."""
        # with keys: 401 for an unknown key, else only its tenant's ids
        scope = self._key_tenant(request)
        if not await self.front.abort(_engine_id(request_id, scope), "cancelled"):
            mine = " of this API key's tenant" if scope is not None else ""
            raise OpenAIError(404, f"no request{mine} with id {request_id!r} is in flight: "
                              "it finished already or never existed "
                              "(the id is the response's \"id\" or its X-Request-Id header)",
                              "request_id", "request_not_found", "not_found_error")
        return {"id": request_id, "object": "request", "status": "cancelled"}

    # ---- the shared path -------------------------------------------------------------------------
    async def _parse(self, request: Request, model: type[BaseModel]):
        if self.draining:
            raise OpenAIError(503, "the server is shutting down: it finishes the requests it has "
                              "and takes no new ones; send this one to another server",
                              None, "shutting_down", "server_error")
        self._key_tenant(request)  # an unknown key is refused before we read its body
        data = await self._read_json(request)
        try:
            refuse_unsupported(data, "completions" if model is CompletionRequest
                               else "chat/completions")
        except BadBody as e:
            raise bad_request(e.message, e.param, e.code) from None
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        if body.model != self.model_name:
            raise OpenAIError(404, f"The model `{body.model}` does not exist. This server serves "
                              f"{self.model_name!r} (GET /v1/models lists it).", "model",
                              "model_not_found")
        if not 1 <= body.n <= self.max_n:
            raise bad_request(f"n={body.n}: this server runs at most max_num_seqs={self.max_n} "
                              f"sequences together, so n must be in [1, {self.max_n}]", "n")
        return body

    async def _read_json(self, request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise self._too_large(int(declared))
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                raise self._too_large(len(body))
        try:
            data = parse_json_body(bytes(body))
        except BadBody as e:
            raise bad_request(e.message, e.param, e.code) from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object, "
                              f"got a {type(data).__name__}")
        return data

    def _key_tenant(self, request: Request) -> str | None:
        """The tenant of the request's `Authorization: Bearer <key>`
        (None when the server has no keys)."""
        if self.api_keys is None:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        tenant = self.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise OpenAIError(401, "Incorrect API key provided: send `Authorization: Bearer <key>` "
                              "with a key this server was started with (--api-key TENANT=KEY)",
                              None, "invalid_api_key")
        return tenant

    def _too_large(self, size: int) -> OpenAIError:
        return OpenAIError(413, f"the request body has {size} bytes or more; this server accepts "
                           f"at most {self.max_request_bytes} (max_request_bytes): "
                           "send a shorter prompt", None, "request_too_large")

    @staticmethod
    def _completion_prompt(body: CompletionRequest) -> str | list[int]:
        if body.suffix is not None:
            raise bad_request("suffix is not supported by this server (it would change the answer "
                              "and we do not implement it); leave it out", "suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request(f"prompt: got a batch of {len(prompt)} prompts; "
                                  "this server takes one prompt per request "
                                  "(send them as separate requests: they are batched anyway)",
                                  "prompt")
            prompt = prompt[0]
        if not prompt:
            raise bad_request("prompt is empty; give at least one character or token id", "prompt")
        return prompt

    def _check_context(self, n_prompt: int, param: str) -> int:
        """The room left for the answer; a prompt that fills the context is refused."""
        room = self.max_model_len - n_prompt
        if room < 1:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} "
                              f"tokens, but the {param} has {n_prompt} tokens, leaving no room "
                              f"for an answer. Please shorten the {param}.", param,
                              "context_length_exceeded")
        return room

    def _params(self, body: _Sampling, n_prompt: int, max_tokens: int,
                extra: dict) -> SamplingParams:
        if n_prompt + max_tokens > self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} "
                              f"tokens. However, you requested {n_prompt + max_tokens} tokens "
                              f"({n_prompt} in the prompt, {max_tokens} for the completion). "
                              "Please reduce max_tokens to at most "
                              f"{self.max_model_len - n_prompt} or shorten the prompt.",
                              "max_tokens", "context_length_exceeded")
        try:
            return SamplingParams(
                n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop,
                stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, **extra)
        except ValueError as e:  # "SamplingParams.<field>=... is not allowed: ..."
            field = str(e).split("=", 1)[0].removeprefix("SamplingParams.")
            raise bad_request(str(e), field if field.isidentifier() else None) from None

    async def _serve(self, request: Request, body: _Sampling, ids: list[int], max_tokens: int,
                     kind: str, shape: _Shape, asked: Asked) -> Response:
        params = self._params(body, len(ids), max_tokens, asked.sampling)
        tenant = body.user if self.api_keys is None else self._key_tenant(request)
        public_id, request_id = await self._request_id(request, kind,
                                                       None if self.api_keys is None else tenant)
        try:
            stream = await self.front.add_request(ids, params, request_id, body.queue_timeout_s,
                                                  body.request_timeout_s, tenant=tenant)
        except Rejected as e:  # overload or the tenant's rate: the engine kept nothing
            self.metrics.on_reject(e.reason)
            kind = "rate_limit_error" if e.status == 429 else "server_error"
            raise OpenAIError(e.status, e.message, None, e.reason, kind, e.retry_after_s) from None
        except (ValueError, TypeError) as e:  # the engine's checks: it kept nothing
            raise _engine_refusal(str(e), body, asked) from None
        reply = _Reply(public_id, int(time.time()), self.model_name, body, shape,
                       self.limits.retry_after_s, asked.extras)
        if body.stream:
            return StreamingResponse(_sse(stream, reply), media_type="text/event-stream",
                                     headers={REQUEST_ID_HEADER: public_id})
        updates = await _collect(stream, request)
        if updates is None:  # the client hung up: nobody to answer
            return Response(status_code=499)
        response = reply.whole(updates)
        response.headers[REQUEST_ID_HEADER] = public_id
        return response

    async def _request_id(self, request: Request, kind: str, scope: str | None) -> tuple[str, str]:
        """(the id the client sees, the engine's id): the client's X-Request-Id, else
        "<kind>-<uuid>"; with API keys the engine's id is "<tenant>/<id>" (`scope` is the tenant),
        so tenants never collide."""
        asked = request.headers.get(REQUEST_ID_HEADER)
        if asked is None:
            public_id = f"{kind}-{uuid.uuid4().hex}"
            return public_id, _engine_id(public_id, scope)
        if CLIENT_REQUEST_ID.fullmatch(asked) is None:
            raise bad_request(f"{REQUEST_ID_HEADER}: {_short(asked)} is not a usable request id; "
                              "use 1 to 128 of the characters A-Z a-z 0-9 . _ ~ - "
                              "(or leave the header out for a server id)",
                              None, "invalid_request_id")
        engine_id = _engine_id(asked, scope)
        if await self.front.run(lambda e: engine_id in e.requests):
            raise OpenAIError(409, f"{REQUEST_ID_HEADER}: a request with id {asked!r} is still in "
                              "flight; give each request an id of its own", None,
                              "duplicate_request_id")
        return asked, engine_id


def _engine_id(public_id: str, scope: str | None) -> str:
    """The engine's request id for a client's id:
    the id itself, or "<tenant>/<id>" with API keys."""
    return public_id if scope is None else f"{scope}/{public_id}"


def _engine_refusal(message: str, body: _Sampling, asked: Asked) -> OpenAIError:
    """The 400 for an engine error, naming the field it is about. A constraint that could not be
    compiled (engine/structured/grammar.py says "structured_outputs.<kind> ...") is about the
    field the constraint came from: response_format, guided_json, tool_choice, ..."""
    field = asked.constraint_field
    if field is not None and "structured_outputs" in message:
        return bad_request(f"{field}: the constraint cannot be used: {message}", field,
                           "invalid_constraint")
    return bad_request(message, _field_named(message, body))


def _message_dict(m: ChatMessage, i: int) -> dict:
    """An OpenAI message as the chat template wants it: text content only ("developer" is a
    system turn; an assistant turn's tool calls are written out as the calls' JSON)."""
    content = m.content or ""
    if isinstance(content, list):
        if any(p.type != "text" for p in content):
            raise bad_request(f"messages[{i}].content: only text parts are supported "
                              "(type 'text')", "messages")
        content = "".join(p.text for p in content)
    if m.tool_calls:
        content = "\n".join(filter(None, [content, tool_calls_text(m.tool_calls)]))
    return {"role": "system" if m.role == "developer" else m.role, "content": content}


# ---- response shapes: one class per endpoint, one _Reply per request -----------------------------


class _Shape:
    object_whole: str
    object_chunk: str

    def choice_chunk(self, index: int, text: str, reason: str | None, first: bool) -> dict:
        raise NotImplementedError

    def choice_whole(self, index: int, text: str, reason: str | None) -> dict:
        raise NotImplementedError


class _CompletionShape(_Shape):
    object_whole = object_chunk = "text_completion"

    def choice_chunk(self, index, text, reason, first):
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    def choice_whole(self, index, text, reason):
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}


class _ChatShape(_Shape):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"

    def choice_chunk(self, index, text, reason, first):
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def choice_whole(self, index, text, reason):
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}


class _Reply:
    """Turns one request's `RequestUpdate`s into OpenAI chunks (streaming) or one response body."""

    def __init__(self, request_id: str, created: int, model: str, body: _Sampling, shape: _Shape,
                 retry_after_s: float, extras: ResponseExtras):
        self.id, self.created, self.model, self.retry_after_s = (request_id, created, model,
                                                                 retry_after_s)
        self.shape, self.n = shape, body.n
        self.usage_chunks = bool(body.stream_options and body.stream_options.include_usage)
        self.token_ids = body.return_token_ids
        self.started: set[int] = set()
        self.extras = extras  # logprobs, echo, tool calls (openai_fields.py)

    def chunks(self, update: RequestUpdate) -> list[dict]:
        """One chunk per sample that changed in this step (one token each);
        then, at the end, usage."""
        out = []
        self.extras.prompt_logprobs = update.prompt_logprobs or self.extras.prompt_logprobs
        for d in update.deltas:
            if d.finish_reason == "error":
                out.append(OpenAIError(500, "the engine failed while serving this request: "
                                       f"{d.error}", None, "engine_error", "server_error").body())
                continue
            first = d.index not in self.started
            choice = self.shape.choice_chunk(d.index, d.text, d.finish_reason, first)
            self.started.add(d.index)
            if self.token_ids:
                choice["token_ids"] = d.token_ids
            choice = self.extras.stream_choice(choice, d, first)
            chunk = {**self._head(self.shape.object_chunk), "choices": [choice]}
            out.append({**chunk, "usage": None} if self.usage_chunks else chunk)
        timeout = self.timeout_error(update)
        if timeout is not None:
            out.append(timeout.body())
        if update.finished and self.usage_chunks:
            out.append({**self._head(self.shape.object_chunk), "choices": [],
                        "usage": _usage(update)})
        return out

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def timeout_error(self, update: RequestUpdate) -> OpenAIError | None:
        """The error for a request its deadline aborted (engine/serving/admission.py's
        `Deadlines`), or a shutdown's drain deadline (engine/serving/shutdown.py), else None."""
        if update.abort_reason == "queue_timeout":
            return OpenAIError(503, "the request waited longer than its queue timeout "
                               "(queue_timeout_s) for its first step and was aborted: "
                               "the server is overloaded, retry later",
                               None, "queue_timeout", "server_error", self.retry_after_s)
        if update.abort_reason == "request_timeout":
            return OpenAIError(504, "the request ran past its deadline (request_timeout_s) "
                               "and was aborted; ask for fewer max_tokens or a longer "
                               "request_timeout_s", None, "request_timeout", "timeout_error")
        if update.abort_reason == SHUTDOWN_ABORT:
            return OpenAIError(503, "the server shut down before this request finished (it "
                               "drained for its --shutdown-timeout, then stopped): retry it",
                               None, "server_shutdown", "server_error", self.retry_after_s)
        return None

    def whole(self, updates: list[RequestUpdate]) -> Response:
        timeout = self.timeout_error(updates[-1])
        if timeout is not None:
            return timeout.response()
        texts, tokens, reasons = [""] * self.n, [[] for _ in range(self.n)], [None] * self.n
        logprobs = [[] for _ in range(self.n)]
        for u in updates:
            self.extras.prompt_logprobs = u.prompt_logprobs or self.extras.prompt_logprobs
            for d in u.deltas:
                texts[d.index] += d.text
                tokens[d.index] += d.token_ids
                logprobs[d.index] += d.logprobs or []
                if d.finish_reason == "error":
                    return OpenAIError(500, "the engine failed while serving this request: "
                                       f"{d.error}", None, "engine_error",
                                       "server_error").response()
                reasons[d.index] = d.finish_reason or reasons[d.index]
        choices = [self.shape.choice_whole(i, texts[i], reasons[i]) for i in range(self.n)]
        if self.token_ids:
            for c, ids in zip(choices, tokens, strict=True):
                c["token_ids"] = ids
        choices = [self.extras.whole_choice(c, i, tokens[i], logprobs[i])
                   for i, c in enumerate(choices)]
        body = {**self._head(self.shape.object_whole), "choices": choices,
                "usage": _usage(updates[-1])}
        return JSONResponse(body)


def _usage(update: RequestUpdate) -> dict:
    return {"prompt_tokens": update.prompt_tokens, "completion_tokens": update.completion_tokens,
            "total_tokens": update.prompt_tokens + update.completion_tokens}


async def _sse(stream: RequestStream, reply: _Reply) -> AsyncIterator[str]:
    """Server-sent events: `data: <json>` and a blank line per chunk, then `data: [DONE]`. When the
    client hangs up, Starlette cancels this generator; `finally` then aborts the request."""
    try:
        async for update in stream:
            for chunk in reply.chunks(update):
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose("client_disconnect")  # a no-op when the stream ended


async def _collect(stream: RequestStream, request: Request) -> list[RequestUpdate] | None:
    """Every update of a non-streamed request,
    or None if the client hung up first (then it is aborted)."""
    updates: list[RequestUpdate] = []

    async def consume() -> None:
        async for update in stream:
            updates.append(update)

    consumer, watcher = (asyncio.ensure_future(consume()),
                         asyncio.ensure_future(_client_gone(request)))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (consumer, watcher):
            task.cancel()
        await stream.aclose("client_disconnect")  # a no-op when the stream ended
    return updates if consumer in done else None


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the app -------------------------------------------------------------------------------------


def build_app(engine: LLMEngine, model_name: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES, limits: AdmissionLimits | None = None,
              api_keys: dict[str, str] | None = None,
              trace: TraceRetention | None = None) -> FastAPI:
    """A FastAPI app serving `engine` under `model_name` (default: the engine's model name). The app
    holds its own AsyncLLMEngine (started and stopped with the app's lifespan) at `app.state.front`,
    the metrics at `app.state.metrics`. `limits`: overload protection
    (engine/serving/admission.py; default: none); `api_keys`: bearer key -> tenant
    (default: no keys, the tenant is OpenAI's `user`); `trace`: what the engine's trace keeps
    (default `TraceRetention.server()`: bounded)."""
    server = OpenAIServer(engine, model_name or engine.config.model, max_request_bytes, limits,
                          api_keys, trace)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.front.start()
        yield
        await asyncio.to_thread(server.front.shutdown)
        engine.trace.close()  # the trace file, if any

    app = FastAPI(title="servelab",
                  description="an OpenAI-compatible server over a step-through engine",
                  lifespan=lifespan)
    app.state.server, app.state.front, app.state.metrics = server, server.front, server.metrics
    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)
    app.get("/metrics")(server.metrics_text)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/v1/requests/{request_id}/cancel")(server.cancel)
    app.exception_handler(OpenAIError)(lambda request, exc: exc.response())
    # a field refused by engine/serving/openai_fields.py
    app.exception_handler(BadBody)(lambda request, exc: bad_request(exc.message, exc.param,
                                                                    exc.code).response())
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_internal_error)
    return app


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path 404, wrong method 405) in OpenAI's shape too."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       None, None, kind).response()


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}", None, None,
                       "server_error").response()


class BackgroundServer:
    """uvicorn in a background thread, on a free port by default: for notebooks and tests.

        with BackgroundServer(build_app(engine)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self.app, self.host, self.port, self.log_level = app, host, port, log_level
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # port 0: the OS picks a free one
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=self.log_level,
                                                     lifespan="on",
                                                     timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="servelab-http", daemon=True)
        self._thread.start()
        _wait_until(lambda: self._server.started or not self._thread.is_alive(), STARTUP_WAIT_S)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"the server did not start on {self.url} (see the log above)")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(STARTUP_WAIT_S)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_until(ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(STARTUP_POLL_S)


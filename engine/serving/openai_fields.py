"""The server's OpenAI surface for chapter 13: the request fields that constrain or score the
output, turned into `SamplingParams`, and the response shapes they ask for.

    request field                              SamplingParams           in the response
    -----------------------------------------  -----------------------  -----------------------
    response_format {"type": "json_object"}    structured_outputs       the text: a JSON object
    response_format {"type": "json_schema"}    structured_outputs.json  the text, schema-valid
    structured_outputs {json|regex|...}        structured_outputs       the text, constrained
    guided_json / _regex / _choice / _grammar  structured_outputs       (vLLM's older names)
    tools + tool_choice "required" / named     structured_outputs.json  message.tool_calls
    logit_bias {"<token id>": bias}            logit_bias {id: bias}    (the tokens chosen)
    chat: logprobs + top_logprobs (0..20)      logprobs = top_logprobs  logprobs.content
    completions: logprobs (0..5)               logprobs                 logprobs {tokens, ...}
    completions: echo (+ logprobs)             prompt_logprobs          the prompt, then the text

At most ONE field may constrain the output: two (say response_format and guided_regex) are refused
naming both, never resolved by a silent rule. A constraint the grammar library cannot compile is
refused by the engine's `add_request` (a ValueError, nothing kept), which the server answers 400
naming the field the constraint came from.

Tools. A model calls a tool by writing it out; a server has to recognise the call in the text. For
tool_choice "auto" that takes a parser per model family (each family marks calls its own way), so
we refuse "auto". For "required" and a named function we need no parser at all: we CONSTRAIN the
output to the call itself and read it back.

    tool_choice "required":   {"name": "get_weather", "arguments": {"city": "Oslo"}}
                              (anyOf over the tools: each one's name, with its parameters' schema)
    tool_choice {"type": "function", "function": {"name": "get_weather"}}:
                              {"city": "Oslo"}      (just the arguments, under that tool's schema)

Either way the answer is `message.tool_calls` (content null, finish_reason "tool_calls"), with the
arguments as the JSON text the model wrote. Streamed, the call's arguments arrive in pieces, as
OpenAI sends them: the first delta names the call (id, name), the others add to its arguments.

Logprobs come in two shapes: chat's, a list of {token, logprob, bytes, top_logprobs} per token, and
the legacy completions shape, four parallel lists {tokens, token_logprobs, top_logprobs,
text_offset}, in which `echo` puts the prompt first (its first token has no logprob: nothing comes
before it). That legacy shape is what evaluation harnesses read: lm-eval's `local-completions` sends
{"echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0} and sums token_logprobs over the
continuation's positions. `max_tokens` 0 with echo asks for the prompt's logprobs alone: the engine
still draws one token (it needs max_tokens >= 1), and we leave it out of the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling import StructuredOutputsParams, TokenLogprobs
from engine.serving.request_body import BadBody

MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's range for chat's top_logprobs: 0..20
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's range for the legacy completions' logprobs: 0..5
# JSON has no -inf: a token the constraint masked out has probability 0, and OpenAI and vLLM both
# write such a logprob as this number
NO_LOGPROB = -9999.0
# OpenAI's rule for a function's name
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# a function without `parameters` takes none (OpenAI: "omitting parameters defines a function with
# an empty parameter list")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# How the grammar library (llguidance, engine/structured/grammar.py) writes a tool call's JSON:
# one way only, compact, with OpenAI's separators. With JSON's free whitespace allowed, a small
# model can go on writing spaces and newlines until max_tokens, and the call never closes. (Under
# its "x-guidance" key in the schema: a JSON Schema keyword other libraries ignore.)
TOOL_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# the start of a "required" tool call, {"name": "...", "arguments": , up to the arguments' "{"
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


# ---- the request fields (pydantic; strict, as the rest of the body) ------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # we always enforce the schema (strict or not)
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` object: exactly one of its fields set. Unknown keys (vLLM's
    structural_tag, whitespace_pattern, ...) are refused: they would change the answer."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: ToolFunction


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A tool call in an earlier assistant turn of the conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"] = "function"
    function: CalledFunction


class ConstraintFields(BaseModel):
    """The fields both endpoints take that constrain or bias the output."""

    model_config = ConfigDict(strict=True, extra="ignore")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None


# ---- fields -> SamplingParams --------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What tool_choice asked for: "required" (any of the tools; the output names it) or "named"
    (that one function; the output is its arguments)."""

    mode: Literal["required", "named"]
    schema: dict  # what the output must match
    name: str | None = None  # the named function


def constraint_of(body: ConstraintFields, tools: ToolPlan | None = None
                  ) -> tuple[str, StructuredOutputsParams] | None:
    """(the field it came from, the constraint), or None when nothing constrains the output.
    Two fields constraining at once: BadBody naming both."""
    asked: dict[str, dict] = {}
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise BadBody('response_format: type "json_schema" needs a "json_schema" object '
                          '({"name": ..., "schema": {...}})', "response_format", "invalid_value")
        schema = rf.json_schema.schema_
        asked["response_format"] = {"json_object": True} if schema is None else {"json": schema}
    if body.structured_outputs is not None:
        so = body.structured_outputs
        asked["structured_outputs"] = {k: v for k, v in (
            ("json", so.json_), ("regex", so.regex), ("choice", so.choice),
            ("grammar", so.grammar), ("json_object", so.json_object)) if v is not None}
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            asked[f"guided_{kind}"] = {kind: value}
    if tools is not None:
        asked["tool_choice"] = {"json": tools.schema}
    if len(asked) > 1:
        first, second, *_ = asked
        raise BadBody(f"{first} and {second} both constrain the output; send only one of them",
                      first, "conflicting_constraints")
    if not asked:
        return None
    (name, kwargs), = asked.items()
    try:
        return name, StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise BadBody(f"{name}: {e}", name, "invalid_value") from None


def logit_bias_of(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"<token id>": bias}) as SamplingParams wants it ({id: bias}); every
    id checked against the vocabulary here, so the error names the field (the bias's range is
    SamplingParams's to check)."""
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        if not key.isdecimal() or int(key) >= vocab_size:
            raise BadBody(f"logit_bias: {key!r} is not a token id of this model; the keys are "
                          f"token ids as strings, \"0\" to \"{vocab_size - 1}\"", "logit_bias",
                          "invalid_value")
        bias[int(key)] = value
    return bias


def chat_logprobs_of(logprobs: bool, top_logprobs: int | None) -> int | None:
    """SamplingParams.logprobs for chat's logprobs (a bool) and top_logprobs (0..20)."""
    if top_logprobs is not None:
        if not logprobs:
            raise BadBody("top_logprobs needs logprobs: true (OpenAI's rule); set both",
                          "top_logprobs", "invalid_value")
        if not 0 <= top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise BadBody(f"top_logprobs={top_logprobs} is not allowed: it must be in "
                          f"[0, {MAX_CHAT_TOP_LOGPROBS}]", "top_logprobs", "invalid_value")
    return (top_logprobs or 0) if logprobs else None


def completion_logprobs_of(logprobs: int | None) -> int | None:
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise BadBody(f"logprobs={logprobs} is not allowed: on /v1/completions it must be in "
                      f"[0, {MAX_COMPLETION_LOGPROBS}] (the most likely tokens at each position)",
                      "logprobs", "invalid_value")
    return logprobs


def best_of_check(best_of: int | None, n: int) -> None:
    if best_of is not None and best_of != n:
        raise BadBody(f"best_of={best_of} is not supported: this server returns every sample it "
                      f"draws, so best_of must equal n={n} (or be left out); to choose among "
                      "samples, ask for n of them with logprobs and rank them yourself",
                      "best_of", "unsupported_value")


def tool_plan(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None
              ) -> ToolPlan | None:
    """The constraint tools + tool_choice ask for (None: answer in text)."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise BadBody(f"tool_choice={tool_choice!r} is not allowed: use \"none\", \"required\" or "
                      '{"type": "function", "function": {"name": ...}}', "tool_choice",
                      "invalid_value")
    if tool_choice == "none":
        return None  # the tools are not called: the answer is text
    if tool_choice == "auto":
        raise BadBody('tool_choice "auto" is not supported (the default when tools are given): '
                      "telling a free answer from a tool call needs a tool-call parser for the "
                      'model\'s family; send tool_choice "required", or name the function '
                      '({"type": "function", "function": {"name": ...}})', "tool_choice",
                      "unsupported_value")
    functions = _functions(tools)
    if tool_choice == "required":
        options = [{"type": "object", "properties": {"name": {"const": name},
                                                     "arguments": schema},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for name, schema in functions.items()]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return ToolPlan("required", {"x-guidance": TOOL_CALL_JSON, **schema})
    name = tool_choice.function.name
    if name not in functions:
        raise BadBody(f"tool_choice names the function {name!r}, which is not among the tools "
                      f"({', '.join(functions)})", "tool_choice", "invalid_value")
    return ToolPlan("named", {"x-guidance": TOOL_CALL_JSON, **functions[name]}, name)


def _functions(tools: list[Tool] | None) -> dict[str, dict]:
    """name -> parameters schema, each name checked."""
    if not tools:
        raise BadBody("tool_choice asks for a tool call, but the request has no tools; "
                      "send tools or leave tool_choice out", "tool_choice", "invalid_value")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if TOOL_NAME.fullmatch(name) is None or name in functions:
            why = "appears twice" if name in functions else "is not 1-64 of a-z A-Z 0-9 _ -"
            raise BadBody(f"tools[{i}].function.name {name!r} {why}; give each tool its own name",
                          "tools", "invalid_value")
        functions[name] = tool.function.parameters or NO_PARAMETERS
    return functions


def tool_calls_text(calls: list[ToolCallIn]) -> str:
    """An earlier assistant turn's tool calls, as the text the model would have written under
    tool_choice "required" (so the conversation it sees holds them, not nothing)."""
    return "\n".join(json.dumps({"name": c.function.name,
                                 "arguments": _json_or_text(c.function.arguments)},
                                ensure_ascii=False) for c in calls)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# ---- tokens as text and bytes --------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each of the 256 byte values as one printable character: the
    188 printable Latin-1 bytes as themselves, the other 68 (controls, space, ...) as the
    characters from U+0100 on, in byte order. Its inverse gives a token's exact bytes."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    moved = [b for b in range(256) if b not in table.values()]
    table.update({chr(0x100 + i): b for i, b in enumerate(moved)})
    return table


BYTE_LEVEL = _byte_level_alphabet()


class TokenPieces:
    """Each token id's text (as OpenAI shows it: special tokens spelled out) and exact bytes (a
    byte-level token may hold part of a character, which its text shows as U+FFFD), cached."""

    def __init__(self, tokenizer):
        from tokenizers import decoders

        self.tokenizer = tokenizer
        self.byte_level = isinstance(getattr(getattr(tokenizer, "tk", None), "decoder", None),
                                     decoders.ByteLevel)
        self._cache: dict[int, tuple[str, list[int]]] = {}  # at most one entry per vocabulary id

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = self.tokenizer.token_strings([token_id])[0] if self.byte_level else None
            if raw is not None and all(c in BYTE_LEVEL for c in raw):
                data = [BYTE_LEVEL[c] for c in raw]
            else:
                data = list(text.encode("utf-8"))
            self._cache[token_id] = (text, data)
        return self._cache[token_id]

    def text(self, token_id: int) -> str:
        return self.piece(token_id)[0]


def _finite(logprob: float) -> float:
    return logprob if logprob > NO_LOGPROB else NO_LOGPROB


def chat_logprobs(pieces: TokenPieces, entries: list[TokenLogprobs]) -> list[dict]:
    """Chat's shape, one per token: {token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}, ...]}."""
    def one(token_id: int, logprob: float) -> dict:
        text, data = pieces.piece(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": data}

    return [{**one(e.token_id, e.logprob),
             "top_logprobs": [one(t, lp) for t, lp in e.top.items()]} for e in entries]


def legacy_logprobs(pieces: TokenPieces, token_ids: list[int],
                    entries: list[TokenLogprobs | None], offset: int = 0) -> dict:
    """The completions shape: four lists, one item per token. top_logprobs holds the k most likely
    tokens and always the chosen one (OpenAI: "up to logprobs + 1 elements"); a token with no
    logprob (the prompt's first) has None in both. text_offset counts characters from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for token_id, e in zip(token_ids, entries, strict=True):
        text = pieces.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        ranked: dict[str, float] = {}
        for t, lp in [*e.top.items(), (e.token_id, e.logprob)]:
            ranked.setdefault(pieces.text(t), _finite(lp))  # two ids, one text: the likelier
        out["token_logprobs"].append(_finite(e.logprob))
        out["top_logprobs"].append(ranked)
    return out


# ---- what a request's fields add to its choices --------------------------------------------------


class ResponseExtras:
    """Per request, the response's side of its fields: `stream_choice` finishes one streamed
    choice (a dict in OpenAI's shape) from its delta, `whole_choice` one choice of the whole
    answer. `prompt_logprobs` is set by the server from the update that brings it. The base class
    adds nothing."""

    prompt_logprobs: list | None = None

    def stream_choice(self, choice: dict, delta, first: bool) -> dict:
        return choice

    def whole_choice(self, choice: dict, index: int, token_ids: list[int],
                     logprobs: list) -> dict:
        return choice


class CompletionExtras(ResponseExtras):
    """/v1/completions: logprobs in the legacy shape; echo puts the prompt (text, and with logprobs
    its tokens and their logprobs) first; `echo_only` (max_tokens 0) drops the drawn token.
    prompt_text None: the prompt came as token ids, decoded when first needed (by then the engine
    has checked them)."""

    def __init__(self, pieces: TokenPieces, logprobs: int | None, echo: bool,
                 prompt_text: str | None, prompt_ids: list[int], echo_only: bool):
        self.pieces, self.logprobs, self.echo, self.echo_only = pieces, logprobs, echo, echo_only
        self.prompt_text, self.prompt_ids = prompt_text, prompt_ids
        self.offsets: dict[int, int] = {}  # streaming: characters sent so far, per choice

    def _parts(self, text: str, token_ids: list[int], logprobs: list | None,
               first: bool) -> tuple[str, list[int], list]:
        logprobs = logprobs or [None] * len(token_ids)
        if self.echo_only:
            text, token_ids, logprobs = "", [], []
        if first and self.echo:
            scored = self.prompt_logprobs or [None] * len(self.prompt_ids)
            if self.prompt_text is None:
                self.prompt_text = self.pieces.tokenizer.decode(self.prompt_ids)
            text = self.prompt_text + text
            token_ids, logprobs = [*self.prompt_ids, *token_ids], [*scored, *logprobs]
        return text, token_ids, logprobs

    def stream_choice(self, choice, delta, first):
        text, ids, lps = self._parts(choice["text"], delta.token_ids, delta.logprobs, first)
        choice["text"] = text
        if self.echo_only and "token_ids" in choice:
            choice["token_ids"] = []
        if self.logprobs is not None:
            offset = self.offsets.get(delta.index, 0)
            choice["logprobs"] = legacy_logprobs(self.pieces, ids, lps, offset)
            self.offsets[delta.index] = offset + sum(map(len, choice["logprobs"]["tokens"]))
        return choice

    def whole_choice(self, choice, index, token_ids, logprobs):
        text, ids, lps = self._parts(choice["text"], token_ids, logprobs, True)
        choice["text"] = text
        if self.echo_only and "token_ids" in choice:
            choice["token_ids"] = []
        if self.logprobs is not None:
            choice["logprobs"] = legacy_logprobs(self.pieces, ids, lps)
        return choice


@dataclass
class _CallState:
    """One choice's tool call while it streams."""

    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    text: str = ""  # the output so far
    announced: bool = False  # the delta naming the call was sent
    sent: int = 0  # characters of the arguments sent


class ChatExtras(ResponseExtras):
    """/v1/chat/completions: logprobs in chat's shape; with a tool plan, the output read back as
    `tool_calls` (see the module docstring)."""

    def __init__(self, pieces: TokenPieces, logprobs: bool, tools: ToolPlan | None):
        self.pieces, self.logprobs, self.tools = pieces, logprobs, tools
        self.calls: dict[int, _CallState] = {}

    def _add_logprobs(self, choice: dict, entries: list | None) -> None:
        if self.logprobs:
            choice["logprobs"] = {"content": chat_logprobs(self.pieces, entries or []),
                                  "refusal": None}

    def whole_choice(self, choice, index, token_ids, logprobs):
        self._add_logprobs(choice, logprobs)
        if self.tools is None:
            return choice
        text = choice["message"]["content"]
        name, arguments, complete = read_call(self.tools, text)
        if name is None:  # not a call (cut short before its name): the text, as it came
            return choice
        call = {"id": _CallState().id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
        if complete and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        return choice

    def stream_choice(self, choice, delta, first):
        self._add_logprobs(choice, delta.logprobs)
        if self.tools is None:
            return choice
        state = self.calls.setdefault(delta.index, _CallState())
        state.text += delta.text
        name, arguments, complete = read_call(self.tools, state.text)
        new = {"role": "assistant"} if first else {}
        if name is not None:
            call = {"index": 0, "function": {"arguments": arguments[state.sent:]}}
            if not state.announced:
                call.update(id=state.id, type="function")
                call["function"]["name"] = name
            state.announced, state.sent = True, len(arguments)
            if call["function"]["arguments"] or "id" in call:
                new["tool_calls"] = [call]
        elif delta.finish_reason is not None:  # it ended before naming a call: send it as text
            new["content"] = state.text
        choice["delta"] = new
        if complete and delta.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"
        return choice


def read_call(plan: ToolPlan, text: str) -> tuple[str | None, str, bool]:
    """(the function's name, its arguments' JSON text, whether the arguments are complete) from the
    output so far; name None while (or if) the output names no call yet.

    Named: the whole output is the arguments. Required: {"name": ..., "arguments": {...}}: once its
    head is written we know the name, and the arguments are the JSON object that follows (complete
    when `raw_decode` reads a whole object there: an object ends exactly at its closing brace)."""
    if plan.mode == "named":
        return plan.name, text, _object_end(text, len(text) - len(text.lstrip())) is not None
    head = CALL_HEAD.match(text)
    if head is None:  # "arguments" written before "name": only a whole call can be read
        call = _json_or_text(text)
        if isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call:
            return call["name"], json.dumps(call["arguments"], ensure_ascii=False), True
        return None, "", False
    start = head.end()
    end = _object_end(text, start)
    return json.loads(head.group(1)), text[start:] if end is None else text[start:end], \
        end is not None


def _object_end(text: str, start: int) -> int | None:
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    return end


# ---- one request's fields, all at once -----------------------------------------------------------


@dataclass
class Asked:
    """What a request's chapter-13 fields ask for: SamplingParams keyword arguments, the field its
    constraint came from (so that a constraint the engine cannot compile is a 400 naming it), and
    the response's side."""

    sampling: dict
    constraint_field: str | None
    extras: ResponseExtras


def completion_asked(body, pieces: TokenPieces, vocab_size: int, prompt_text: str | None,
                     prompt_ids: list[int]) -> Asked:
    """/v1/completions: best_of, logprobs, echo (with max_tokens 0: the prompt alone)."""
    best_of_check(body.best_of, body.n)
    logprobs = completion_logprobs_of(body.logprobs)
    extras = CompletionExtras(pieces, logprobs, body.echo, prompt_text, prompt_ids,
                              echo_only=body.echo and body.max_tokens == 0)
    return _asked(body, vocab_size, None, extras, logprobs=logprobs,
                  prompt_logprobs=logprobs if body.echo else None)


def chat_asked(body, pieces: TokenPieces, vocab_size: int) -> Asked:
    """/v1/chat/completions: tools + tool_choice, logprobs + top_logprobs."""
    plan = tool_plan(body.tools, body.tool_choice)
    logprobs = chat_logprobs_of(body.logprobs, body.top_logprobs)
    return _asked(body, vocab_size, plan, ChatExtras(pieces, body.logprobs, plan),
                  logprobs=logprobs)


def _asked(body: ConstraintFields, vocab_size: int, plan: ToolPlan | None,
           extras: ResponseExtras, **sampling) -> Asked:
    constraint = constraint_of(body, plan)
    sampling["logit_bias"] = logit_bias_of(body.logit_bias, vocab_size)
    sampling["structured_outputs"] = None if constraint is None else constraint[1]
    return Asked(sampling, None if constraint is None else constraint[0], extras)

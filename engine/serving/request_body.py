"""Reading a request body safely: the JSON parsed strictly, and the fields we refuse by name.

Python's `json.loads` accepts what a server must not: NaN and Infinity (not JSON at all; a
temperature of Infinity samples noise), numbers that overflow a float (1e400 becomes inf), integers
of thousands of digits (int() then raises a ValueError naming no field), and nesting deep enough to
raise RecursionError. Each of those used to be a 500 that also dropped the keep-alive connection.
`parse_json_body` turns every one into `BadBody` naming the field; the server answers it as a 400
in OpenAI's error shape (engine/serving/server.py).

`refuse_unsupported` is the "no silent no" rule for fields: a field of OpenAI's or vLLM's API that
would change the answer and that we do not implement is refused by name. Other unknown fields are
ignored, as vLLM does.
"""

from __future__ import annotations

import json
import math

# A body's limits beyond its size (server.MAX_REQUEST_BYTES): OpenAI's deepest bodies (a JSON
# schema for structured outputs) nest a few tens of levels; Python's int() refuses more than 4,300
# digits with an error that names no field, and no field of ours needs more than 20 (2**64).
MAX_JSON_DEPTH = 64
MAX_NUMBER_DIGITS = 100
# Fields of OpenAI's and vLLM's APIs that change the answer and that we do not implement yet ->
# the one value that asks for nothing (sent as that, or null, they are accepted). Chapter 13 took
# response_format, structured_outputs, guided_json/_regex/_choice/_grammar, logit_bias, tools,
# tool_choice and top_logprobs off this list (engine/serving/openai_fields.py).
UNSUPPORTED_FIELDS = {
    "functions": None, "function_call": None, "prompt_logprobs": None,
    "guided_whitespace_pattern": None, "use_beam_search": False, "length_penalty": None,
    "allowed_token_ids": None, "bad_words": None, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "truncate_prompt_tokens": None, "prediction": None,
    "modalities": None, "audio": None,
}
# Fields only one endpoint takes -> that endpoint: sent to the other one, they are refused by name
# (the other endpoint's body does not know them, so they would be ignored)
ENDPOINT_FIELDS = {
    "tools": "chat/completions", "tool_choice": "chat/completions",
    "top_logprobs": "chat/completions", "parallel_tool_calls": "chat/completions",
    "echo": "completions", "suffix": "completions", "best_of": "completions",
}
SHOWN_INPUT_CHARS = 60  # a message quotes at most this much of a bad value or a path


class BadBody(ValueError):
    """A body we refuse: the message, the field it names (None: the body as a whole), a code."""

    def __init__(self, message: str, param: str | None, code: str):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def parse_json_body(body: bytes):
    """The body as JSON, or `BadBody` naming the field and what is wrong with it. Stricter
    than `json.loads`: no NaN / Infinity (not JSON, and a temperature of Infinity samples noise),
    no number that overflows a float (1e400) or has more than MAX_NUMBER_DIGITS digits, and at most
    MAX_JSON_DEPTH levels of nesting (Python's parser would otherwise raise RecursionError or an
    unnamed ValueError: a 500 that also dropped the connection)."""
    try:
        data = json.loads(body, parse_constant=_BadNumber.constant, parse_float=_BadNumber.float,
                          parse_int=_BadNumber.int)
    except RecursionError:
        raise BadBody(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                      None, "too_deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadBody(f"the request body is not valid JSON ({e}); send one JSON object",
                      None, "invalid_json") from None
    problem = _first_problem(data)
    if problem is not None:
        path, message, code = problem
        shown = path if len(path) <= SHOWN_INPUT_CHARS else path[:SHOWN_INPUT_CHARS] + "..."
        raise BadBody(f"{shown}: {message}", path.split(".")[0].split("[")[0] or None, code)
    return data


class _BadNumber:
    """What the parser puts where a number it must refuse stood, so that `_first_problem` can
    name the field (the parser's hooks do not know where they are)."""

    def __init__(self, message: str):
        self.message = message

    @staticmethod
    def constant(name: str):
        return _BadNumber(f"{name} is not a JSON number; send a finite number")

    @staticmethod
    def float(text: str):
        value = float(text)
        return value if math.isfinite(value) else _BadNumber(
            f"{text[:SHOWN_INPUT_CHARS]} overflows a 64-bit float; send a finite number")

    @staticmethod
    def int(text: str):
        digits = len(text.lstrip("-"))
        return int(text) if digits <= MAX_NUMBER_DIGITS else _BadNumber(
            f"a number of {digits} digits; at most {MAX_NUMBER_DIGITS} are accepted")


def _first_problem(data) -> tuple[str, str, str] | None:
    """(path, message, code) of the first refused number or of a value nested deeper than
    MAX_JSON_DEPTH; None when there is none. Iterative: no recursion of ours to blow."""
    todo = [(data, "", 0)]
    while todo:
        value, path, depth = todo.pop()
        where = path or "the request body"
        if isinstance(value, _BadNumber):
            return where, value.message, "invalid_number"
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            return where, f"nests deeper than {MAX_JSON_DEPTH} levels", "too_deep"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        children = [(child, f"{path}.{key}".lstrip(".") if isinstance(key, str)
                     else f"{path}[{key}]", depth + 1) for key, child in items]
        todo += reversed(children)  # depth first, in document order
    return None


def refuse_unsupported(data: dict, endpoint: str | None = None) -> None:
    """No silent no: a field of OpenAI's or vLLM's API that would change the answer and that we do
    not implement is refused by name (other unknown fields are ignored, as vLLM does); so is a
    field of the other endpoint (`endpoint`: "completions" or "chat/completions")."""
    for name, ignored in UNSUPPORTED_FIELDS.items():
        if data.get(name) is not None and data[name] != ignored:
            raise BadBody(f"{name} is not supported by this server (it would change the answer "
                          "and we do not implement it); leave it out", name, "unsupported_field")
    for name, home in ENDPOINT_FIELDS.items():
        if endpoint is not None and home != endpoint and data.get(name) is not None:
            raise BadBody(f"{name} is a field of POST /v1/{home}, not of /v1/{endpoint}; "
                          "leave it out or send the request there", name, "unsupported_field")

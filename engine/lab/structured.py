"""Chapter 13's experiments: does a grammar change what a model answers? One function per question.

    person_schema            the JSON schema of the SmolLM2 extraction prompts: name, age, city
    tinylab_json_schema      the JSON schema of tinylab's json task (engine/lab/tasks.py): its four
                             fields in schema order, any of them present
    extraction_prompts       n made-up records ("Mara Voss, 41, from Tallinn") as chat prompts that
                             ask for name / age / city as JSON, each with its true fields
    grade                    one completion judged: does it parse, does it fit the schema, which
                             fields are right
    refused_at               why a constraint changes an answer: the first token of an
                             UNconstrained reply that the schema's grammar would have masked
    quality_rows             greedy answers with or without the schema as a constraint, graded and
                             summed up per task: parse rate, schema-valid rate, field accuracy

What "parse" means here is what a client does with the reply: `json.loads` of the whole text (white
space around it allowed) must give a JSON object. A reply wrapped in a markdown fence, or followed
by a chat, does not parse. Field accuracy is kinder: it reads the first JSON object found anywhere
in the text, so it measures whether the model got the CONTENT right even when the wrapper is wrong.

The oracle: a constrained greedy reply that ended with "stop" (the grammar allowed EOS) must parse,
always; quality_rows raises AssertionError the moment one does not. A reply cut by max_tokens may
be an unfinished object, and is counted, not excused.

Nothing here is on a request's path: the engine applies the grammar (engine/structured/), we only
ask and count.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.lab.tasks import JSON_SCHEMA, MAX_NEW_TOKENS, Example
from engine.sampling import SamplingParams, StructuredOutputsParams

EXTRACT_TASK = "extract"  # Example.task of the SmolLM2 extraction prompts
PERSON_FIELDS = ("name", "age", "city")
EXTRACTION_SEED = 13  # chapter 13's default draw
# A reply of {"name": "...", "age": NN, "city": "..."} is about 20 SmolLM2 tokens; unconstrained
# replies add a fence or a sentence. 64 leaves room for both and still ends a rambling reply.
EXTRACT_MAX_TOKENS = 64
AGE_RANGE = (19, 87)

# Made-up people and places (not tinylab's lists, so the two experiments share nothing).
_FIRST = ("Mara", "Tobias", "Ines", "Kwame", "Sofia", "Arjun", "Elif", "Mateo", "Noor", "Lukas",
          "Amara", "Jonas", "Yara", "Felix", "Zofia", "Rafael")
_LAST = ("Voss", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Novak", "Castillo",
         "Berger", "Mensah", "Kowalski", "Iyer")
_TOWNS = ("Tallinn", "Porto", "Ghent", "Kraków", "Valparaíso", "Bergen", "Mombasa", "Leeds",
          "Utrecht", "Brno", "Cork", "Nagoya", "Tartu", "Lyon")
# One record in a few shapes: the fields in different orders and wordings, with a little noise.
_RECORDS = (
    "{name}, {age}, lives in {city}.",
    "Customer note: {name} ({age} years old) moved to {city} last spring.",
    "From {city}: {name}, aged {age}, called about a late parcel.",
    "{name} is {age} and works in {city} as a nurse.",
    "Guest list entry - city: {city}; age: {age}; name: {name}.",
)
_ASK = ("Extract the person's name, age and city from the text below. Answer with a JSON object "
        'with the keys "name", "age" (a number) and "city", and nothing else.\n\nText: {record}')


def person_schema() -> dict:
    """name (string), age (integer), city (string), all three required, nothing else allowed."""
    return {"type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                           "city": {"type": "string"}},
            "required": list(PERSON_FIELDS), "additionalProperties": False}


def tinylab_json_schema() -> dict:
    """tinylab's json task as a schema: its fields (name, age, city, job) in that order, each
    optional (a prompt mentions two to four of them), nothing else allowed."""
    types = {"age": "integer"}
    return {"type": "object",
            "properties": {k: {"type": types.get(k, "string")} for k in JSON_SCHEMA},
            "additionalProperties": False}


SCHEMAS: dict[str, Callable[[], dict]] = {"json": tinylab_json_schema, EXTRACT_TASK: person_schema}


def extraction_prompts(n: int, seed: int = EXTRACTION_SEED) -> list[Example]:
    """n extraction prompts for a chat model. Each Example has task "extract", the user's message as
    `prompt`, the true JSON as `target`, and meta {"fields": {name, age, city}, "messages": [...]}
    (the conversation to pass to `LLM.chat`). The same (n, seed) always gives the same prompts."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (how many prompts to make)")
    rng, out = random.Random(seed), []
    for _ in range(n):
        fields = {"name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
                  "age": rng.randint(*AGE_RANGE), "city": rng.choice(_TOWNS)}
        ask = _ASK.format(record=rng.choice(_RECORDS).format(**fields))
        out.append(Example(EXTRACT_TASK, ask, json.dumps(fields, ensure_ascii=False),
                           {"fields": fields, "messages": [{"role": "user", "content": ask}]}))
    return out


# ---- grading one reply ---------------------------------------------------------------------------


def parse_object(text: str) -> dict | None:
    """The client's view: the whole text (white space around it allowed) as one JSON object."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def first_object(text: str) -> dict | None:
    """The first JSON object anywhere in the text (after a fence, a sentence, ...), or None."""
    decoder, start = json.JSONDecoder(), text.find("{")
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            return obj
        start = text.find("{", start + 1)
    return None


def schema_valid(obj: dict | None, schema: dict) -> bool:
    """Does obj satisfy the schema, checked by the `jsonschema` package (an independent judge:
    not the library that built the mask)?"""
    if obj is None:
        return False
    try:
        import jsonschema
    except ImportError as e:
        raise ImportError("schema validity is judged by the jsonschema package: "
                          "pip install jsonschema") from e
    return jsonschema.Draft202012Validator(schema).is_valid(obj)


@dataclass
class Graded:
    """One reply, judged."""

    completion: str
    finish_reason: str | None
    parsed: bool  # json.loads(completion) is an object
    schema_valid: bool  # ... and it satisfies the schema
    fields_right: int  # true fields whose value the first object in the text got exactly
    fields_total: int
    token_ids: list[int] = field(default_factory=list)  # the reply's tokens (EOS included)


def grade(example: Example, completion: str, finish_reason: str | None, schema: dict,
          token_ids: Sequence[int] = ()) -> Graded:
    """Judge one reply against its example's true fields (meta["fields"]) and the schema."""
    obj, found = parse_object(completion), first_object(completion) or {}
    truth = example.meta["fields"]
    right = sum(found.get(k) == v for k, v in truth.items())
    return Graded(completion, finish_reason, obj is not None, schema_valid(obj, schema), right,
                  len(truth), list(token_ids))


# ---- the experiment ------------------------------------------------------------------------------


def params_for(task: str, constrained: bool, schema: dict | None = None) -> SamplingParams:
    """Greedy, the task's max_tokens, and (constrained) the schema as structured_outputs."""
    schema = schema if schema is not None else SCHEMAS[task]()
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW_TOKENS.get(task, EXTRACT_MAX_TOKENS),
        structured_outputs=StructuredOutputsParams(json=schema) if constrained else None)


def answer(llm, examples: Sequence[Example], params: SamplingParams) -> list:
    """Each example's CompletionOutput: chat examples (meta["messages"]) through `llm.chat`, the
    others (tinylab's plain prompts) through `llm.generate`, in the examples' order."""
    chats = [i for i, e in enumerate(examples) if "messages" in e.meta]
    plain = [i for i, e in enumerate(examples) if "messages" not in e.meta]
    outs: dict[int, object] = {}
    if chats:
        got = llm.chat([examples[i].meta["messages"] for i in chats], params, use_tqdm=False)
        outs.update(zip(chats, (o.outputs[0] for o in got), strict=True))
    if plain:
        got = llm.generate([examples[i].prompt for i in plain], params, use_tqdm=False)
        outs.update(zip(plain, (o.outputs[0] for o in got), strict=True))
    return [outs[i] for i in range(len(examples))]


def check_oracle(graded: Sequence[Graded], where: str) -> None:
    """Constrained greedy replies that ended with "stop" must parse: raise AssertionError if not."""
    bad = [g for g in graded if g.finish_reason == "stop" and not g.parsed]
    if bad:
        raise AssertionError(f"{where}: {len(bad)} constrained replies ended with 'stop' but do "
                             f"not parse, e.g. {bad[0].completion!r:.200}; the grammar's mask was "
                             "not applied on some path")


def _rate(hits: int, total: int) -> float:
    return hits / total if total else float("nan")


def summary_row(task: str, constrained: bool, graded: Sequence[Graded]) -> dict:
    """One row of the quality table."""
    return {"task": task, "constrained": constrained, "n": len(graded),
            "parse_rate": _rate(sum(g.parsed for g in graded), len(graded)),
            "schema_valid_rate": _rate(sum(g.schema_valid for g in graded), len(graded)),
            "field_accuracy": _rate(sum(g.fields_right for g in graded),
                                    sum(g.fields_total for g in graded)),
            "stop_rate": _rate(sum(g.finish_reason == "stop" for g in graded), len(graded))}


def quality_rows(llm, examples: Sequence[Example], constrained: bool, *,
                 details: list[Graded] | None = None) -> list[dict]:
    """Answer every example greedily, with (constrained=True) or without its task's schema as a
    constraint, and grade the replies: one row per task in `examples`, with n, parse_rate,
    schema_valid_rate, field_accuracy and stop_rate (values in [0, 1]).

    examples: tinylab's `eval_examples("json", n)` (plain prompts, schema tinylab_json_schema) or
    `extraction_prompts(n)` (chat prompts, schema person_schema), or both mixed.
    details: a list to append every Graded reply to, when you want to look at them.
    Constrained replies that ended with "stop" must parse (the oracle): AssertionError if not."""
    rows = []
    for task in dict.fromkeys(e.task for e in examples):  # tasks in order of first appearance
        if task not in SCHEMAS:
            raise ValueError(f"examples[].task={task!r} has no schema; allowed: {sorted(SCHEMAS)}")
        group = [e for e in examples if e.task == task]
        schema = SCHEMAS[task]()
        outs = answer(llm, group, params_for(task, constrained, schema))
        graded = [grade(e, o.text, o.finish_reason, schema, o.token_ids)
                  for e, o in zip(group, outs, strict=True)]
        if constrained:
            check_oracle(graded, f"quality_rows({task!r}, constrained)")
        if details is not None:
            details.extend(graded)
        rows.append(summary_row(task, constrained, graded))
    return rows


def refused_at(llm, task: str, replies: Sequence[Sequence[int]]) -> list[int | None]:
    """For each unconstrained reply (its token ids, EOS included), the index of the first token the
    task's schema would have masked, or None where every token is allowed.

    This is where a constrained reply must part from the model's own choice: from there on the
    model continues text it would not have written (a fence "```json" refused at index 0, a second
    object after the first one closed, a city where the schema wants an integer), and what it
    writes next may be better or worse than its own answer. (tinylab writes " {", a space before
    the brace, as it was trained; the JSON grammar allows that one space, so its replies are never
    refused at index 0: a grammar that did not would push it into a '{"' it never saw.)"""
    from engine.structured.grammar import GrammarCache

    grammar = GrammarCache(llm.tokenizer, llm.engine.model.config.vocab_size).get(
        StructuredOutputsParams(json=SCHEMAS[task]()))
    out = []
    for ids in replies:
        matcher = grammar.matcher(llm.engine.eos)
        out.append(next((i for i, t in enumerate(ids) if not matcher.accept(t)), None))
    return out

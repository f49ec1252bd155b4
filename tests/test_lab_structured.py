"""Chapter 13's experiments (engine/lab/structured.py): the prompts carry their truth, the grading reads replies the way
a client would, quality_rows routes and counts honestly, constrained greedy replies that stop always parse (the
oracle), and refused_at finds where an unconstrained reply leaves the grammar."""

import json
from types import SimpleNamespace

import jsonschema
import pytest

from engine import LLM
from engine.lab.structured import (
    EXTRACT_TASK,
    PERSON_FIELDS,
    Graded,
    check_oracle,
    extraction_prompts,
    first_object,
    grade,
    params_for,
    parse_object,
    person_schema,
    quality_rows,
    refused_at,
    schema_valid,
    tinylab_json_schema,
)
from engine.lab.tasks import eval_examples


@pytest.fixture(scope="module")
def tinylab():
    return LLM("tinylab")


# ---- the prompts and the schemas -----------------------------------------------------------------------------


def test_extraction_prompts_repeat_for_a_seed_and_differ_across_seeds():
    a, b, c = extraction_prompts(6, seed=1), extraction_prompts(6, seed=1), extraction_prompts(6, seed=2)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    assert len(a) == 6 and all(e.task == EXTRACT_TASK for e in a)


def test_every_extraction_prompt_states_its_true_fields_and_asks_for_them():
    for ex in extraction_prompts(20, seed=5):
        fields = ex.meta["fields"]
        assert tuple(fields) == PERSON_FIELDS
        record = ex.prompt.split("Text: ", 1)[1]
        for value in fields.values():
            assert str(value) in record, (value, record)
        assert ex.meta["messages"] == [{"role": "user", "content": ex.prompt}]
        assert json.loads(ex.target) == fields


def test_extraction_prompts_refuse_a_count_below_one():
    with pytest.raises(ValueError, match="n=0"):
        extraction_prompts(0)


def test_the_true_answers_fit_their_schemas_by_jsonschema():
    for ex in extraction_prompts(10):
        jsonschema.validate(ex.meta["fields"], person_schema())
    for ex in eval_examples("json", 30):
        jsonschema.validate(ex.meta["fields"], tinylab_json_schema())
        assert list(ex.meta["fields"]) == [k for k in tinylab_json_schema()["properties"] if k in ex.meta["fields"]]


@pytest.mark.parametrize("obj", [
    {"name": "Ana", "age": 3},  # city missing
    {"name": "Ana", "age": "3", "city": "Lima"},  # age as text
    {"name": "Ana", "age": 3, "city": "Lima", "job": "cook"},  # a key the schema does not have
])
def test_person_schema_rejects_what_a_client_could_not_use(obj):
    assert not schema_valid(obj, person_schema())


def test_tinylab_schema_rejects_an_unknown_key_and_a_text_age():
    assert not schema_valid({"name": "Ana", "pet": "cat"}, tinylab_json_schema())
    assert not schema_valid({"age": "31"}, tinylab_json_schema())
    assert schema_valid({}, tinylab_json_schema())  # every field is optional: a prompt names 2-4 of them


# ---- grading one reply -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ('  {"a": 1}\n', {"a": 1}),
    ('```json\n{"a": 1}\n```', None),  # a fence: json.loads fails, as a client's would
    ('{"a": 1} and more', None),
    ("[1, 2]", None),  # JSON, but not an object
    ('{"a": 1', None),  # cut short
])
def test_parse_object_reads_the_whole_reply_as_one_object(text, expected):
    assert parse_object(text) == expected


def test_first_object_finds_the_object_behind_a_fence_and_skips_broken_braces():
    assert first_object('Sure! {oops} ```json\n{"a": {"b": 2}}\n```') == {"a": {"b": 2}}
    assert first_object("no braces here") is None
    assert first_object("[{") is None


def test_grade_counts_right_fields_from_the_first_object_and_parses_strictly():
    ex = extraction_prompts(1)[0]
    truth = ex.meta["fields"]
    wrong_city = {**truth, "city": truth["city"] + "x"}
    fenced = grade(ex, "```json\n" + json.dumps(wrong_city) + "\n```", "stop", person_schema())
    assert (fenced.parsed, fenced.schema_valid, fenced.fields_right, fenced.fields_total) == (False, False, 2, 3)
    clean = grade(ex, json.dumps(truth), "stop", person_schema())
    assert (clean.parsed, clean.schema_valid, clean.fields_right) == (True, True, 3)
    text_age = grade(ex, json.dumps({**truth, "age": str(truth["age"])}), "stop", person_schema())
    assert text_age.parsed and not text_age.schema_valid and text_age.fields_right == 2


def test_the_oracle_fails_a_stopped_reply_that_does_not_parse_and_excuses_a_cut_one():
    cut = Graded('{"name": "A', "length", False, False, 0, 3)
    check_oracle([cut], "here")  # max_tokens may cut an object: counted, not an error
    with pytest.raises(AssertionError, match="ended with 'stop'"):
        check_oracle([cut, Graded('{"name": "A', "stop", False, False, 0, 3)], "here")


def test_params_for_constrains_only_when_asked_and_always_greedy():
    free, fixed = params_for(EXTRACT_TASK, False), params_for(EXTRACT_TASK, True)
    assert free.structured_outputs is None and free.temperature == 0 == fixed.temperature
    assert fixed.structured_outputs.json == person_schema()
    assert params_for("json", True).structured_outputs.json == tinylab_json_schema()


# ---- quality_rows against a scripted model: routing and counting -----------------------------------------------


class ScriptedLLM:
    """Answers every prompt with the reply the script names; records what it was asked and how."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def _outputs(self, prompts, params):
        self.calls.append((prompts, params))
        return [SimpleNamespace(outputs=[SimpleNamespace(text=self.reply(p), finish_reason="stop", token_ids=[7])])
                for p in prompts]

    def generate(self, prompts, params, use_tqdm=True):
        return self._outputs(prompts, params)

    def chat(self, conversations, params, use_tqdm=True):
        return self._outputs(conversations, params)


def test_quality_rows_routes_chat_prompts_to_chat_and_counts_per_task():
    chats, plain = extraction_prompts(3), eval_examples("json", 2)
    truth = {ex.prompt: ex.meta["fields"] for ex in chats + plain}

    def reply(prompt):
        key = prompt[0]["content"] if isinstance(prompt, list) else prompt
        return json.dumps(truth[key])

    llm = ScriptedLLM(reply)
    rows = quality_rows(llm, [plain[0], chats[0], chats[1], plain[1], chats[2]], constrained=True)
    assert [(r["task"], r["n"]) for r in rows] == [("json", 2), (EXTRACT_TASK, 3)]
    assert all(r[k] == 1.0 for r in rows for k in ("parse_rate", "schema_valid_rate", "field_accuracy"))
    asked = {type(p[0]).__name__: params for p, params in llm.calls}
    assert set(asked) == {"str", "list"}  # plain prompts generate, conversations chat
    assert asked["list"].structured_outputs.json == person_schema()


def test_quality_rows_raises_when_a_constrained_stop_does_not_parse():
    llm = ScriptedLLM(lambda p: "Sure, here it is")
    free = quality_rows(llm, extraction_prompts(2), constrained=False)
    assert free[0]["parse_rate"] == 0.0 and free[0]["field_accuracy"] == 0.0
    with pytest.raises(AssertionError, match="do not parse"):
        quality_rows(llm, extraction_prompts(2), constrained=True)


def test_quality_rows_refuses_a_task_without_a_schema():
    with pytest.raises(ValueError, match="arith"):
        quality_rows(ScriptedLLM(str), eval_examples("arith", 1), constrained=False)


# ---- the real engine on tinylab --------------------------------------------------------------------------------


def test_constrained_tinylab_replies_all_parse_and_fit_the_schema(tinylab):
    details = []
    [row] = quality_rows(tinylab, eval_examples("json", 6), constrained=True, details=details)
    assert row["n"] == 6 and row["stop_rate"] == 1.0
    assert row["parse_rate"] == 1.0 and row["schema_valid_rate"] == 1.0
    for g in details:
        jsonschema.validate(json.loads(g.completion), tinylab_json_schema())
        assert g.token_ids and g.token_ids[-1] in tinylab.engine.eos


def test_refused_at_finds_the_first_token_the_grammar_masks(tinylab):
    tok, eos = tinylab.tokenizer, tinylab.engine.eos[0]
    valid = tok.encode(' {"name": "Ana", "age": 31}', add_special_tokens=False)
    trailing = tok.encode(' {"age": 31} ok', add_special_tokens=False)
    closes = len(tok.encode(' {"age": 31}', add_special_tokens=False))
    fenced = tok.encode('```{"age": 31}', add_special_tokens=False)
    assert refused_at(tinylab, "json", [valid + [eos], trailing, fenced]) == [None, closes, 0]

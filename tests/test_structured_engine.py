"""Chapter 13 in the paged engine: a grammar-constrained request gives exactly the naive loop's output under the
same grammar (greedy), with continuous batching, preemption, prefix caching, n > 1 and speculative decoding, and
what it writes always parses. A constraint that cannot compile is refused with nothing registered."""

from __future__ import annotations

import json
import re

import pytest

from engine.companions.naive import generate_naive
from engine.llm import LLM
from engine.loading.loader import load_model
from engine.sampling import SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PROMPTS = ["Make JSON: the job is teacher, city Bern, 57 years old, Hana is the name.\nJSON:",
           "Make JSON: city Oslo, the name is Ada, 41 years old.\nJSON:",
           "Once upon a time"]
SPECS = {"json": StructuredOutputsParams(json=PERSON), "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]+ \d{2}"),
         "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
         "json_object": StructuredOutputsParams(json_object=True)}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None, "max_verify_rows": None}


@pytest.fixture(scope="module")
def tinylab():
    return load_model("tinylab")


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(SPECS["regex"].regex, text) is not None
    if kind == "choice":
        return text in SPECS["choice"].choice
    value = json.loads(text)
    if kind == "json_object":
        return isinstance(value, dict)
    return (set(value) == {"name", "age", "city"} and isinstance(value["name"], str)
            and isinstance(value["age"], int) and isinstance(value["city"], str))


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("options", [{}, {"num_blocks": 24, "block_size": 4, "max_num_seqs": 3},
                                     {"speculative_config": SPEC}, {"speed": "reference"}],
                         ids=["plain", "tiny-pool-preempts", "speculative", "reference"])
def test_constrained_greedy_equals_the_naive_loop_and_parses(tinylab, kind, options):
    model, tok = tinylab
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=SPECS[kind])
    llm = LLM(model, tok, **options)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        naive = generate_naive(model, tok, prompt, params)
        assert out.outputs[0].token_ids == naive.token_ids
        if out.outputs[0].finish_reason == "stop":
            assert valid(kind, out.outputs[0].text), out.outputs[0].text


def test_each_of_n_samples_follows_the_grammar_on_its_own(tinylab):
    params = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=48, structured_outputs=SPECS["json"])
    out = LLM(*tinylab).generate(PROMPTS[0], params, use_tqdm=False)[0]
    texts = [o.text for o in out.outputs if o.finish_reason == "stop"]
    assert len(texts) >= 2 and all(valid("json", t) for t in texts)


@pytest.mark.parametrize("spec, field", [(StructuredOutputsParams(regex="a(b"), "regex"),
                                         (StructuredOutputsParams(json={"type": "nonsense"}), "json")])
def test_a_constraint_that_cannot_compile_is_refused_and_leaves_no_trace(tinylab, spec, field):
    llm = LLM(*tinylab)
    with pytest.raises(ValueError, match=f"request '0'.*{field}"):
        llm.engine.add_request("hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.usage().used_blocks == 0


def test_a_failing_grammar_fails_its_request_only(tinylab, monkeypatch):
    """A grammar library that gives up mid-output (a pathological schema) ends that request with "error"; the
    other requests of the same steps get exactly their tokens."""
    from engine.structured import grammar

    real = grammar.GrammarMatcher.allowed
    calls = {"n": 0}

    def flaky(self, vocab_size=None):
        calls["n"] += 1
        if calls["n"] >= 3:  # from its third step on, as a real library error would repeat
            raise RuntimeError("parser too complex")
        return real(self, vocab_size)

    monkeypatch.setattr(grammar.GrammarMatcher, "allowed", flaky)
    model, tok = tinylab
    plain = SamplingParams(temperature=0, max_tokens=16)
    llm = LLM(model, tok)
    alone = llm.generate(PROMPTS[2], plain, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    bad = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16,
                                                         structured_outputs=SPECS["json"]))
    good = engine.add_request(PROMPTS[2], plain)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_request(bad).finish_reason == "error"
    assert "parser too complex" in engine.get_request(bad).error
    assert engine.get_request(good).output_token_ids == alone
    assert engine.block_manager.usage().used_blocks == 0

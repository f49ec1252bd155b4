"""Chapter 13: grammar-constrained decoding through llguidance (engine/structured/grammar.py).

The oracle for "the output obeys the spec" is never the library itself: JSON is checked with json.loads and the
schema's rules by hand, regexes with Python's re.fullmatch, arithmetic with Python's own parser (ast), choices by
membership. The logits are random, so the only thing keeping the text valid is the mask.
"""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
import sys

import pytest
import torch

from engine.loading.loader import resolve_model_path
from engine.sampling import SamplingParams, SamplingState, StructuredOutputsParams, sample
from engine.structured import GrammarCache, GrammarProcessor, compile_grammar
from engine.tokenizer import Tokenizer

MAX_STEPS = 300  # tokens a constrained random walk may take before we call it stuck
TRIALS = 12  # random walks per spec
CLOSING_BIAS = 4.0  # added to tokens that close a string, an object or an array: random walks end sooner

PERSON = {  # tinylab's json task, bounded so that every random walk finishes
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 120},
                   "city": {"type": "string", "maxLength": 5}, "job": {"enum": ["baker", "pilot", "cook"]}},
    "required": ["name", "age", "job"],
    "additionalProperties": False,
}
REGEXES = [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"(\+1 )?[0-9]{3}-[0-9]{4}", r"(ab|cd)*x",
           r"[A-Z][a-z]{0,5} [0-9]{1,3}"]
CHOICES = ["red", "green", "blue", "blue sky", 'say "hi"', "back\\slash", "two\nlines"]
ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor ("*" factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}|0/
"""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_path("tinylab"))


@pytest.fixture(scope="module")
def cache(tok) -> GrammarCache:
    return GrammarCache(tok, tok.vocab_size)


@pytest.fixture(scope="module")
def closing_bias(tok) -> torch.Tensor:
    pieces = [tok.decode([i]) for i in range(tok.vocab_size)]
    return torch.tensor([CLOSING_BIAS if any(c in p for c in '"}]') else 0.0 for p in pieces])


def walk(cache, tok, spec, seed, bias=None) -> tuple[list[int], GrammarProcessor]:
    """Greedy decoding of random logits through the processor, until EOS (or MAX_STEPS)."""
    processor = GrammarProcessor(cache.get(spec), tok.eos_token_ids)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(MAX_STEPS):
        logits = torch.randn(tok.vocab_size, generator=gen) + (0 if bias is None else bias)
        token = int(torch.argmax(processor(out, logits)))
        out.append(token)
        if token in tok.eos_token_ids:
            return out, processor
    raise AssertionError(f"no EOS after {MAX_STEPS} tokens: {tok.decode(out)!r}")


def text_of(tok, ids) -> str:
    assert ids[-1] in tok.eos_token_ids
    return tok.decode(ids[:-1], skip_special_tokens=False)


# ---- the output obeys the spec --------------------------------------------------------------------------------


def check_person(obj) -> None:
    assert isinstance(obj, dict) and set(obj) <= set(PERSON["properties"]), obj
    assert {"name", "age", "job"} <= set(obj), obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6, obj
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120, obj
    assert obj["job"] in ("baker", "pilot", "cook"), obj
    assert "city" not in obj or (isinstance(obj["city"], str) and len(obj["city"]) <= 5), obj


@pytest.mark.parametrize("as_text", [False, True], ids=["schema dict", "schema JSON text"])
def test_random_logits_through_a_json_schema_give_schema_valid_json(tok, cache, closing_bias, as_text):
    spec = StructuredOutputsParams(json=json.dumps(PERSON) if as_text else PERSON)
    for seed in range(TRIALS):
        ids, _ = walk(cache, tok, spec, seed, closing_bias)
        check_person(json.loads(text_of(tok, ids)))


def test_random_logits_through_json_object_give_a_json_object(tok, cache, closing_bias):
    spec = StructuredOutputsParams(json_object=True)
    for seed in range(TRIALS):
        ids, _ = walk(cache, tok, spec, seed, closing_bias)
        assert isinstance(json.loads(text_of(tok, ids)), dict)


@pytest.mark.parametrize("regex", REGEXES)
def test_random_logits_through_a_regex_give_a_full_match(tok, cache, regex):
    texts = {text_of(tok, walk(cache, tok, StructuredOutputsParams(regex=regex), seed)[0]) for seed in range(TRIALS)}
    for text in texts:
        assert re.fullmatch(regex, text), (regex, text)
    assert len(texts) > 1, "random logits should reach more than one text"


def test_random_logits_through_a_choice_give_one_of_the_choices(tok, cache):
    spec = StructuredOutputsParams(choice=CHOICES)
    seen = {text_of(tok, walk(cache, tok, spec, seed)[0]) for seed in range(3 * TRIALS)}
    assert seen <= set(CHOICES), seen - set(CHOICES)
    assert len(seen) > 2, seen


def test_random_logits_through_a_lark_grammar_give_an_arithmetic_expression(tok, cache):
    for seed in range(TRIALS):
        text = text_of(tok, walk(cache, tok, StructuredOutputsParams(grammar=ARITH), seed)[0])
        tree = ast.parse(text, mode="eval")  # our grammar is a subset of Python's expressions
        kinds = {type(node) for node in ast.walk(tree)}
        assert kinds <= {ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult}, (text, kinds)


def test_a_gbnf_grammar_is_accepted_too(tok, cache):
    spec = StructuredOutputsParams(grammar='root ::= "yes" | "no" | "maybe " [0-9]')
    for seed in range(TRIALS):
        assert re.fullmatch(r"yes|no|maybe [0-9]", text_of(tok, walk(cache, tok, spec, seed)[0]))


def test_sampling_at_temperature_one_through_the_sampler_gives_valid_outputs_for_every_row(tok, cache, closing_bias):
    spec = StructuredOutputsParams(json=PERSON)
    rows = [SamplingState(SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_STEPS, structured_outputs=spec),
                          grammar=GrammarProcessor(cache.get(spec), tok.eos_token_ids)) for seed in range(3)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(MAX_STEPS):
        live = [state for state in rows if not state.output_ids or state.output_ids[-1] not in tok.eos_token_ids]
        if not live:
            break
        logits = torch.randn(len(live), tok.vocab_size, generator=gen) + closing_bias
        for state, token in zip(live, sample(logits, live, tok.eos_token_ids).token_ids.tolist(), strict=True):
            state.output_ids.append(token)
    for state in rows:
        check_person(json.loads(text_of(tok, state.output_ids)))


def test_importing_the_grammar_module_does_not_import_transformers():
    code = "import sys, engine.structured; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "engine.structured imported transformers"


# ---- EOS ------------------------------------------------------------------------------------------------------


def test_eos_is_banned_until_the_grammar_can_end_and_alone_once_it_is_complete(tok, cache):
    (eos,) = tok.eos_token_ids
    matcher = cache.get(StructuredOutputsParams(json=PERSON)).matcher()
    ids = tok.encode(json.dumps({"name": "Ana", "age": 31, "job": "cook"}), add_special_tokens=False)
    for i, token in enumerate(ids):
        allowed = matcher.allowed()
        assert not allowed[eos], f"EOS allowed after {tok.decode(ids[:i])!r}"
        assert allowed[token], f"the valid token {tok.decode([token])!r} is masked after {tok.decode(ids[:i])!r}"
        assert matcher.accept(token)
    allowed = matcher.allowed()
    assert allowed[eos] and allowed.sum() == 1, "a closed object can only be followed by EOS"
    assert not matcher.is_terminated() and matcher.accept(eos) and matcher.is_terminated()


def test_eos_is_allowed_beside_more_text_where_the_grammar_may_end_or_go_on(tok, cache):
    (eos,) = tok.eos_token_ids
    matcher = cache.get(StructuredOutputsParams(regex=r"[0-9]+")).matcher()
    assert not matcher.allowed()[eos] and not matcher.accept(eos)
    assert matcher.accept(tok.encode("7", add_special_tokens=False)[0])
    allowed = matcher.allowed()
    assert allowed[eos] and allowed.sum() > 1  # "7" may end, or go on as "71", "7123", ...


def test_every_eos_id_of_the_model_is_treated_as_eos(tok, cache):
    pad = tok.pad_token_id  # stands in for a second EOS id (chat models often have two)
    eos_ids = [*tok.eos_token_ids, pad]
    processor = GrammarProcessor(cache.get(StructuredOutputsParams(choice=["red"])), eos_ids)
    red = tok.encode("red", add_special_tokens=False)
    assert torch.isinf(processor([], torch.zeros(tok.vocab_size))[eos_ids]).all()
    done = processor(red, torch.zeros(tok.vocab_size))
    assert torch.isfinite(done).nonzero().ravel().tolist() == sorted(eos_ids)
    processor(red + [pad], torch.zeros(tok.vocab_size))  # accepted as EOS, no error
    assert processor.matcher.is_terminated()


def test_the_models_eos_ids_replace_the_tokenizers(tok, cache):
    (tokenizer_eos,) = tok.eos_token_ids
    model_eos = tok.pad_token_id  # a model whose config names another EOS id than its tokenizer
    processor = GrammarProcessor(cache.get(StructuredOutputsParams(choice=["red"])), [model_eos])
    red = tok.encode("red", add_special_tokens=False)
    assert torch.isfinite(processor(red, torch.zeros(tok.vocab_size))).nonzero().ravel().tolist() == [model_eos]
    with pytest.raises(RuntimeError, match=f"token {tokenizer_eos} "):
        processor(red + [tokenizer_eos], torch.zeros(tok.vocab_size))


# ---- histories that jump: speculative verification, rejected guesses -------------------------------------------


def fresh_mask(compiled, tok, ids) -> torch.Tensor:
    matcher = compiled.matcher(tok.eos_token_ids)
    for token in ids:
        assert matcher.accept(token)
    return matcher.allowed()


def test_jumping_histories_give_the_masks_of_a_fresh_matcher_fed_the_same_tokens(tok, cache, closing_bias):
    spec = StructuredOutputsParams(json=PERSON)
    compiled = cache.get(spec)
    paths = [walk(cache, tok, spec, seed, closing_bias)[0] for seed in (100, 101)]  # two different outputs, EOS last
    assert paths[0] != paths[1]
    processor = GrammarProcessor(compiled, tok.eos_token_ids)
    rng = random.Random(0)
    for _ in range(60):  # forward by several tokens, back, onto the other branch, the same history twice
        path = rng.choice(paths)
        history = path[:rng.randint(0, len(path))]
        got = torch.isfinite(processor(history, torch.zeros(tok.vocab_size)))
        assert torch.equal(got, fresh_mask(compiled, tok, history)), f"history {tok.decode(history)!r}"


def test_rollback_then_accept_reaches_the_same_state_as_never_leaving(tok, cache):
    compiled = cache.get(StructuredOutputsParams(regex=REGEXES[0]))
    ids = tok.encode("ann@mail.org", add_special_tokens=False)
    matcher = compiled.matcher()
    for token in ids:
        assert matcher.accept(token)
    matcher.rollback(len(ids) - 2)
    assert matcher.num_tokens == 2
    assert torch.equal(matcher.allowed(), fresh_mask(compiled, tok, ids[:2]))
    for token in ids[2:]:
        assert matcher.accept(token)
    assert torch.equal(matcher.allowed(), fresh_mask(compiled, tok, ids))
    (eos,) = tok.eos_token_ids
    assert matcher.accept(eos) and matcher.is_terminated()
    matcher.rollback(2)  # the EOS and the last text token
    assert not matcher.is_terminated() and torch.equal(matcher.allowed(), fresh_mask(compiled, tok, ids[:-1]))
    with pytest.raises(ValueError, match="rollback"):
        matcher.rollback(len(ids))


def test_a_refused_token_changes_nothing(tok, cache):
    compiled = cache.get(StructuredOutputsParams(regex=r"[0-9]{3}"))
    matcher = compiled.matcher()
    assert matcher.accept(tok.encode("4", add_special_tokens=False)[0])
    before = matcher.allowed()
    assert not matcher.accept(tok.encode("x", add_special_tokens=False)[0])
    assert matcher.num_tokens == 1 and torch.equal(matcher.allowed(), before)


def test_an_output_token_the_grammar_refuses_raises_and_the_processor_recovers(tok, cache):
    compiled = cache.get(StructuredOutputsParams(regex=r"[0-9]{3}"))
    processor = GrammarProcessor(compiled, tok.eos_token_ids)
    digits, letter = tok.encode("12", add_special_tokens=False), tok.encode("x", add_special_tokens=False)
    with pytest.raises(RuntimeError, match=f"token {letter[0]} .* position {len(digits)}"):
        processor(digits + letter, torch.zeros(tok.vocab_size))
    out = processor(digits, torch.zeros(tok.vocab_size))
    assert torch.equal(torch.isfinite(out), fresh_mask(compiled, tok, digits))


# ---- vocabularies, errors, the cache --------------------------------------------------------------------------


def test_padded_model_vocabulary_ids_are_always_masked(tok):
    padded = tok.vocab_size + 16  # an embedding matrix padded past the tokenizer
    compiled = compile_grammar(StructuredOutputsParams(json_object=True), tok, padded)
    processor = GrammarProcessor(compiled, tok.eos_token_ids)
    out = processor([], torch.zeros(padded))
    assert out.shape == (padded,) and torch.isinf(out[tok.vocab_size:]).all() and torch.isfinite(out).any()
    assert compiled.matcher().allowed().shape == (padded,)


@pytest.mark.parametrize(("spec", "names"), [
    (StructuredOutputsParams(json='{"type": "object",'), ["structured_outputs.json", "not valid JSON"]),
    (StructuredOutputsParams(json={"type": "objekt"}), ["structured_outputs.json", "objekt"]),
    (StructuredOutputsParams(json='["a list"]'), ["structured_outputs.json", "JSON Schema object"]),
    (StructuredOutputsParams(regex="a(b"), ["structured_outputs.regex", "unclosed group"]),
    (StructuredOutputsParams(grammar="start: digit+"), ["structured_outputs.grammar", "digit"]),
    (StructuredOutputsParams(grammar="root ::= x"), ["structured_outputs.grammar", "x"]),
], ids=["json syntax", "json type", "json not an object", "regex", "lark rule", "gbnf rule"])
def test_a_spec_that_does_not_compile_raises_value_error_naming_it_and_nothing_is_cached(tok, spec, names):
    cache = GrammarCache(tok, tok.vocab_size)
    with pytest.raises(ValueError) as info:
        cache.get(spec)
    for name in names:
        assert name in str(info.value), str(info.value)
    assert len(cache) == 0


def test_the_cache_compiles_each_spec_once_and_drops_the_least_recently_used(tok):
    cache = GrammarCache(tok, tok.vocab_size, max_entries=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = cache.get(a)
    assert cache.get(StructuredOutputsParams(regex="a+")) is first and (cache.hits, cache.misses) == (1, 1)
    cache.get(b)
    cache.get(a)  # a is now the most recently used
    cache.get(c)  # evicts b
    assert len(cache) == 2 and cache.get(a) is first
    misses = cache.misses
    cache.get(b)
    assert cache.misses == misses + 1, "b should have been evicted and compiled again"


def test_schemas_equal_as_dicts_share_one_entry(tok):
    cache = GrammarCache(tok, tok.vocab_size)
    one = cache.get(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    assert cache.get(StructuredOutputsParams(json={"required": ["a"], "type": "object"})) is one

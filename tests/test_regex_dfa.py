"""The teaching regex -> DFA -> token mask reference (engine/structured/regex_dfa.py), checked
against Python's `re` (the oracle for which strings match) and tinylab's real vocabulary."""

from __future__ import annotations

import functools
import itertools
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.structured.regex_dfa import (
    DEAD,
    RegexProcessor,
    TokenTable,
    byte_level_alphabet,
    compile_regex,
    format_dfa,
    vocab_bytes,
    walk_vocab,
)

# Patterns over the whole teaching subset: classes, negations, counts, groups, non-ASCII, empties.
PATTERNS = [
    r"\d+", r"-?\d+(\.\d+)?", r"[a-z]+( [a-z]+)*", r"(yes|no|maybe)", r"\d{3}-\d{4}",
    r'\{"name": "[a-z]{1,8}", "age": \d{1,2}\}', r"[^a-z]{1,4}", r"é+|中文?", r".{2,3}",
    r"\w+@\w+\.(com|org)", r"(ab|a)*b?", r"a{,2}b{2,}", r"[]a-]+\s*\S", r"(?:x|)y{0}z?",
    r"[\d\s]*\D", r"\x41\.\*\\", "", r"a|", r"(a|b)*abb", r"a{", r"[^\n]\n",
]
# Characters the random strings are made of, besides each pattern's own
EXTRA_CHARS = "az09 .-_\n{é中😀"
RANDOM_TEXT_MAX = 8
EXAMPLES_PER_PATTERN = 100
EXHAUSTIVE_LENGTH = 4  # every string up to this many characters over a small alphabet


@functools.cache
def dfa_of(pattern: str):
    return compile_regex(pattern)


@functools.cache
def tinylab_tokenizer():
    from engine.loading.loader import load_model

    return load_model("tinylab")[1]


@functools.cache
def tinylab_vocab():
    return vocab_bytes(tinylab_tokenizer())


@functools.cache
def tinylab_table(pattern: str) -> TokenTable:
    return TokenTable.from_tokenizer(pattern, tinylab_tokenizer())


def fullmatch(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


def _texts(pattern: str):
    """Strings that match (hypothesis reads the regex itself), random ones, and near misses."""
    matches = st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True)
    noise = st.text(st.sampled_from(sorted(set(pattern + EXTRA_CHARS))), max_size=RANDOM_TEXT_MAX)
    near = st.tuples(matches, st.integers(0, RANDOM_TEXT_MAX), noise.filter(lambda s: len(s) < 2))
    edited = near.map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + 1:])
    return st.one_of(matches, noise, edited)


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=EXAMPLES_PER_PATTERN, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_dfa_accepts_exactly_what_re_fullmatch_accepts(pattern, data):
    text = data.draw(_texts(pattern))
    assume(text.encode("utf-8", errors="ignore").decode() == text)  # no lone surrogates
    assert dfa_of(pattern).accepts(text) == fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("pattern, alphabet", [
    (r"(ab|a)*b?", "ab"), (r"a{,2}b{2,}", "ab"), (r"(a|b)*abb", "abc"), (r"[^a]b|é", "abé"),
    (r"-?\d+(\.\d+)?", "1.-"), (r"(x|y)?(xy)+", "xy"),
])
def test_dfa_agrees_with_re_on_every_short_string(pattern, alphabet):
    dfa = dfa_of(pattern)
    for n in range(EXHAUSTIVE_LENGTH + 1):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert dfa.accepts(text) == fullmatch(pattern, text), (pattern, text)


def _is_one_char(data: bytes) -> bool:
    try:
        return len(data.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def test_dot_reads_exactly_one_valid_utf8_character_but_not_a_newline():
    dot = dfa_of(".")
    short = [bytes([a]) for a in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    rng = random.Random(0)
    lead = [0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xC0, 0xC2]  # the edges of the UTF-8 table
    longer = [bytes([rng.choice(lead), *(rng.randrange(0x70, 0xC8) for _ in range(n))])
              for n in (2, 3) for _ in range(3000)]
    for data in short + longer:
        assert dot.accepts(data) == (_is_one_char(data) and data != b"\n"), data


def test_a_pattern_with_no_match_has_a_start_and_nothing_else():
    dfa = dfa_of(r"[^\s\S]")
    assert dfa.num_states == 1 and not dfa.accepting[0]
    assert all(t == DEAD for t in dfa.transitions[0])


# Patterns with dead ends inside: "[^\s\S]" matches nothing, so a branch through it never ends.
DEAD_END_PATTERNS = [r"a(b[^\s\S])?", r"(x[^\s\S]|y)+z"]


def test_every_state_left_after_compiling_can_still_reach_a_match():
    for pattern in PATTERNS + DEAD_END_PATTERNS:
        dfa = dfa_of(pattern)
        reach = {s for s in range(dfa.num_states) if dfa.accepting[s]}
        for _ in range(dfa.num_states):
            reach |= {s for s, row in enumerate(dfa.transitions) if any(t in reach for t in row)}
        assert reach == set(range(dfa.num_states)), pattern


def test_minimizing_merges_the_two_ends_of_ab_or_ac():
    # after "ab" and after "ac" nothing more may come: one state, so 3 in all (start, "a", end)
    assert dfa_of("ab|ac").num_states == 3
    assert "1 --[b-c]--> 2" in format_dfa(dfa_of("ab|ac"))


UNSUPPORTED = [  # valid Python regexes outside the teaching subset -> what the error must name
    ("^a", "anchor"), ("a$", "anchor"), (r"\bword", r"\\b"), (r"(a)\1", r"\\1"),
    (r"a\Z", r"\\Z"), ("(?=a)a", r"\(\?="), ("(?P<x>a)", r"\(\?P"), ("(?i)a", r"\(\?i"),
    ("a*?", "lazy"), ("a{1,2}?", "lazy"), ("a*+", "possessive"), ("[^é]", "non-ASCII"),
    ("[à-ÿ]", "non-ASCII range"), ("a{1001}", "1000"), (r"\u00e9", r"\\u"), ("[\\b]", r"\\b"),
]
MALFORMED = [  # invalid for Python too -> what the error must say
    ("(a", "never closed"), ("a)", "unbalanced"), ("[ab", "never closed"), ("*a", "nothing to"),
    ("{2}", "nothing to"), ("a**", "repeat of a repeat"), ("a{3,2}", "min > max"),
    ("[z-a]", "backwards"), ("a\\", "ends too early"), (r"\xZZ", "hex"), (r"[\d-z]", "range"),
    (r"\p{L}", r"\\p"),
]


@pytest.mark.parametrize("pattern, named", UNSUPPORTED)
def test_unsupported_syntax_raises_naming_it(pattern, named):
    re.compile(pattern)  # Python takes it: the subset is what refuses
    with pytest.raises(ValueError, match=named):
        compile_regex(pattern)


@pytest.mark.parametrize("pattern, named", MALFORMED)
def test_malformed_patterns_raise_with_the_position(pattern, named):
    with pytest.raises(re.error):
        re.compile(pattern)
    with pytest.raises(ValueError, match=rf"at position \d+: .*{named}"):
        compile_regex(pattern)


def test_a_blowup_is_refused_with_a_message():
    with pytest.raises(ValueError, match="DFA states"):
        compile_regex(r"(a|b)*a(a|b){12}")
    with pytest.raises(ValueError, match="NFA states"):
        compile_regex(r"((a{1000}){1000})")


# ---- tokens ---------------------------------------------------------------------------------

# A made-up vocabulary (token id = position) to show tokens that cross state boundaries.
TOY_VOCAB = [b"1", b"12", b"2.5", b"1a", b".", b"a", None, b"", b"3."]
TOY_EOS = 6


def _allowed_texts(table: TokenTable, state: int) -> set:
    return {TOY_VOCAB[i] for i in table.allowed_tokens(state) if i != TOY_EOS}


def test_a_token_may_cross_state_boundaries_but_not_die_on_its_way():
    table = TokenTable.build(compile_regex(r"\d+(\.\d+)?"), TOY_VOCAB, [TOY_EOS])
    # "12" passes through an accepting state; "2.5" crosses three states; "1a" dies on its 2nd byte
    assert _allowed_texts(table, table.start) == {b"1", b"12", b"2.5", b"3."}
    after_3dot = table.advance(table.start, TOY_VOCAB.index(b"3."))
    assert _allowed_texts(table, after_3dot) == {b"1", b"12"}
    assert TOY_EOS not in table.allowed_tokens(after_3dot)  # "3." does not match yet


def test_a_token_that_would_run_past_the_end_is_not_allowed():
    table = TokenTable.build(compile_regex(r"\d"), TOY_VOCAB, [TOY_EOS])
    assert _allowed_texts(table, table.start) == {b"1"}  # "12" matches "1" then dies
    assert table.allowed_tokens(table.advance(table.start, 0)) == {TOY_EOS}


def test_a_token_into_a_dead_end_is_not_allowed():
    table = TokenTable.build(compile_regex(r"1(2[^\s\S])?"), TOY_VOCAB, [TOY_EOS])
    assert _allowed_texts(table, table.start) == {b"1"}  # "12" could never be finished


def test_an_eos_that_has_bytes_is_still_only_an_end():
    eos = TOY_VOCAB.index(b"1")  # some models' EOS is an ordinary-looking token
    table = TokenTable.build(compile_regex(r"\d+"), TOY_VOCAB, [eos])
    assert eos not in table.allowed_tokens(table.start)  # the start does not match yet
    after_12 = table.advance(table.start, TOY_VOCAB.index(b"12"))
    assert eos in table.allowed_tokens(after_12)
    assert table.advance(after_12, eos) == after_12  # an end, not the digit 1


def test_eos_is_allowed_exactly_in_accepting_states():
    for pattern in (r"-?\d+(\.\d+)?", r"[a-z]+( [a-z]+)*", r"é+|中文?", r"(yes|no|maybe)"):
        table, eos = tinylab_table(pattern), tinylab_tokenizer().eos_token_ids
        rng = random.Random(pattern)
        alphabet = sorted(set(pattern + EXTRA_CHARS))
        for _ in range(300):
            text = "".join(rng.choices(alphabet, k=rng.randrange(RANDOM_TEXT_MAX)))
            state = table.dfa.walk(table.start, text.encode())
            if state != DEAD:
                assert bool(table.mask(state)[eos].all()) == fullmatch(pattern, text), text
                assert bool(table.mask(state)[eos].any()) == fullmatch(pattern, text), text


# For two patterns, the language of their prefixes written by hand: a token is allowed after a
# text exactly when text + token is still a prefix of some match.
PREFIXES = {r"-?\d+(\.\d+)?": r"-?(\d*|\d+\.\d*)", r"[a-z]+ [a-z]+": r"[a-z]*|[a-z]+ [a-z]*"}


@pytest.mark.parametrize("pattern, before", [
    (r"-?\d+(\.\d+)?", ""), (r"-?\d+(\.\d+)?", "-1"), (r"-?\d+(\.\d+)?", "12."),
    (r"[a-z]+ [a-z]+", ""), (r"[a-z]+ [a-z]+", "hello"), (r"[a-z]+ [a-z]+", "hello w"),
])
def test_the_mask_allows_every_tinylab_token_that_keeps_a_match_possible(pattern, before):
    table, vocab = tinylab_table(pattern), tinylab_vocab()
    state = table.dfa.walk(table.start, before.encode())
    allowed = table.mask(state)
    for token_id, piece in enumerate(vocab):
        if token_id in table.eos_token_ids:
            continue
        ok = bool(piece) and piece.isascii() and re.fullmatch(PREFIXES[pattern],
                                                              before + piece.decode()) is not None
        assert bool(allowed[token_id]) == ok, (before, piece)
    if before == "hello":  # tinylab's " wor" reads a space, then letters: it spans a boundary
        assert allowed[tinylab_tokenizer().encode(" wor", add_special_tokens=False)[0]]


def test_walking_all_tokens_at_once_equals_walking_each_token_alone():
    vocab = tinylab_vocab()
    for pattern in (r'\{"name": "[a-z]{1,8}", "age": \d{1,2}\}', r"é+|中文?", r".{2,3}"):
        dfa = dfa_of(pattern)
        grid = walk_vocab(dfa, vocab)  # [S, V]
        assert grid.shape == (dfa.num_states, len(vocab))
        for s in range(dfa.num_states):
            for t, piece in enumerate(vocab):
                expected = dfa.walk(s, piece) if piece else DEAD
                assert int(grid[s, t]) == expected, (pattern, s, piece)


def test_vocab_bytes_read_tinylab_tokens_back_to_the_text_they_encode():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}
    tokenizer, vocab = tinylab_tokenizer(), tinylab_vocab()
    for text in ('hello wörld {"a": 12}', "中文 é ü 😀", "Make JSON: called Mia.\n"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(vocab[i] for i in ids) == text.encode()
    assert all(vocab[i] is None for i in tokenizer.eos_token_ids)  # special tokens are not text


# ---- decoding through the processor ------------------------------------------------------------

GREEDY_PATTERNS = [
    r"\d{3}-\d{4}", r"[a-z]+( [a-z]+)*", r'\{"name": "[a-z]{1,8}", "age": \d{1,2}\}',
    r"(yes|no|maybe)", r"-?\d+(\.\d+)?", r"[^a-z]{1,4}", r"é+|中文?", r".{2,3}",
]
SEEDS = range(6)
MAX_STEPS = 80
# Random logits are N(0, 1); EOS gains this much per step, so a walk that can end soon does.
EOS_RAMP = 0.25


@pytest.mark.parametrize("pattern", GREEDY_PATTERNS)
def test_greedy_decoding_of_random_logits_always_matches(pattern):
    tokenizer, vocab = tinylab_tokenizer(), tinylab_vocab()
    eos = tokenizer.eos_token_ids[0]
    for seed in SEEDS:
        generator, processor, out = torch.Generator().manual_seed(seed), None, []
        processor = RegexProcessor(tinylab_table(pattern))
        for step in range(MAX_STEPS):
            logits = torch.randn(len(vocab), generator=generator)  # [V]
            logits[eos] += EOS_RAMP * step
            token = int(torch.argmax(processor(out, logits)))
            if token == eos:
                break
            out.append(token)
        else:
            pytest.fail(f"{pattern!r} seed {seed}: no EOS after {MAX_STEPS} tokens")
        text = b"".join(vocab[i] for i in out).decode("utf-8")  # strict: whole characters only
        assert text == tokenizer.decode(out)
        assert fullmatch(pattern, text), (pattern, seed, text)


def test_the_processor_forbids_with_minus_inf_and_pads_a_larger_model_vocab():
    table = TokenTable.build(compile_regex(r"\d"), TOY_VOCAB, [TOY_EOS])
    processor = RegexProcessor(table)
    logits = torch.zeros(len(TOY_VOCAB) + 3)  # [V + 3]: the model's vocab is padded
    masked = processor([], logits)
    assert masked.shape == logits.shape and masked[0] == 0
    assert torch.isneginf(masked[1:]).all()
    with pytest.raises(ValueError, match="not allowed"):
        processor([TOY_VOCAB.index(b"a")], logits)


def test_the_processor_reads_a_rewound_output_from_the_start():
    table = TokenTable.build(compile_regex(r"\d+(\.\d+)?"), TOY_VOCAB, [TOY_EOS])
    processor = RegexProcessor(table)
    processor([TOY_VOCAB.index(b"3.")], torch.zeros(len(TOY_VOCAB)))
    fresh = processor([TOY_VOCAB.index(b"12")], torch.zeros(len(TOY_VOCAB)))  # a new sequence
    assert torch.isfinite(fresh[TOY_VOCAB.index(b"2.5")])  # "12" then "2.5" is "122.5": fine


def test_tinylab_through_the_engine_writes_json_the_regex_allows():
    from engine import LLM, SamplingParams

    pattern = r' \{"name": "[A-Z][a-z]+", "age": \d{1,3}\}'  # no city: the model must stop early
    llm = LLM("tinylab", speed="reference")
    prompt = "Make JSON: the job is doctor, aged 71, lives in Oslo, called Mia.\nJSON:"
    params = SamplingParams(temperature=0, max_tokens=40,
                            logits_processors=[RegexProcessor(tinylab_table(pattern))])
    output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop"
    assert fullmatch(pattern, output.text), output.text

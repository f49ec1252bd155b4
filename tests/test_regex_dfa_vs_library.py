"""Chapter 13's two masks agree: the readable regex -> DFA -> token table (engine/structured/regex_dfa.py) and the
engine's library (llguidance, engine/structured/grammar.py), at every step of random walks through each regex, on
tinylab's real vocabulary.

One difference is by design. Where the text is FORCED (only one byte can come next, e.g. after "y" in
(yes|no|maybe)), llguidance keeps the forced text in the tokens a tokenizer would use for it ("es", not "e" then
"s"): it allows a subset of what the language allows. So: the library's mask is always within ours, and equal to
ours wherever more than one byte may come next."""

from __future__ import annotations

import random

import pytest
import torch

from engine.loading.loader import load_model
from engine.sampling import StructuredOutputsParams
from engine.structured.grammar import compile_grammar
from engine.structured.regex_dfa import DEAD, TokenTable

# [0-9], not \d: the teaching DFA reads \d as ASCII digits (re.ASCII), llguidance as every Unicode digit (so
# it also allows the first byte of, e.g., an Arabic-Indic digit) -- a difference of definitions, not of masks
PATTERNS = [r"[0-9]+", r"[a-z]+ [a-z]+", r"(yes|no|maybe)", r"-?[0-9]{1,3}(\.[0-9]+)?", r"[A-Z][a-z]{2,6}: [0-9][0-9]",
            r"\{\"a\": [0-9]+\}"]
WALKS, STEPS = 4, 12


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tinylab")[1]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_teaching_dfa_allows_what_the_library_allows(tokenizer, pattern):
    vocab = tokenizer.vocab_size
    table = TokenTable.from_tokenizer(pattern, tokenizer)
    compiled = compile_grammar(StructuredOutputsParams(regex=pattern), tokenizer, vocab)
    rng = random.Random(pattern)
    for _ in range(WALKS):
        state, matcher = table.start, compiled.matcher(tokenizer.eos_token_ids)
        for _ in range(STEPS):
            ours = table.mask(state)[:vocab]
            theirs = matcher.allowed(vocab)
            assert not (theirs & ~ours).any(), (pattern, "the library allows a token the language does not")
            next_bytes = {b for b in range(256) if table.dfa.transitions[state][b] != DEAD}
            if len(next_bytes) > 1:  # not forced: the masks are the same
                assert torch.equal(ours, theirs), (pattern, sorted(set(ours.nonzero().flatten().tolist())
                                                                   ^ set(theirs.nonzero().flatten().tolist()))[:10])
            choices = [t for t in ours.nonzero().flatten().tolist() if t not in tokenizer.eos_token_ids]
            if not choices:
                break
            token = rng.choice(choices)
            state = table.advance(state, token)
            assert matcher.accept(token)

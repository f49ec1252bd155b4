"""Structured outputs (chapter 13): constrain what a request may generate to a JSON schema, a regex,
a choice list or a Lark grammar, by masking the logits of every step.

    grammar.py   the engine's path: StructuredOutputsParams (engine/sampling.py) compiled by the
                 llguidance library into a per-sequence matcher, applied by GrammarProcessor, a
                 logits processor; GrammarCache compiles each spec once per tokenizer
    regex_dfa.py for teaching: the same idea in readable Python for regexes, regex -> NFA -> DFA ->
                 a token table over the vocabulary's bytes -> a mask per DFA state
"""

from engine.structured.grammar import (
    CompiledGrammar,
    GrammarCache,
    GrammarMatcher,
    GrammarProcessor,
    GrammarVocab,
    compile_grammar,
)

__all__ = ["CompiledGrammar", "GrammarCache", "GrammarMatcher", "GrammarProcessor", "GrammarVocab",
           "compile_grammar"]

"""Grammar-constrained decoding: a JSON schema, a regex, a choice list or a Lark grammar as a mask
over the vocabulary, one step at a time (chapter 13).

The model may put probability on any of its V tokens. A grammar says which texts are allowed; at
each step we ask "which tokens keep the text so far a prefix of some allowed text?" and set every
other logit to -inf before sampling. Done at every step, the output can only ever be allowed text:

    spec ──compile_grammar──> CompiledGrammar ──.matcher()──> GrammarMatcher (one per sequence)
    (once per schema, cached                                     accept(token)   the state moves on
     in GrammarCache)                                            allowed(V)      BoolTensor [V]
                                                                 rollback(n)     undo n tokens

    step t:  logits [V] ──GrammarProcessor──> logits with every disallowed id at -inf ──> sampler

EOS is the grammar's business too: it is allowed exactly where the text so far is a complete
sentence of the grammar, and it is the only choice once nothing more can follow (a closed JSON
object, the last letter of a choice).

The hard part, computing the allowed set over 49,152 tokens in microseconds, is done by a library
made for it: llguidance (Microsoft's guidance project; vLLM's `guidance` backend). It walks a trie
of the vocabulary's byte strings against a lazily built lexer DFA and an Earley parser, so a token
that spans several grammar states (`", "` ends one JSON string and starts the next key) is checked
byte by byte. The small readable version of the same idea (a regex -> DFA -> per-token table) is
the chapter's reference; this file is the one the engine runs.

Why llguidance and not xgrammar (the other library vLLM and SGLang use): measured on this CPU with
one thread at SmolLM2's vocabulary (benchmarks/structured_library.py; numbers in
benchmarks/results/structured_library.md), both masks cost tens of microseconds per step (a few
hundred at worst; our whole processor call about 0.1 ms), against 14-25 ms for a SmolLM2 decode
step, so mask time did not decide. What did:
- it takes our tokenizer as it is: `LLTokenizer(tokenizers_json)`, one call; xgrammar wants a
  `transformers` tokenizer, or a hand-built vocabulary list plus a private helper, and without the
  transformers object it lets SmolLM2's control tokens (<|im_start|>, ...) appear inside JSON
  strings;
- it has no dependencies at all, and imports in a tenth of a second; `import xgrammar` imports
  transformers (a dev-only oracle here) and takes seconds;
- it compiles a schema in about a millisecond (no precomputed per-vocabulary tables); xgrammar
  takes tens of milliseconds per JSON schema or regex, and the server compiles on the request path.

A LogitsProcessor is called with the tokens generated so far, and not always one token more than
last time: speculative decoding verifies guesses with HYPOTHETICAL histories (output + the guesses
kept so far), then falls back when a guess is rejected. So the processor keeps what its matcher
has consumed, rolls back to the longest common prefix with the history it is given and accepts the
rest. llguidance rolls back cheaply (it keeps its parser states per token).
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from engine.sampling import StructuredOutputsParams
from engine.tokenizer import Tokenizer

BITS_PER_WORD = 32  # llguidance writes the mask as int32 words: bit i of word w is token 32 w + i
# A server sees a handful of distinct schemas (one per app or tool) again and again, and a stream of
# one-off ones; 64 compiled grammars keep the first kind and bound the memory the second can hold.
DEFAULT_CACHE_ENTRIES = 64
ERROR_CHARS = 600  # llguidance's messages can carry a parser dump; a 400 names the problem, no more
ANY_JSON_OBJECT = {"type": "object"}  # json_object: OpenAI's "any JSON object"
SILENT = 0  # llguidance log level: errors come back to us as values, nothing on stderr


class GrammarVocab:
    """The tokenizer as llguidance sees it: every token's bytes, in a trie, built once.

    vocab_size is the MODEL's (its logits' width). It may exceed the tokenizer's when the embedding
    matrix is padded; the extra ids have no text and are never allowed. Building this takes up to
    a second for SmolLM2's 49,152 tokens, which is why GrammarCache holds one for all its grammars.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size} must be >= 1: pass the model's vocab_size "
                             "(model.config.vocab_size)")
        self.vocab_size = vocab_size
        n_vocab = max(vocab_size, tokenizer.vocab_size)  # the library's own width
        tk = copy.copy(tokenizer.tk)  # as llguidance's own transformers bridge does: no padding,
        tk.no_padding()  # no truncation in the JSON it reads
        tk.no_truncation()
        # the tokenizers library's own JSON: llguidance reads byte-level BPE from it directly
        self.tokenizer = llguidance.LLTokenizer(tk.to_str(), n_vocab=n_vocab,
                                                eos_token=list(tokenizer.eos_token_ids) or None)
        self.eos_token_ids = list(self.tokenizer.eos_tokens)

    def describe(self, token: int) -> str:
        """A token as llguidance prints it, for error messages."""
        if 0 <= token < self.tokenizer.vocab_size:
            return self.tokenizer.dbg_tokens([token])
        return f"<id {token}: past the vocabulary>"


def _json_schema(spec: StructuredOutputsParams) -> dict:
    """The request's schema as a dict (it may come as its JSON text)."""
    if spec.kind == "json_object":
        return ANY_JSON_OBJECT
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON ({e}); send the schema "
                             "as a JSON object") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON Schema object, got "
                         f"{type(schema).__name__} {schema!r:.80}")
    return schema


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The spec as llguidance's grammar (its own JSON, wrapping a schema or a Lark grammar)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        # JSON allows whitespace before a value (RFC 8259: ws value ws), and models that learned
        # to answer " {" (tinylab does) would otherwise be pushed into a '{"' they never saw; one
        # optional space, not any amount, so a small model cannot fill max_tokens with blanks
        schema = json.dumps(_json_schema(spec))
        return llguidance.grammar_from("lark", f'start: " "? value\nvalue: %json {schema}')
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # one quoted Lark literal per choice (llguidance's own recipe)
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    # Lark, or llama.cpp's GBNF (`root ::= ...`), which llguidance translates to Lark
    try:
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:  # a GBNF grammar it could not translate
        raise ValueError(f"structured_outputs.grammar cannot be compiled: {e}") from None


def compile_grammar(spec: StructuredOutputsParams, tokenizer: Tokenizer, vocab_size: int, *,
                    vocab: GrammarVocab | None = None) -> CompiledGrammar:
    """Compile one spec against one tokenizer. Raises ValueError naming the problem (a bad schema,
    a bad regex, a grammar feature llguidance does not support); nothing is held then.

    vocab: the tokenizer already prepared (GrammarCache passes its own); None builds it here,
    which costs about a second on a 49k vocabulary, so call this through GrammarCache."""
    vocab = vocab or GrammarVocab(tokenizer, vocab_size)
    if vocab.vocab_size != vocab_size:
        raise ValueError(f"vocab was prepared for vocab_size={vocab.vocab_size}, not {vocab_size}; "
                         "prepare one GrammarVocab per model")
    text = _grammar_text(spec)
    template = llguidance.LLMatcher(vocab.tokenizer, text, log_level=SILENT)
    if template.is_error():
        problem = template.get_error().strip()[:ERROR_CHARS]
        raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {problem}")
    return CompiledGrammar(template, vocab, spec.key())


class CompiledGrammar:
    """A spec compiled for one vocabulary: a pristine matcher that every sequence copies."""

    def __init__(self, template: llguidance.LLMatcher, vocab: GrammarVocab, key: str):
        self._template = template  # never consumes a token: each matcher() is a deep copy of it
        self.vocab = vocab
        self.key = key

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def matcher(self, eos_token_ids: Sequence[int] | None = None) -> GrammarMatcher:
        """A fresh matcher for one sequence (a copy: about a microsecond).
        eos_token_ids: the model's EOS ids (default: the tokenizer's)."""
        eos = self.vocab.eos_token_ids if eos_token_ids is None else eos_token_ids
        return GrammarMatcher(self._template.deep_copy(), self.vocab, eos)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.key:.60})"


class GrammarMatcher:
    """Where one sequence stands in its grammar: the tokens accepted so far, what may come next.

    EOS is handled here, not by the library: it is accepted exactly where the text so far is
    complete (llguidance's `is_accepting`), ends the grammar (`is_terminated`), and after it only
    EOS again is allowed (a sequence that ignores EOS can only repeat it). The library only ever
    sees the text tokens, so rolling back n tokens rolls the library back by the text tokens among
    them.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab: GrammarVocab,
                 eos_token_ids: Sequence[int]):
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: a grammar needs the model's EOS ids to say "
                             "where the output may end (pass eos_ids(model, tokenizer))")
        self._lib = matcher
        self.vocab = vocab
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._eos = frozenset(self.eos_token_ids)
        self._lib_eos = frozenset(vocab.eos_token_ids)  # what the library would take as its EOS
        self._tokens: list[int] = []  # every accepted token, EOS included
        self._num_eos = 0  # EOS only ever sits at the end of _tokens
        words = (vocab.tokenizer.vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
        self._words = np.zeros(words, dtype=np.int32)  # the library's mask, reused every step

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def common_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` this matcher has already accepted, in order."""
        n = len(self._tokens)
        if len(ids) >= n and list(ids[:n]) == self._tokens:  # the usual case: one token more
            return n
        shorter = min(n, len(ids))
        return next((i for i in range(shorter) if self._tokens[i] != ids[i]), shorter)

    def is_terminated(self) -> bool:
        """Has an EOS been accepted (the grammar is over)?"""
        return self._num_eos > 0

    def can_end(self) -> bool:
        """Is the text so far a complete sentence of the grammar (may EOS come now)?"""
        return self.is_terminated() or self._lib.is_accepting()

    def accept(self, token_id: int) -> bool:
        """Move on by one token; False (and nothing changed) if the grammar does not allow it."""
        if token_id in self._eos:
            if not self.can_end():
                return False
            self._num_eos += 1
        elif (self.is_terminated() or token_id in self._lib_eos
              or self._lib.validate_tokens([token_id]) != 1):
            return False  # checked first: a refused token would leave the library in error
        elif not self._lib.consume_token(token_id):
            raise RuntimeError(f"llguidance validated token {token_id} and then refused it: "
                               f"{self._lib.get_error()[:ERROR_CHARS]}")
        self._tokens.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(f"rollback({num_tokens}): only {len(self._tokens)} tokens were "
                             "accepted; roll back between 0 and that many")
        eos_undone = min(num_tokens, self._num_eos)
        text_undone = num_tokens - eos_undone
        if text_undone and not self._lib.rollback(text_undone):
            raise RuntimeError(f"llguidance could not roll back {text_undone} tokens: "
                               f"{self._lib.get_error()[:ERROR_CHARS]}")
        self._num_eos -= eos_undone
        del self._tokens[len(self._tokens) - num_tokens:]

    def allowed(self, vocab_size: int | None = None) -> torch.Tensor:
        """BoolTensor [vocab_size] (default: the model's): True where the next token may be."""
        V = self.vocab.vocab_size if vocab_size is None else vocab_size
        mask = torch.zeros(V, dtype=torch.bool)
        if not self.is_terminated():
            self._lib.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            if self._lib.is_error():
                raise RuntimeError(f"the grammar failed to compute a mask: "
                                   f"{self._lib.get_error()[:ERROR_CHARS]}")
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")  # [words * 32]
            n = min(V, bits.shape[0])
            mask[:n] = torch.from_numpy(bits[:n].view(np.bool_))
            mask[[i for i in self._lib_eos if i < V]] = False  # EOS is our rule, below
        mask[[i for i in self.eos_token_ids if i < V]] = self.can_end()
        return mask


class GrammarProcessor:
    """The LogitsProcessor the sampler calls: (output_ids, logits [V]) -> logits [V], every id the
    grammar does not allow at -inf. Stateful and per sequence: make one per sequence (n > 1 means
    n processors), from the same CompiledGrammar.

    It follows whatever history it is given: the tokens its matcher consumed are compared with
    output_ids, the matcher rolls back to their longest common prefix and accepts the rest:

        consumed  a b c d e          output_ids  a b c X      -> rollback 2, accept X, then mask
    """

    def __init__(self, grammar: CompiledGrammar, eos_token_ids: Sequence[int]):
        self.matcher = grammar.matcher(eos_token_ids)

    def sync(self, output_ids: Sequence[int]) -> None:
        """Bring the matcher to exactly output_ids. A token the grammar refuses (impossible when
        every sampling path applies this mask) raises RuntimeError."""
        keep = self.matcher.common_prefix(output_ids)
        self.matcher.rollback(self.matcher.num_tokens - keep)
        for position in range(keep, len(output_ids)):
            token = output_ids[position]
            if not self.matcher.accept(token):
                raise RuntimeError(
                    f"output token {token} {self.matcher.vocab.describe(token)} at position "
                    f"{position} breaks the grammar: some sampling path did not apply the "
                    "grammar's mask (every path must call processed_logits)")

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.sync(output_ids)
        allowed = self.matcher.allowed(logits.shape[-1]).to(logits.device, non_blocking=True)
        return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype,
                                                          device=logits.device))


class GrammarCache:
    """Compile each spec once per tokenizer: `get(spec)` returns the CompiledGrammar, compiling it
    on a miss. Bounded: the least recently used entry goes when max_entries are held. A spec that
    does not compile raises ValueError and is not stored. Safe to share between the server's
    thread and the engine's loop."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 max_entries: int = DEFAULT_CACHE_ENTRIES):
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be >= 1")
        self.tokenizer = tokenizer
        self.vocab = GrammarVocab(tokenizer, vocab_size)
        self.max_entries = max_entries
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = spec.key()
        with self._lock:
            if key in self._entries:
                self.hits += 1
                self._entries.move_to_end(key)
                return self._entries[key]
            self.misses += 1
        compiled = compile_grammar(spec, self.tokenizer, self.vocab.vocab_size, vocab=self.vocab)
        with self._lock:  # compiled outside the lock: a slow schema does not stall other requests
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._entries)

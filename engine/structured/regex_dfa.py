r"""Regex -> DFA -> token mask: how a grammar keeps a language model inside a pattern.

This file is for reading. The engine's structured outputs go through a library built for speed
(llguidance, in `engine/structured/grammar.py`); here we do the same job for regular expressions
in plain Python, small enough to follow end to end. The story has four steps:

    r"-?\d+(\.\d+)?"                         the pattern, as text
        |  1. parse                          -> a tree: ByteSet, Concat, Alt, Repeat
        v
    Thompson NFA                             -> states joined by byte edges and free (eps) edges
        |  2. subset construction
        v
    DFA: transitions [S][256], accepting [S] -> one state per "set of NFA states we could be in"
        |  3. walk every token's bytes from every state
        v
    TokenTable: next_state [S, V]            -> mask(state) [V]: the tokens that may come next
        |  4. RegexProcessor
        v
    logits [V] with every forbidden token at -inf (EOS only where the text so far matches)

Why BYTES, not characters: the tokenizers we serve are byte-level BPE. "é" is the two bytes C3 A9
and tinylab has a token for each of them alone, so a model may write half a character in one step
and the other half in the next. A character-level automaton could not say which tokens may come
after half an "é"; a byte-level one can, so every automaton below reads UTF-8 bytes.

The teaching subset of the pattern language (a subset of Python's `re`, matched in full like
`re.fullmatch`, with `re.ASCII` meanings for the escapes):

    literals a é 7     escapes \. \\ \* \n \t \xhh     classes \d \w \s \D \W \S   any char .
    sets [a-z0-9_] [^"\\] []a] [a-]                    groups (ab) (?:ab)     alternation a|b
    quantifiers * + ? {m} {m,} {,n} {m,n}

Anything else (anchors, lookaround, backreferences, lazy quantifiers, ...) raises a ValueError
that names it. Shape notation: S DFA states, V vocabulary, L bytes in the longest token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# ---- 1. the pattern as a tree ------------------------------------------------------------------
#
# Four kinds of node are enough for every pattern in the subset:
#
#     r"a[0-9]+|b"  ->  Alt( Concat( ByteSet{a}, Repeat(ByteSet{0..9}, 1, None) ), ByteSet{b} )
#
# A non-ASCII character is a Concat of its UTF-8 bytes; "any character" is an Alt over the shapes
# a UTF-8 encoding can take (UTF8_MULTIBYTE below).

NUM_BYTES = 256  # a DFA state has one transition per possible byte
ASCII_LIMIT = 0x80  # bytes below this are whole characters in UTF-8; the others are parts of one
# Bigger counts unroll into that many NFA copies; a teaching regex needs far fewer.
MAX_REPEAT = 1000
# The subset construction can blow up (r"(a|b)*a(a|b){20}" needs 2**21 states). A teaching regex
# stays far below; 2,000 states x SmolLM2's 49,152 tokens is already a 393 MB int32 table.
MAX_DFA_STATES = 2000
# Nested counted repeats unroll multiplicatively ((a{1000}){1000} is a million copies).
MAX_NFA_STATES = 100_000
DEAD = -1  # "no state": the bytes so far can no longer be completed into a match
PRINTABLE_ASCII = (0x21, 0x7E)  # "!" .. "~": bytes that format_dfa shows as themselves

# (lead byte range, continuation byte ranges ...) of every valid multi-byte UTF-8 character
# (RFC 3629, table 3-7 of the Unicode standard): no overlong forms, no surrogates, <= U+10FFFF.
UTF8_MULTIBYTE = (
    ((0xC2, 0xDF), (0x80, 0xBF)),
    ((0xE0, 0xE0), (0xA0, 0xBF), (0x80, 0xBF)),
    ((0xE1, 0xEC), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xED, 0xED), (0x80, 0x9F), (0x80, 0xBF)),
    ((0xEE, 0xEF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF0, 0xF0), (0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF1, 0xF3), (0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF4, 0xF4), (0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF)),
)


@dataclass(frozen=True)
class ByteSet:
    """Read one byte out of ``values``."""

    values: frozenset[int]


@dataclass(frozen=True)
class Concat:
    """Read ``parts`` one after the other. ``Concat(())`` reads nothing: the empty string."""

    parts: tuple


@dataclass(frozen=True)
class Alt:
    """Read one of ``options``. ``Alt(())`` matches nothing at all."""

    options: tuple


@dataclass(frozen=True)
class Repeat:
    """Read ``node`` between ``min`` and ``max`` times (``max`` None: no limit)."""

    node: object
    min: int
    max: int | None


Node = ByteSet | Concat | Alt | Repeat


def _byte_range(lo: int, hi: int) -> ByteSet:
    return ByteSet(frozenset(range(lo, hi + 1)))


NON_ASCII_CHAR = Alt(tuple(Concat(tuple(_byte_range(*r) for r in shape))
                           for shape in UTF8_MULTIBYTE))


@dataclass(frozen=True)
class CharClass:
    """A set of characters while we parse: ASCII ones as bytes, other ones listed by name, or
    every non-ASCII character at once (what ``.``, ``\\D`` and ``[^...]`` need)."""

    ascii: frozenset[int] = frozenset()
    others: frozenset[str] = frozenset()
    all_non_ascii: bool = False

    @staticmethod
    def of(chars: str) -> CharClass:
        return CharClass(frozenset(ord(c) for c in chars if ord(c) < ASCII_LIMIT),
                         frozenset(c for c in chars if ord(c) >= ASCII_LIMIT))

    def union(self, other: CharClass) -> CharClass:
        return CharClass(self.ascii | other.ascii, self.others | other.others,
                         self.all_non_ascii or other.all_non_ascii)

    def negated(self) -> CharClass:
        """Every character not in the set (callers first check that ``others`` is empty)."""
        return CharClass(frozenset(range(ASCII_LIMIT)) - self.ascii,
                         all_non_ascii=not self.all_non_ascii)

    def node(self) -> Node:
        options = [ByteSet(self.ascii)] if self.ascii else []
        if self.all_non_ascii:
            options.append(NON_ASCII_CHAR)
        else:
            options += [Concat(tuple(ByteSet(frozenset({b})) for b in c.encode()))
                        for c in sorted(self.others)]
        return options[0] if len(options) == 1 else Alt(tuple(options))


_DIGITS = CharClass.of("0123456789")
_WORD = CharClass.of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_SPACE = CharClass.of(" \t\n\r\f\v")
CLASS_ESCAPES = {"d": _DIGITS, "w": _WORD, "s": _SPACE,
                 "D": _DIGITS.negated(), "W": _WORD.negated(), "S": _SPACE.negated()}
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
DOT = CharClass.of("\n").negated()  # any character but a newline, as in Python's re
HEX_ESCAPE_DIGITS = 2  # \xhh
BRACES = re.compile(r"\{(\d*)(,?)(\d*)\}")  # {m} {m,} {,n} {m,n}, as Python's re reads them


class _Parser:
    """Recursive descent, one method per level of the grammar:

        alternation := concat ('|' concat)*
        concat      := quantified*
        quantified  := atom ('*' | '+' | '?' | '{m,n}')?
        atom        := char | '.' | escape | '[' set ']' | '(' alternation ')'
    """

    def __init__(self, pattern: str):
        self.pattern, self.pos = pattern, 0

    def parse(self) -> Node:
        node = self._alternation()
        if self.pos < len(self.pattern):  # only a ')' with no '(' stops the alternation early
            self._error("an unbalanced ')'", "remove it or add the '(' it closes")
        return node

    def _error(self, what: str, hint: str):
        raise ValueError(f"regex {self.pattern!r} at position {self.pos}: {what}; {hint}")

    def _unsupported(self, what: str, hint: str):
        self._error(f"{what} is not in the teaching subset", hint)

    def _peek(self, ahead: int = 0) -> str | None:
        i = self.pos + ahead
        return self.pattern[i] if i < len(self.pattern) else None

    def _take(self) -> str:
        c = self._peek()
        if c is None:
            self._error("the pattern ends too early", "finish the construct that is open")
        self.pos += 1
        return c

    def _alternation(self) -> Node:
        options = [self._concat()]
        while self._peek() == "|":
            self.pos += 1
            options.append(self._concat())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def _concat(self) -> Node:
        parts = []
        while self._peek() not in (None, "|", ")"):
            parts.append(self._quantified())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def _quantified(self) -> Node:
        if self._quantifier(peek_only=True) is not None:
            self._error(f"nothing to repeat before {self._peek()!r}", "put an atom before it")
        node = self._atom()
        bounds = self._quantifier()
        if bounds is None:
            return node
        after = self._peek()
        if after == "?":
            self._unsupported("a lazy quantifier (*?, +?, ??, {m,n}?)",
                              "drop the '?': for a full match it accepts the same strings")
        if after == "+":
            self._unsupported("a possessive quantifier (*+, ++, ?+)", "drop the '+'")
        if after == "*" or self._quantifier(peek_only=True) is not None:
            self._error("a repeat of a repeat", "wrap the inner one in a group: (a*)*")
        return Repeat(node, *bounds)

    def _quantifier(self, peek_only: bool = False) -> tuple[int, int | None] | None:
        c = self._peek()
        simple = {"*": (0, None), "+": (1, None), "?": (0, 1)}
        if c in simple:
            self.pos += 0 if peek_only else 1
            return simple[c]
        found = BRACES.match(self.pattern, self.pos) if c == "{" else None
        if found is None:  # Python reads a '{' that is no quantifier as a literal brace
            return None
        lo, comma, hi = found.groups()
        bounds = (int(lo or 0), int(hi) if hi else (None if comma else int(lo or 0)))
        if not peek_only:
            self._check_bounds(*bounds)
            self.pos = found.end()
        return bounds

    def _check_bounds(self, lo: int, hi: int | None) -> None:
        if hi is not None and lo > hi:
            self._error(f"{{{lo},{hi}}} has min > max", "swap the two numbers")
        if max(lo, hi or 0) > MAX_REPEAT:
            self._unsupported(f"a repeat count above {MAX_REPEAT}",
                              "use * or + instead of a huge count")

    def _atom(self) -> Node:
        c = self._take()
        if c == "(":
            return self._group()
        if c == "[":
            return self._set().node()
        if c == ".":
            return DOT.node()
        if c == "\\":
            item = self._escape()
            return item.node() if isinstance(item, CharClass) else CharClass.of(item).node()
        if c in "^$":
            self.pos -= 1
            self._unsupported(f"the anchor {c!r}",
                              "drop it: the whole output is matched already, like re.fullmatch")
        return CharClass.of(c).node()

    def _group(self) -> Node:
        if self._peek() == "?":
            if self._peek(1) != ":":
                self._unsupported(f"the group syntax '(?{self._peek(1) or ''}' (lookaround, "
                                  "named groups, flags)", "use a plain group (...) or (?:...)")
            self.pos += 2
        node = self._alternation()
        if self._peek() != ")":
            self._error("a '(' is never closed", "add the missing ')'")
        self.pos += 1
        return node

    def _set(self) -> CharClass:
        """A bracket set, after its '['. A ']' right after '[' or '[^' is a literal, as in re."""
        negate = self._peek() == "^"
        self.pos += negate
        items, first = CharClass(), True
        while first or self._peek() != "]":
            if self._peek() is None:
                self._error("a '[' is never closed", "add the missing ']'")
            items, first = items.union(self._set_item()), False
        self.pos += 1
        if negate and items.others:
            self._unsupported("a negated set with non-ASCII members",
                              "list what is allowed instead of what is not")
        return items.negated() if negate else items

    def _set_char(self) -> str | CharClass:
        c = self._take()
        return self._escape() if c == "\\" else c

    def _set_item(self) -> CharClass:
        """One member of a set: a character, an escape, or a range lo-hi (a '-' last is literal)."""
        lo = self._set_char()
        if self._peek() != "-" or self._peek(1) in ("]", None):
            return lo if isinstance(lo, CharClass) else CharClass.of(lo)
        self.pos += 1
        hi = self._set_char()
        if isinstance(lo, CharClass) or isinstance(hi, CharClass):
            self._error("a range with a class (\\d, \\w, ...) at one end", "list them apart")
        if ord(lo) >= ASCII_LIMIT or ord(hi) >= ASCII_LIMIT:
            self._unsupported(f"the non-ASCII range {lo}-{hi}", "list the characters one by one")
        if lo > hi:
            self._error(f"the range {lo}-{hi} runs backwards", f"write {hi}-{lo}")
        return CharClass(frozenset(range(ord(lo), ord(hi) + 1)))

    def _escape(self) -> str | CharClass:
        """After a backslash: a class (\\d), a control character (\\n), \\xhh, or a literal."""
        c = self._take()
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CONTROL_ESCAPES:
            return CONTROL_ESCAPES[c]
        if c == "x":
            digits = self.pattern[self.pos: self.pos + HEX_ESCAPE_DIGITS]
            if len(digits) < HEX_ESCAPE_DIGITS or not all(d in "0123456789abcdefABCDEF"
                                                          for d in digits):
                self._error("\\x needs two hex digits", "write e.g. \\x41 for 'A'")
            self.pos += HEX_ESCAPE_DIGITS
            return chr(int(digits, 16))
        if c.isascii() and c.isalnum():
            self.pos -= 1
            self._unsupported(f"the escape \\{c} (anchors, backreferences, \\u, \\p, ...)",
                              "spell the characters out, or escape only punctuation")
        return c  # \. \\ \* \{ ...: the character itself


def parse_regex(pattern: str) -> Node:
    """The tree of a pattern in the teaching subset; ValueError naming anything outside it."""
    if not isinstance(pattern, str):
        raise ValueError(f"pattern must be a str, got {type(pattern).__name__}")
    return _Parser(pattern).parse()


# ---- 2. Thompson's construction: tree -> NFA ---------------------------------------------------
#
# Every node becomes a fragment with one way in (s) and one way out (e); bigger fragments are
# wired from smaller ones with free "eps" edges, which the automaton may take without reading:
#
#     ByteSet {a}     (s) --a--> (e)
#
#     Concat A B      (s) -eps-> [ A ] -eps-> [ B ] = (e)
#
#     Alt A | B       (s) -eps-> [ A ] -eps-> (e)
#                      '--eps-> [ B ] --eps--'
#
#     Repeat A{0,}    (s) -eps-> [ A ] -eps-> (e)       A{2,4} = A A (A (A)?)?: two required
#                      |    ^------'    |               copies, then two that may skip to (e)
#                      '-------eps------'
#
# The NFA accepts a byte string when SOME path from the start reads it and ends at the accept.


@dataclass
class NFA:
    """States 0 .. n-1. ``edges[i]``: (bytes, target) pairs, read one byte of the set to move;
    ``eps[i]``: targets reachable for free. One start, one accept (Thompson gives one of each)."""

    edges: list[list[tuple[frozenset[int], int]]]
    eps: list[list[int]]
    start: int
    accept: int


class _NFABuilder:
    def __init__(self):
        self.edges: list[list[tuple[frozenset[int], int]]] = []
        self.eps: list[list[int]] = []

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise ValueError(f"the pattern unrolls to more than {MAX_NFA_STATES} NFA states "
                             "(nested counted repeats multiply); use * or + or smaller counts")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def then(self, here: int, node: Node) -> int:
        """Wire a fragment for ``node`` after state ``here``; return its way out."""
        start, end = self.fragment(node)
        self.eps[here].append(start)
        return end

    def fragment(self, node: Node) -> tuple[int, int]:
        s = self.state()
        if isinstance(node, ByteSet):
            e = self.state()
            self.edges[s].append((node.values, e))
            return s, e
        if isinstance(node, Concat):
            here = s
            for part in node.parts:
                here = self.then(here, part)
            return s, here
        if isinstance(node, Alt):
            e = self.state()
            for option in node.options:
                self.eps[self.then(s, option)].append(e)
            return s, e
        return s, self.repeat(s, node)

    def repeat(self, s: int, node: Repeat) -> int:
        here = s
        for _ in range(node.min):  # the required copies, one after another
            here = self.then(here, node.node)
        e = self.state()
        if node.max is None:  # then a loop: (here) may skip to e, and each pass may go round
            loop_start, loop_end = self.fragment(node.node)
            self.eps[here] += [loop_start, e]
            self.eps[loop_end] += [loop_start, e]
            return e
        for _ in range(node.max - node.min):  # then optional copies, each may skip to e
            self.eps[here].append(e)
            here = self.then(here, node.node)
        self.eps[here].append(e)
        return e


def thompson_nfa(node: Node) -> NFA:
    builder = _NFABuilder()
    start, accept = builder.fragment(node)
    return NFA(builder.edges, builder.eps, start, accept)


# ---- 3. subset construction: NFA -> DFA --------------------------------------------------------
#
# An NFA may be in several states at once. We name each SET of states it can be in after some
# bytes and make that set one DFA state; reading a byte moves every member, then follows the free
# edges ("eps closure"). For r"ab|ac", naming the NFA states by the byte edge they wait on:
#
#     {wait a (1st), wait a (2nd)} --a--> {wait b, wait c} --b--> {after b, ..., accept}  = 2
#                                                          --c--> {after c, ..., accept}  = 3
#
# The two ends are different sets (each branch has its own NFA states), so they are two DFA states,
# 2 and 3, both accepting, with nothing after them. Then we "trim": a state from which no
# accepting state can be reached becomes DEAD, so afterwards
#     walk(state 0, some bytes) != DEAD   <=>   those bytes can still be completed into a match,
# which is exactly the question a token mask asks. Last we "minimize": states that accept the same
# continuations merge (2 and 3 above become one), so the token table below has as few rows as the
# language allows.


@dataclass
class DFA:
    """``transitions[s][b]``: the state after byte ``b`` in state ``s``, or DEAD;
    ``accepting[s]``: do the bytes that led to ``s`` match in full. The start is state 0."""

    transitions: list[list[int]]  # [S][256]
    accepting: list[bool]  # [S]
    pattern: str = ""
    start: int = 0

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading ``data`` from ``state`` (DEAD as soon as it dies)."""
        for byte in data:
            if state == DEAD:
                break
            state = self.transitions[state][byte]
        return state

    def accepts(self, text: str | bytes) -> bool:
        """Does the whole text match (``re.fullmatch`` with re.ASCII)? A str is read as UTF-8."""
        end = self.walk(self.start, text.encode() if isinstance(text, str) else text)
        return end != DEAD and self.accepting[end]


def _closure(nfa: NFA, states: Iterable[int]) -> frozenset[int]:
    """Every NFA state reachable from ``states`` by free edges alone (the states included)."""
    seen, todo = set(states), list(states)
    while todo:
        for t in nfa.eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)


def _moves(nfa: NFA, subset: frozenset[int]) -> dict[frozenset[int], list[int]]:
    """The 256 bytes grouped by where they lead from ``subset``: {NFA targets: [bytes]}."""
    targets: list[set[int]] = [set() for _ in range(NUM_BYTES)]
    for s in subset:
        for values, t in nfa.edges[s]:
            for b in values:
                targets[b].add(t)
    groups: dict[frozenset[int], list[int]] = {}
    for b, ts in enumerate(targets):
        if ts:
            groups.setdefault(frozenset(ts), []).append(b)
    return groups


def subset_construction(nfa: NFA, pattern: str = "") -> DFA:
    """The DFA whose states are the sets of NFA states reachable from the start, in discovery
    order (state 0: the start's closure). Not trimmed yet: see `trim`."""
    order = [_closure(nfa, [nfa.start])]
    ids, rows = {order[0]: 0}, []
    while len(rows) < len(order):  # order grows while we work through it
        row = [DEAD] * NUM_BYTES
        for targets, values in _moves(nfa, order[len(rows)]).items():
            nxt = _closure(nfa, targets)
            if nxt not in ids:
                if len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"regex {pattern!r} needs more than {MAX_DFA_STATES} DFA "
                                     "states; simplify it (fewer nested repeats and counts)")
                ids[nxt] = len(order)
                order.append(nxt)
            for b in values:
                row[b] = ids[nxt]
        rows.append(row)
    return DFA(rows, [nfa.accept in subset for subset in order], pattern)


def _live_states(dfa: DFA) -> set[int]:
    """The states from which some accepting state can be reached (walking the edges backwards)."""
    sources: list[set[int]] = [set() for _ in range(dfa.num_states)]
    for s, row in enumerate(dfa.transitions):
        for t in row:
            if t != DEAD:
                sources[t].add(s)
    live = {s for s in range(dfa.num_states) if dfa.accepting[s]}
    todo = list(live)
    while todo:
        for s in sources[todo.pop()] - live:
            live.add(s)
            todo.append(s)
    return live


def trim(dfa: DFA) -> DFA:
    """Send every transition into a state that can never accept to DEAD, and drop those states
    (the start stays, as state 0, even when the pattern matches nothing)."""
    live = _live_states(dfa)
    keep = [s for s in range(dfa.num_states) if s in live or s == dfa.start]
    new_id = {s: i for i, s in enumerate(keep)}
    rows = [[new_id[t] if t in live else DEAD for t in dfa.transitions[s]] for s in keep]
    return DFA(rows, [dfa.accepting[s] for s in keep], dfa.pattern, new_id[dfa.start])


def minimize(dfa: DFA) -> DFA:
    """Merge the states that no continuation can tell apart (Moore's partition refinement).

    We start from two groups, accepting or not, and split a group while two of its states send
    some byte to different groups; when no group splits, each group becomes one state. For
    r"ab|ac" the two accepting states (after "ab", after "ac") merge into one."""
    group = [int(a) for a in dfa.accepting]
    while True:
        signature = [(group[s], tuple(DEAD if t == DEAD else group[t] for t in row))
                     for s, row in enumerate(dfa.transitions)]
        ids: dict[tuple, int] = {}  # numbered by first appearance: the start's group is 0
        refined = [ids.setdefault(sig, len(ids)) for sig in signature]
        if len(ids) == len(set(group)):
            break
        group = refined
    first = {g: s for s, g in reversed(list(enumerate(refined)))}  # a member of each group
    rows = [[DEAD if t == DEAD else refined[t] for t in dfa.transitions[first[g]]]
            for g in range(len(ids))]
    return DFA(rows, [dfa.accepting[first[g]] for g in range(len(ids))], dfa.pattern,
               refined[dfa.start])


def compile_regex(pattern: str) -> DFA:
    """parse -> Thompson NFA -> subset construction -> trim -> minimize: the DFA over bytes."""
    return minimize(trim(subset_construction(thompson_nfa(parse_regex(pattern)), pattern)))


def _show_byte(b: int) -> str:
    """A byte as itself when it is printable ASCII with no meaning in a set, else \\xhh."""
    return chr(b) if PRINTABLE_ASCII[0] <= b <= PRINTABLE_ASCII[1] and chr(b) not in "[]-\\" \
        else f"\\x{b:02x}"


def _byte_label(values: list[int]) -> str:
    """[48, 49, ..., 57] -> "[0-9]": consecutive bytes shown as ranges, one byte bare."""
    if len(values) == 1:
        return _show_byte(values[0])
    runs, start = [], values[0]
    for prev, b in zip(values, [*values[1:], None], strict=True):
        if b != prev + 1:
            runs.append(_show_byte(start) if start == prev
                        else f"{_show_byte(start)}-{_show_byte(prev)}")
            start = b
    return "[" + "".join(runs) + "]"


def format_dfa(dfa: DFA) -> str:
    """The DFA as text, one line per (state, next state): ``0 --[0-9]--> 1``; accepting states
    are marked ``(accept)``. Bytes >= 0x80 show as \\x.. escapes."""
    lines = []
    for s, row in enumerate(dfa.transitions):
        targets: dict[int, list[int]] = {}
        for b, t in enumerate(row):
            if t != DEAD:
                targets.setdefault(t, []).append(b)
        mark = " (accept)" if dfa.accepting[s] else ""
        lines += [f"{s}{mark} --{_byte_label(bs)}--> {t}" for t, bs in targets.items()]
        lines += [] if targets else [f"{s}{mark} (no way on)"]
    return "\n".join(lines)


# ---- 4. the vocabulary as bytes ----------------------------------------------------------------
#
# A byte-level BPE vocabulary (GPT-2's scheme, used by tinylab and SmolLM2) stores each token as
# text in a 256-character alphabet: printable bytes stand for themselves, the other 68 bytes are
# shifted up past 255 ("Ġ" = chr(256 + 32) is the space). So "Ġwor" is the bytes b" wor".

BYTE_LEVEL_PRINTABLE = (*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                        *range(ord("®"), ord("ÿ") + 1))


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's stand-in character for each of the 256 bytes, as {character: byte}."""
    table, shifted = {}, 0
    for b in range(NUM_BYTES):
        if b in BYTE_LEVEL_PRINTABLE:
            table[chr(b)] = b
        else:
            table[chr(NUM_BYTES + shifted)] = b
            shifted += 1
    return table


def vocab_bytes(tokenizer) -> list[bytes | None]:
    """Each token id's bytes, [V]. None for special tokens (<eos>, <pad>): they are not text.

    ``tokenizer``: an engine `Tokenizer` (or a `tokenizers.Tokenizer`) with a byte-level vocab."""
    tk = getattr(tokenizer, "tk", tokenizer)
    alphabet, added = byte_level_alphabet(), tk.get_added_tokens_decoder()
    out: list[bytes | None] = []
    for token_id in range(tk.get_vocab_size()):
        piece = tk.id_to_token(token_id)
        if piece is None or (token_id in added and added[token_id].special):
            out.append(None)
        elif token_id in added:  # a plain added token is stored as its own text
            out.append(piece.encode())
        elif all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        else:
            raise ValueError(f"token {token_id} = {piece!r} is not in the byte-level alphabet; "
                             "this reference reads byte-level BPE vocabularies (GPT-2 style, "
                             "as tinylab and SmolLM2)")
    return out


# ---- 5. the token table: every token walked from every state -----------------------------------
#
# A token is a few bytes, so it may cross several DFA states, and even pass THROUGH an accepting
# state on its way. For r"\d+(\.\d+)?", from the start state (0):
#
#     token "1"    0 --1--> 1(acc)                                  allowed, lands in 1
#     token "12"   0 --1--> 1(acc) --2--> 1(acc)                    allowed, lands in 1
#     token "2.5"  0 --2--> 1(acc) --.--> 2 --5--> 3(acc)           allowed, lands in 3
#     token "1a"   0 --1--> 1(acc) --a--> DEAD                      NOT allowed
#     token "."    0 --.--> DEAD                                    NOT allowed
#
# Checking only a token's first byte would allow "1a"; the table walks all of them. We walk every
# token from every state at once, one byte position per loop turn, over a [S, V] grid of states.
# (Libraries walk a trie of the vocabulary instead, so a shared prefix is walked once and a dead
# branch drops all its tokens together: the same table, faster.)

# Cells of the [S, V] grid walked per chunk of states: 4M int64 cells = 32 MB per temporary.
WALK_CHUNK_CELLS = 1 << 22


def _pad_tokens(vocab: Sequence[bytes | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens as a byte grid [V, L] (zero-padded) and their lengths [V] (0 for None)."""
    pieces = [piece or b"" for piece in vocab]
    width = max(1, max((len(p) for p in pieces), default=0))
    padded = bytearray(b"".join(p.ljust(width, b"\0") for p in pieces))
    grid = torch.frombuffer(padded, dtype=torch.uint8).reshape(len(pieces), width)  # [V, L]
    return grid.long(), torch.tensor([len(p) for p in pieces], dtype=torch.long)


def _walk_from(table: torch.Tensor, states: torch.Tensor, grid: torch.Tensor,
               lengths: torch.Tensor) -> torch.Tensor:
    """Read every token from the given start states: states [s] -> landing states [s, V].

    The tokens come sorted longest first, so at byte j the tokens still being read are the first
    ``n`` columns and each turn touches only those: the work is s x (all the vocab's bytes), not
    s x V x L (a vocab's longest token is 10x its typical one)."""
    states = states[:, None].repeat(1, grid.shape[0])  # [s, V]: every token starts in its row's
    for j in range(grid.shape[1]):
        n = int((lengths > j).sum())  # tokens with a byte j
        states[:, :n] = table[states[:, :n], grid[:n, j]]  # [s, n]: read byte j
    return states


def walk_vocab(dfa: DFA, vocab: Sequence[bytes | None]) -> torch.Tensor:
    """next_state [S, V]: the state each token leads to from each state, DEAD where it cannot be
    read (and for tokens with no bytes, which would be allowed forever without progress)."""
    if len(vocab) == 0:
        raise ValueError("vocab is empty; pass one bytes (or None) per token id")
    num_states, sink = dfa.num_states, dfa.num_states
    # [S + 1, 256]: DEAD becomes a real "sink" row S whose every byte leads back to it
    table = torch.tensor([[sink if t == DEAD else t for t in row] for row in dfa.transitions]
                         + [[sink] * NUM_BYTES], dtype=torch.long)
    grid, lengths = _pad_tokens(vocab)  # [V, L], [V]
    order = torch.argsort(lengths, descending=True, stable=True)  # [V]: longest token first
    chunk = max(1, WALK_CHUNK_CELLS // max(1, len(vocab)))  # start states per turn
    walked = torch.zeros(num_states, len(vocab), dtype=torch.long)  # [S, V], in vocab order
    for first in range(0, num_states, chunk):
        rows = torch.arange(first, min(first + chunk, num_states))  # [s]
        walked[first: first + len(rows), order] = _walk_from(table, rows, grid[order],
                                                             lengths[order])
    walked[walked == sink] = DEAD
    walked[:, lengths == 0] = DEAD
    return walked.to(torch.int32)  # [S, V]; state ids < MAX_DFA_STATES fit


@dataclass(eq=False)
class TokenTable:
    """Which tokens may follow each DFA state, and where they lead; built once per (regex, vocab).

        next_state [S, V]   token t read from state s lands in next_state[s, t] (DEAD: forbidden)
        accepting  [S]      the text so far matches in full: EOS is allowed here, and only here

    Then ``mask(s) = (next_state[s] != DEAD)``, plus the EOS ids when ``accepting[s]``.
    """

    dfa: DFA
    next_state: torch.Tensor  # [S, V] int32
    accepting: torch.Tensor  # [S] bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def build(cls, dfa: DFA, vocab: Sequence[bytes | None],
              eos_token_ids: Iterable[int]) -> TokenTable:
        eos = tuple(int(i) for i in eos_token_ids)
        bad = [i for i in eos if not 0 <= i < len(vocab)]
        if bad:
            raise ValueError(f"eos_token_ids {bad} are outside the vocabulary 0..{len(vocab) - 1}")
        next_state = walk_vocab(dfa, vocab)  # [S, V]
        next_state[:, list(eos)] = DEAD  # EOS is never text: it ends the output (see mask)
        return cls(dfa, next_state, torch.tensor(dfa.accepting, dtype=torch.bool), eos)

    @classmethod
    def from_tokenizer(cls, pattern: str, tokenizer) -> TokenTable:
        """The table for a pattern over an engine `Tokenizer`'s vocabulary and EOS ids."""
        return cls.build(compile_regex(pattern), vocab_bytes(tokenizer), tokenizer.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.next_state.shape[1]

    @property
    def start(self) -> int:
        return self.dfa.start

    def _check_state(self, state: int) -> None:
        if not 0 <= state < self.dfa.num_states:
            raise ValueError(f"state {state} is outside 0..{self.dfa.num_states - 1} "
                             "(DEAD is no state: nothing may follow it)")

    def mask(self, state: int) -> torch.Tensor:
        """BoolTensor [V]: True for the tokens that may come next in ``state``."""
        self._check_state(state)
        allowed = self.next_state[state] != DEAD  # [V]
        if self.accepting[state]:
            allowed[list(self.eos_token_ids)] = True
        return allowed

    def allowed_tokens(self, state: int) -> set[int]:
        """The ids ``mask(state)`` allows, as a set (handy to compare with another masker)."""
        return set(self.mask(state).nonzero().flatten().tolist())

    def advance(self, state: int, token: int) -> int:
        """The state after ``token``; an EOS (allowed only when accepting) leaves it as it is."""
        if not 0 <= token < self.vocab_size or not self.mask(state)[token]:
            raise ValueError(f"token {token} is not allowed in state {state} of regex "
                             f"{self.dfa.pattern!r}; allowed: the ids where mask({state}) is True")
        return state if token in self.eos_token_ids else int(self.next_state[state, token])


# ---- 6. the logits processor --------------------------------------------------------------------


class RegexProcessor:
    """Keep ONE sequence inside a regex: engine/sampling.py's LogitsProcessor,
    ``(output_ids, logits [V]) -> logits [V]``.

    It remembers the DFA state after the output tokens it has seen; on each call it reads the new
    ones and sets every token the state forbids to -inf (before temperature, so the survivors are
    renormalized by softmax as usual). It holds one sequence's state: make one per sequence and
    share the `TokenTable` between them. A rewound output (the same processor on a new sequence)
    is read again from the start.
    """

    def __init__(self, table: TokenTable):
        self.table = table
        self.state = table.start
        self._seen: list[int] = []

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self._catch_up(list(output_ids))
        allowed = self.table.mask(self.state)  # [V of the table]
        if not allowed.any():
            raise ValueError(f"no token of the vocabulary can continue regex "
                             f"{self.table.dfa.pattern!r} from state {self.state}")
        if logits.shape[-1] < allowed.shape[0]:
            raise ValueError(f"logits have V = {logits.shape[-1]} entries but the token table "
                             f"has {allowed.shape[0]}; build it from this model's tokenizer")
        padded = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # [V]
        padded[: allowed.shape[0]] = allowed.to(logits.device)  # ids past the vocab: never
        return logits.masked_fill(~padded, float("-inf"))

    def _catch_up(self, output_ids: list[int]) -> None:
        if output_ids[: len(self._seen)] != self._seen:
            self.state, self._seen = self.table.start, []
        for token in output_ids[len(self._seen):]:
            self.state = self.table.advance(self.state, token)
            self._seen.append(token)

r"""Chapter 13 exercises: structured outputs by hand. Walking a DFA, the tokens one state allows,
masking the logits (and why -inf, not 0), and OpenAI's logit_bias.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch13

A regular expression becomes a DFA: states joined by edges, one edge per character it may read.
Here a DFA is a dict, state -> {character: next state}; it starts in state 0, and `accepting` is
the set of states where the text read so far matches in full. For r"\d+(\.\d+)?" (digits, and
maybe a dot and more digits):

          digit         "."          digit
    (0) --------> ((1)) -----> (2) --------> ((3))       ((n)): accepting
                   |  ^                       |  ^
                   +--+ digit                 +--+ digit

    transitions = {0: {"0": 1, ..., "9": 1}, 1: {"0": 1, ..., "9": 1, ".": 2},
                   2: {"0": 3, ..., "9": 3}, 3: {"0": 3, ..., "9": 3}}
    accepting = {1, 3}

A state with no way on may be missing from `transitions` altogether (the last state of r"ab").
A language model writes TOKENS, not characters, and one token may cross several states: from
state 0 the token "2.5" goes 0 -> 1 -> 2 -> 3. At each step we mask every token whose characters
cannot all be read from the current state, and let EOS through only where the text matches:

    state 0   "7" "12" "2.5" allowed   "1a" "." forbidden   EOS forbidden ("" is no match)
    state 1   "7" "12" "." ".5" "2.5"  allowed              EOS allowed ("12" is a match)

The engine's versions: engine/structured/regex_dfa.py (the same idea over bytes, for every state
at once: `TokenTable`), engine/structured/grammar.py (llguidance, at the engine's speed), and
`apply_logit_bias` and `processed_logits` in engine/sampling.py (the order: penalties, logit bias,
the request's processors, the grammar's mask, min_tokens). Try not to peek until the checks pass.
"""

from __future__ import annotations

import torch  # noqa: F401 (yours to use)
from torch import Tensor

START = 0  # every DFA of this chapter starts in state 0

# ---- part 1: walking a DFA -----------------------------------------------------------------------


def dfa_step(transitions: dict[int, dict[str, int]], state: int, text: str) -> int | None:
    """The state after reading every character of `text` from `state`, or None as soon as a
    character has no edge (the walk falls off the DFA: no continuation of the text can match).

    With the DFA above: dfa_step(t, 0, "12.5") == 3, dfa_step(t, 0, "") == 0,
    dfa_step(t, 0, "1a") is None, dfa_step(t, 1, ".") == 2.
    """
    raise NotImplementedError(
        "which edge do you follow for each character in turn, and what do you return when a "
        "state has no edge for a character, or no row in transitions at all?")


def accepts(transitions: dict[int, dict[str, int]], accepting: set[int], text: str) -> bool:
    r"""Does the WHOLE text match (like re.fullmatch)? Walk it from START; it matches when the
    walk stays on the DFA and ends in an accepting state.

    accepts(t, {1, 3}, "2.5") is True; "2." is False (on its way to a match, not one yet);
    "" is False here, but True for a DFA whose start state accepts (r"\d*").
    """
    raise NotImplementedError(
        "where must the walk over the whole text end for a match? Is passing through an "
        "accepting state on the way enough, and what about the empty text?")


# ---- part 2: the tokens one state allows ---------------------------------------------------------


def token_mask(transitions: dict[int, dict[str, int]], accepting: set[int], state: int,
               vocab: list[str], eos_id: int) -> list[bool]:
    """One bool per token id of `vocab` (its text): may it come next in `state`?

    A token is allowed when ALL its characters can be read from `state` (it may cross several
    states, and need not end in an accepting one: "2." from state 0 is fine, the ".5" can follow).
    The empty token "" never is (it would be allowed forever and make no progress). EOS
    (vocab[eos_id], whatever its text) is allowed exactly when `state` is accepting.
    """
    raise NotImplementedError(
        "for each token: how many of its characters must the DFA be able to read? Which tokens "
        "does that rule say nothing sensible about, and when may the output end?")


# ---- part 3: masking the logits ------------------------------------------------------------------


def constrain(logits: Tensor, allowed: list[bool]) -> Tensor:
    """The logits [..., V] with every disallowed token at -inf (a new tensor; the allowed ones as
    they were), so softmax gives the disallowed probability exactly 0 at any temperature. One mask
    [V] for every row. A ValueError naming allowed unless it holds V bools, one of them True.
    """
    raise NotImplementedError(
        "what logit gives a token probability exactly 0 after softmax, whatever the temperature "
        "divides it by? Is a logit of 0 small?")


def apply_temperature_then_mask(logits: Tensor, allowed: list[bool],
                                temperature: float) -> Tensor:
    """The distribution [..., V] to sample from, computed the probability way: softmax of the
    logits divided by the temperature, the disallowed probabilities set to 0, and what is left
    turned back into a distribution. It must equal softmax(constrain(logits, allowed) / t),
    masking first; a ValueError naming temperature unless it is > 0.
    """
    raise NotImplementedError(
        "after the disallowed probabilities are set to 0, what do the others sum to? How do you "
        "make them a distribution again without changing how they compare with each other?")


# ---- part 4: OpenAI's logit_bias -----------------------------------------------------------------


def logit_bias(logits: Tensor, bias: dict[int, float]) -> Tensor:
    """One row of logits [V] with OpenAI's logit_bias applied: a new tensor, in which each token
    id in `bias` has its logit moved by its bias (biases run from -100 to 100: -100 all but bans
    a token, +100 all but forces it), and every other logit is as it was.

    logit_bias(tensor([1., 2., 3.]), {0: 1.5, 2: -2.0}) == tensor([2.5, 2., 1.])
    """
    raise NotImplementedError(
        "is the bias applied to the logit or to the probability, by adding or by multiplying? "
        "What must the caller's tensor look like afterwards?")

"""Chapter 13's mutants: the classic mistakes of structured outputs, each patched into the reference
solution (the same machinery as tests/test_exercise_mutants.py: `old` must occur exactly once in the
function), each naming the check that must fail on it. tests/test_exercise_mutants.py counts them
per function and checks that exercises/README.md lists each one (`python tests/test_exercise_mutants.py` prints
the table).
"""

from __future__ import annotations

import functools
import types

import pytest

import exercises
from engine import sampling
from test_exercise_mutants import Mutant, mutated_module

CHAPTER = "ch13"
EDGE = "transitions.get(state, {}).get(char)"
END = "return end is not None and end in accepting"
WALK = "text != \"\" and dfa_step(transitions, state, text) is not None"
EOS = "allowed.append(state in accepting)"
FILL = "logits.masked_fill(~mask, float(\"-inf\"))"
LENGTH_CHECK = ("    if mask.shape != logits.shape[-1:]:\n"
                "        raise ValueError(f\"allowed must hold one bool per token (V = {logits.shape[-1]}), got \"\n"
                "                         f\"{len(allowed)}\")\n")
ALL_FALSE_CHECK = ("    if not mask.any():\n"
                   "        raise ValueError(\"allowed is all False: no token may come next, and softmax "
                   "of all -inf \"\n"
                   "                         \"is nan; the grammar is stuck (a bug in the grammar or the vocab)\")\n")
RENORMALIZE = "return kept / kept.sum(dim=-1, keepdim=True)"
SOFTMAX = "torch.softmax(logits / temperature, dim=-1)"
TEMPERATURE_CHECK = ("    if not temperature > 0:\n"
                     "        raise ValueError(f\"temperature={temperature!r} must be > 0 (0 means greedy: "
                     "an argmax, \"\n"
                     "                         \"no distribution)\")\n")
ADD = "out[token] += value"
BIAS_BODY = ("    out = logits.clone()\n"
             "    for token, value in bias.items():\n"
             "        out[token] += value  # a logit + b multiplies the token's odds by e^b\n"
             "    return out\n")
# re.match instead of re.fullmatch: a text matches as soon as it passes an accepting state
MATCHES_ON_THE_WAY = ("    state = START\n"
                      "    for char in text:\n"
                      "        if state in accepting:\n"
                      "            return True\n"
                      "        state = transitions.get(state, {}).get(char)\n"
                      "        if state is None:\n"
                      "            return False\n"
                      "    return state in accepting\n")


def _m(function, mistake, old, new, caught_by):
    return Mutant(CHAPTER, function, mistake, old, new, caught_by)


MUTANTS = [
    # ---- walking a DFA --------------------------------------------------------------------------------------
    _m("dfa_step", "reads only the first character", "for char in text:", "for char in text[:1]:",
       "dfa_step_follows_every_character"),
    _m("dfa_step", "a missing edge raises KeyError (transitions[state][char])", EDGE, "transitions[state][char]",
       "dfa_step_falls_off_to_none"),
    _m("dfa_step", "a state with no row raises KeyError", EDGE, "transitions[state].get(char)",
       "dfa_step_falls_off_a_state_with_no_row"),
    _m("dfa_step", "skips a character it has no edge for", EDGE, "transitions.get(state, {}).get(char, state)",
       "dfa_step_falls_off_to_none"),
    _m("dfa_step", "returns the last state before falling off", "return None  # fell off",
       "return state  # fell off", "dfa_step_falls_off_to_none"),
    _m("accepts", "a prefix is enough (forgets the accepting states)", END, "return end is not None",
       "accepts_needs_the_whole_text_to_match"),
    _m("accepts", "the empty text never matches", "    end = dfa_step(",
       "    if not text:\n        return False\n    end = dfa_step(",
       "accepts_the_empty_text_when_the_start_state_accepts"),
    _m("accepts", "matches once it passes an accepting state (re.match, not re.fullmatch)",
       f"    end = dfa_step(transitions, START, text)\n    {END}\n", MATCHES_ON_THE_WAY,
       "accepts_needs_the_whole_text_to_match"),
    # ---- the tokens one state allows ------------------------------------------------------------------------
    _m("token_mask", "checks only a token's first character", "dfa_step(transitions, state, text) is not None",
       "dfa_step(transitions, state, text[:1]) is not None", "token_mask_reads_every_character_of_a_token"),
    _m("token_mask", "allows only tokens that end in an accepting state",
       "dfa_step(transitions, state, text) is not None", "dfa_step(transitions, state, text) in accepting",
       "token_mask_reads_every_character_of_a_token"),
    _m("token_mask", "forgets EOS in accepting states", EOS, "allowed.append(False)",
       "token_mask_allows_eos_exactly_in_accepting_states"),
    _m("token_mask", "allows EOS everywhere", EOS, "allowed.append(True)",
       "token_mask_allows_eos_exactly_in_accepting_states"),
    _m("token_mask", "reads EOS's text like any token's", "if token_id == eos_id:", "if False:",
       "token_mask_allows_eos_exactly_in_accepting_states"),
    _m("token_mask", "allows the empty token", WALK, "dfa_step(transitions, state, text) is not None",
       "token_mask_never_allows_the_empty_token"),
    # ---- masking the logits ---------------------------------------------------------------------------------
    _m("constrain", "sets the disallowed logits to 0 instead of -inf", FILL, "logits.masked_fill(~mask, 0.0)",
       "constrain_gives_a_disallowed_token_probability_0_at_any_temperature"),
    _m("constrain", "multiplies the logits by the mask (0, not -inf)", FILL, "logits * mask",
       "constrain_puts_minus_inf_on_every_disallowed_token"),
    _m("constrain", "masks the allowed tokens (the mask upside down)", FILL,
       "logits.masked_fill(mask, float(\"-inf\"))", "constrain_puts_minus_inf_on_every_disallowed_token"),
    _m("constrain", "masks in place", FILL, "logits.masked_fill_(~mask, float(\"-inf\"))",
       "constrain_leaves_the_callers_logits_alone"),
    _m("constrain", "indexes the batch axis with the mask", f"    return {FILL}",
       "    out = logits.clone()\n    out[~mask] = float(\"-inf\")\n    return out",
       "constrain_masks_every_row_of_a_batch"),
    _m("constrain", "no check of the mask's length (one bool broadcasts)", LENGTH_CHECK, "",
       "constrain_refuses_a_mask_of_the_wrong_length_or_all_false"),
    _m("constrain", "no check of an all-False mask (nan after softmax)", ALL_FALSE_CHECK, "",
       "constrain_refuses_a_mask_of_the_wrong_length_or_all_false"),
    _m("apply_temperature_then_mask", "no renormalization (probabilities multiplied by 0, left so)", RENORMALIZE,
       "return kept", "apply_temperature_then_mask_renormalizes_what_is_left"),
    _m("apply_temperature_then_mask", "divides by the old total (1), not the mass left", RENORMALIZE,
       "return kept / probs.sum(dim=-1, keepdim=True)", "apply_temperature_then_mask_renormalizes_what_is_left"),
    _m("apply_temperature_then_mask", "spreads the removed mass evenly over the allowed tokens", RENORMALIZE,
       "return kept + (1 - kept.sum(dim=-1, keepdim=True)) * mask / mask.sum()",
       "apply_temperature_then_mask_renormalizes_what_is_left"),
    _m("apply_temperature_then_mask", "divides the probabilities by t (renormalizing undoes it)", SOFTMAX,
       "torch.softmax(logits, dim=-1) / temperature", "apply_temperature_then_mask_equals_masking_first"),
    _m("apply_temperature_then_mask", "multiplies by the temperature", SOFTMAX,
       "torch.softmax(logits * temperature, dim=-1)", "apply_temperature_then_mask_equals_masking_first"),
    _m("apply_temperature_then_mask", "no check of the temperature", TEMPERATURE_CHECK, "",
       "apply_temperature_then_mask_refuses_a_temperature_that_is_not_positive"),
    # ---- OpenAI's logit_bias --------------------------------------------------------------------------------
    _m("logit_bias", "multiplies the logit by the bias", ADD, "out[token] *= value",
       "logit_bias_of_minus_100_bans_and_plus_100_forces"),
    _m("logit_bias", "replaces the logit by the bias", ADD, "out[token] = value",
       "logit_bias_adds_the_bias_to_the_logit"),
    _m("logit_bias", "adds the bias to the probability", BIAS_BODY,
       "    out = torch.softmax(logits, dim=-1)\n    for token, value in bias.items():\n"
       "        out[token] += value\n    return out.log()\n", "logit_bias_adds_the_bias_to_the_logit"),
    _m("logit_bias", "changes the caller's logits in place", "out = logits.clone()", "out = logits",
       "logit_bias_leaves_the_callers_logits_alone"),
    _m("logit_bias", "turns +-100 into +-inf (a hard ban)", ADD,
       "out[token] += float(\"inf\") if value >= 100 else float(\"-inf\") if value <= -100 else value",
       "logit_bias_is_a_number_not_a_ban"),
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_the_named_check_fails_on_the_mutant(mutant):
    checks = dict(exercises.load_checks(CHAPTER))
    assert mutant.caught_by in checks, f"{mutant.id}: no check named {mutant.caught_by!r}"
    module = mutated_module(mutant)
    with pytest.raises(Exception):  # noqa: B017 - any failure of the check counts as catching the mutant
        checks[mutant.caught_by](module)


def test_every_check_fails_on_some_mutant():
    """No check is there for show: each one fails on at least one of the mistakes above."""
    caught = _caught()
    assert [name for name, _ in exercises.load_checks(CHAPTER) if not caught.get(name)] == []


def test_the_engine_logit_bias_passes_the_ch13_logit_bias_checks_under_the_exercise_name():
    """A third oracle: engine/sampling.py's apply_logit_bias passes every logit_bias check."""
    engine = types.SimpleNamespace(logit_bias=sampling.apply_logit_bias)
    results = [r for r in exercises.run_checks(CHAPTER, module=engine) if r.name.startswith("logit_bias")]
    assert len(results) == 5 and [(r.name, r.reason) for r in results if not r.passed] == []


@functools.cache
def _caught() -> dict[str, tuple[str, ...]]:
    """Per check, every mutant that fails it, as the README labels it (the one it is named for in bold)."""
    caught: dict[str, list[str]] = {}
    for m in MUTANTS:
        for r in exercises.run_checks(CHAPTER, module=mutated_module(m)):
            if not r.passed:
                label = f"`{m.function}`: {m.mistake}"
                caught.setdefault(r.name, []).append(f"**{label}**" if r.name == m.caught_by else label)
    return {name: tuple(labels) for name, labels in caught.items()}

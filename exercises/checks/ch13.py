r"""Checks for chapter 13: walking a DFA, the token mask of one state, masking the logits (the
-inf way and the probability way), and OpenAI's logit_bias.

Each `check_<claim>(mod)` runs against the student's `exercises/ch13_structured.py` or the
reference in `exercises/solutions/`. The oracles are DFAs and masks worked by hand in the comments,
Python's `re.fullmatch` (which strings a pattern matches), and the engine itself: the regex -> DFA
-> token table reference in engine/structured/regex_dfa.py (the same masks over bytes), and
`apply_logit_bias`, `processed_logits` and `sampling_probs` in engine/sampling.py (the order the
engine applies them in: penalties, logit bias, the processors, the grammar's mask, min_tokens).
"""

from __future__ import annotations

import math
import random
import re

import torch

from engine import sampling as engine
from engine.structured.regex_dfa import DEAD, TokenTable, compile_regex
from exercises.checks import raises_naming

SEED = 13  # chapter 13: any fixed seed makes every random check the same on every run
DIGITS = "0123456789"
ATOL = 1e-6  # float32 softmax over a dozen logits: room for a different, correct order of ops
TEMPERATURES = (0.3, 0.7, 1.0, 1.5, 4.0)
BAN_BELOW = 1e-20  # a -100 bias leaves a probability near e^-100 ~ 4e-44: "banned"
FORCE_ABOVE = 1 - 1e-6  # a +100 bias leaves every other token near e^-100 of it: "forced"
MAX_BIAS = 100.0  # OpenAI's logit_bias runs from -100 to 100

# ---- the DFAs of the worked examples -------------------------------------------------------------


def _digits_to(state: int) -> dict[str, int]:
    return dict.fromkeys(DIGITS, state)


# r"\d+(\.\d+)?":  (0) -digit-> ((1)) -"."-> (2) -digit-> ((3)), digits loop on 1 and on 3
NUMBER = {0: _digits_to(1), 1: {**_digits_to(1), ".": 2}, 2: _digits_to(3), 3: _digits_to(3)}
NUMBER_ACCEPTING = {1, 3}
# r"ab": state 2 has no way on, so it has no row at all
AB, AB_ACCEPTING = {0: {"a": 1}, 1: {"b": 2}}, {2}
# r"(ab)*": the start state accepts (the empty text matches)
AB_STAR, AB_STAR_ACCEPTING = {0: {"a": 1}, 1: {"b": 0}}, {0}

# The hand-made vocabulary of the token-mask checks; EOS is not token 0 on purpose.
EOS_ID = 2
VOCAB = ["7", "12", "<eos>", "2.5", "1a", ".", ".5", "2.", "", "a", "345", "5.5.5"]
# Which of VOCAB may come next in each state of NUMBER, worked by hand (EOS: only in 1 and 3):
#   "7" "12" "345": digits, fine in every state.  "2.5": 0 -2-> 1 -.-> 2 -5-> 3, and from 1 too,
#   but from 2 or 3 the "." has no edge.  "2.": ends in state 2, not accepting, still allowed
#   (".5" can follow).  "." ".5": only from 1.  "1a" "a": "a" has no edge anywhere.
#   "5.5.5": the second "." has no edge.  "": never (it makes no progress).
NUMBER_MASKS = {  # state -> the allowed token texts
    0: {"7", "12", "2.5", "2.", "345"},
    1: {"7", "12", "<eos>", "2.5", ".", ".5", "2.", "345"},
    2: {"7", "12", "345"},
    3: {"7", "12", "<eos>", "345"},
}

# ASCII patterns for the checks against Python's re and the engine's token table
PATTERNS = [r"\d+(\.\d+)?", r"(yes|no|maybe)", r"[a-c]+( [a-c]+)*", r"\d{3}-\d{4}", r"(ab)*",
            r'\{"n": \d{1,2}\}', r"x?y?z?", r"-?(0|[1-9]\d*)"]
ALPHABET = "0123456789.- abcmnoxyz{}\":es"  # every pattern's characters, and a few others
RANDOM_STRINGS = 150  # per pattern
RANDOM_TOKENS = 60  # multi-character tokens in the random vocabulary
WALKS, WALK_STEPS = 25, 16  # constrained generations per pattern, tokens per generation
EOS_CHANCE = 0.3  # when EOS is allowed, a walk ends with this chance


# ---- helpers (no `check_` prefix, so they are not checks) ----------------------------------------


def _as_dicts(pattern: str) -> tuple[dict[int, dict[str, int]], set[int], object]:
    """The engine's byte DFA of an ASCII pattern in this chapter's form: state -> {char: state}
    (a state with no way on left out), the accepting set, and the DFA itself."""
    dfa = compile_regex(pattern)
    assert dfa.start == 0, f"the engine's DFA for {pattern!r} starts in {dfa.start}, not 0"
    transitions = {}
    for state, row in enumerate(dfa.transitions):
        edges = {chr(b): t for b, t in enumerate(row) if t != DEAD and b < 128}  # ASCII only
        if edges:
            transitions[state] = edges
    return transitions, {s for s, ok in enumerate(dfa.accepting) if ok}, dfa


def _random_vocab(rng: random.Random) -> tuple[list[str], int]:
    """Every character of ALPHABET, random strings of 2-4 of them, "", and an EOS somewhere."""
    vocab = list(ALPHABET) + ["".join(rng.choices(ALPHABET, k=rng.randint(2, 4)))
                              for _ in range(RANDOM_TOKENS)] + [""]
    eos_id = rng.randrange(len(vocab) + 1)
    vocab.insert(eos_id, "</s>")
    return vocab, eos_id


def _mask(mod, transitions, accepting, state, vocab, eos_id) -> list[bool]:
    got = mod.token_mask(transitions, accepting, state, list(vocab), eos_id)
    call = f"token_mask(..., state={state}, vocab of {len(vocab)}, eos_id={eos_id})"
    got = list(got)
    assert len(got) == len(vocab), f"{call} returned {len(got)} values, expected one per token"
    return [bool(x) for x in got]


def _texts(mask: list[bool], vocab: list[str]) -> set[str]:
    return {text for text, ok in zip(vocab, mask, strict=True) if ok}


def _call(fn, logits: torch.Tensor, *args, call: str) -> torch.Tensor:
    """Call a function of logits and check it left them alone and kept their shape."""
    before = logits.clone()
    out = fn(logits, *args)
    assert torch.equal(logits, before), f"{call} changed its input in place: return a new tensor"
    assert isinstance(out, torch.Tensor), f"{call} returned {type(out).__name__}, not a tensor"
    assert out.shape == logits.shape, (
        f"{call} returned shape {tuple(out.shape)}, expected {tuple(logits.shape)}")
    return out


def _random_logits(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3.0


def _random_allowed(rng: random.Random, vocab: int) -> list[bool]:
    allowed = [rng.random() < 0.5 for _ in range(vocab)]
    allowed[rng.randrange(vocab)] = True  # at least one token may come next
    return allowed


def _minus_inf(logits: torch.Tensor, allowed: list[bool]) -> torch.Tensor:
    """The check's own mask, the way the engine masks: -inf on every disallowed token."""
    return logits.masked_fill(~torch.tensor(allowed), float("-inf"))


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


# ---- part 1: walking a DFA -----------------------------------------------------------------------


def _step_case(mod, transitions, state, text, want, why: str) -> None:
    got = mod.dfa_step(transitions, state, text)
    assert got == want and (got is None) == (want is None), (
        f"dfa_step(<{why}>, state={state}, text={text!r}) = {got!r}, expected {want!r}")


def check_dfa_step_follows_every_character(mod) -> None:
    dfa = r"\d+(\.\d+)?"
    _step_case(mod, NUMBER, 0, "12.5", 3, dfa)  # 0 -1-> 1 -2-> 1 -.-> 2 -5-> 3
    _step_case(mod, NUMBER, 0, "12", 1, dfa)
    _step_case(mod, NUMBER, 1, ".", 2, dfa)
    _step_case(mod, NUMBER, 2, "50", 3, dfa)
    _step_case(mod, NUMBER, 0, "", 0, f"{dfa}, the empty text reads nothing: the same state")


def check_dfa_step_falls_off_to_none(mod) -> None:
    why = r"\d+(\.\d+)?: a character with no edge ends the walk, whatever comes after"
    for state, text in ((0, "1a"), (0, "."), (0, "1..2"), (0, "a1"), (3, "."), (2, "5.")):
        _step_case(mod, NUMBER, state, text, None, why)


def check_dfa_step_falls_off_a_state_with_no_row(mod) -> None:
    why = "ab: state 2 has no way on, so transitions has no row for it"
    _step_case(mod, AB, 0, "ab", 2, why)
    _step_case(mod, AB, 2, "c", None, why)
    _step_case(mod, AB, 0, "abc", None, why)
    _step_case(mod, AB, 2, "", 2, why)


def _accepts_case(mod, transitions, accepting, text, want, why: str) -> None:
    got = mod.accepts(transitions, set(accepting), text)
    assert isinstance(got, bool), f"accepts(...) must return a bool, got {type(got).__name__}"
    assert got == want, f"accepts(<{why}>, text={text!r}) = {got}, expected {want}"


def check_accepts_needs_the_whole_text_to_match(mod) -> None:
    why = r"\d+(\.\d+)?"
    for text, want in (("12", True), ("2.5", True), ("0.25", True), ("12.", False),
                       ("1a", False), ("", False), ("0.0.0", False), (".5", False)):
        _accepts_case(mod, NUMBER, NUMBER_ACCEPTING, text, want,
                      f"{why}: a match needs the whole text, ending in an accepting state; "
                      "passing one on the way (1a) or stopping short of one (12.) is not enough")


def check_accepts_the_empty_text_when_the_start_state_accepts(mod) -> None:
    why = "(ab)*: the start state 0 accepts, so the empty text is a match"
    for text, want in (("", True), ("ab", True), ("abab", True), ("a", False), ("aba", False)):
        _accepts_case(mod, AB_STAR, AB_STAR_ACCEPTING, text, want, why)


def check_accepts_agrees_with_python_re_on_random_strings(mod) -> None:
    rng = random.Random(SEED)
    for pattern in PATTERNS:
        transitions, accepting, _ = _as_dicts(pattern)
        for _ in range(RANDOM_STRINGS):
            if rng.random() < 0.5:  # a piece of a likely match, so that True answers come up too
                text = rng.choice(["12", "3.25", "yes", "no", "ab", "abab", "a b", "555-1234",
                                   '{"n": 7}', "xz", "-10", "0"])[:rng.randint(0, 8)]
            else:
                text = "".join(rng.choices(ALPHABET, k=rng.randint(0, 6)))
            want = re.fullmatch(pattern, text, re.ASCII) is not None
            _accepts_case(mod, transitions, accepting, text, want,
                          f"the engine's DFA of {pattern!r}; Python's re.fullmatch says {want}")


# ---- part 2: the tokens one state allows ---------------------------------------------------------


def _number_mask_case(mod, state: int, why: str) -> None:
    got = _texts(_mask(mod, NUMBER, set(NUMBER_ACCEPTING), state, VOCAB, EOS_ID), VOCAB)
    want = NUMBER_MASKS[state]
    wrong = {"allowed but cannot be read": sorted(got - want), "forbidden but fine":
             sorted(want - got)}
    assert got == want, (
        f"token_mask(NUMBER, {{1, 3}}, state={state}, {VOCAB}, eos_id={EOS_ID}) allows "
        f"{sorted(got)}, expected {sorted(want)}: {wrong}; {why}")


def check_token_mask_reads_every_character_of_a_token(mod) -> None:
    why = ("a token is allowed when ALL its characters can be read ('1a': the 'a' has no edge; "
           "'2.' ends in state 2, not accepting, and is allowed: '5' can follow)")
    _number_mask_case(mod, 0, why)
    _number_mask_case(mod, 2, why)


def check_token_mask_allows_eos_exactly_in_accepting_states(mod) -> None:
    for state in range(4):
        got = _mask(mod, NUMBER, set(NUMBER_ACCEPTING), state, VOCAB, EOS_ID)[EOS_ID]
        want = state in NUMBER_ACCEPTING
        assert got == want, (
            f"token_mask(NUMBER, {{1, 3}}, state={state}, ...)[eos_id] is {got}: EOS ends the "
            f"output, so it is allowed exactly where the text so far matches (state {state} is "
            f"{'' if want else 'not '}accepting)")
    ab = _mask(mod, AB, set(AB_ACCEPTING), 2, ["a", "b", "<eos>"], 2)
    assert ab == [False, False, True], (
        f"token_mask(AB, {{2}}, state=2, ['a', 'b', '<eos>'], eos_id=2) = {ab}: after 'ab' "
        "nothing may follow but EOS, or the output could never end")


def check_token_mask_never_allows_the_empty_token(mod) -> None:
    for transitions, accepting, states in ((NUMBER, NUMBER_ACCEPTING, range(4)),
                                           (AB_STAR, AB_STAR_ACCEPTING, range(2))):
        for state in states:
            got = _mask(mod, transitions, set(accepting), state, VOCAB, EOS_ID)[VOCAB.index("")]
            assert not got, (
                f"token_mask(..., state={state}, ...) allows the empty token '': it reads "
                "nothing, so it is allowed everywhere and a sampler could pick it forever")
    _number_mask_case(mod, 1, "state 1 accepts: EOS, '.', '.5' are allowed too")
    _number_mask_case(mod, 3, "state 3 accepts: EOS and digits only")


def check_token_mask_matches_the_engine_token_table(mod) -> None:
    rng = random.Random(SEED + 1)
    for pattern in PATTERNS:
        transitions, accepting, dfa = _as_dicts(pattern)
        vocab, eos_id = _random_vocab(rng)
        pieces = [None if i == eos_id else text.encode() for i, text in enumerate(vocab)]
        table = TokenTable.build(dfa, pieces, [eos_id])
        for state in range(dfa.num_states):
            got = _texts(_mask(mod, transitions, accepting, state, vocab, eos_id), vocab)
            want = _texts(table.mask(state).tolist(), vocab)
            assert got == want, (
                f"token_mask(<the DFA of {pattern!r}>, state={state}, ...) differs from the "
                f"engine's TokenTable.mask: allows {sorted(got - want)} it forbids, forbids "
                f"{sorted(want - got)} it allows")


def check_constrained_generation_only_writes_text_the_regex_matches(mod) -> None:
    rng = random.Random(SEED + 2)
    for pattern in PATTERNS:
        transitions, accepting, dfa = _as_dicts(pattern)
        vocab, eos_id = _random_vocab(rng)
        for _ in range(WALKS):
            state, text = 0, ""
            for _step in range(WALK_STEPS):
                mask = _mask(mod, transitions, accepting, state, vocab, eos_id)
                ids = [i for i, ok in enumerate(mask) if ok]
                assert ids, (f"after {text!r} (state {state} of {pattern!r}) token_mask allows "
                             "no token at all, not even EOS: the output could never end")
                if mask[eos_id] and rng.random() < EOS_CHANCE:
                    ids = [eos_id]
                token = rng.choice(ids)
                if token == eos_id:
                    assert re.fullmatch(pattern, text, re.ASCII), (
                        f"token_mask allowed EOS after {text!r}, which {pattern!r} does not "
                        "match: the output ended outside the pattern")
                    break
                state = dfa.walk(state, vocab[token].encode())
                assert state != DEAD, (
                    f"token_mask allowed {vocab[token]!r} after {text!r}, but {pattern!r} "
                    f"cannot continue with it: {text + vocab[token]!r} can never match")
                text += vocab[token]


# ---- part 3: masking the logits ------------------------------------------------------------------

ALLOWED = [True, False, True, False, False, True]  # tokens 0, 2, 5 may come next
HAND_LOGITS = [1.0, 3.0, -2.0, 0.5, -1.0, 0.0]  # token 1 is the model's favourite: forbidden


def check_constrain_puts_minus_inf_on_every_disallowed_token(mod) -> None:
    logits = torch.tensor(HAND_LOGITS)
    got = _call(mod.constrain, logits, list(ALLOWED), call=f"constrain({HAND_LOGITS}, {ALLOWED})")
    want = _minus_inf(logits, ALLOWED)
    assert torch.equal(got, want), (
        f"constrain({HAND_LOGITS}, {ALLOWED}) = {got.tolist()}, expected {want.tolist()}: -inf "
        "on the disallowed tokens (1, 3, 4), the allowed ones as they were")


def check_constrain_gives_a_disallowed_token_probability_0_at_any_temperature(mod) -> None:
    # The claim of the chapter: with -inf, masking before or after temperature is the same
    # (-inf / t = -inf), and softmax gives the disallowed exactly 0 either way.
    rng = random.Random(SEED + 3)
    for seed in range(3):
        logits = _random_logits(seed, (12,))
        allowed = _random_allowed(rng, 12)
        for t in TEMPERATURES:
            before = _probs(_call(mod.constrain, logits / t, allowed, call="constrain(logits/t)"))
            after = _probs(_call(mod.constrain, logits, allowed, call="constrain(logits)") / t)
            leaked = float(before[~torch.tensor(allowed)].sum())
            assert leaked == 0.0, (
                f"softmax(constrain(logits / {t}, allowed)) gives the disallowed tokens "
                f"probability {leaked:.3g} in all: a masked logit must be -inf, not a number "
                "softmax can still turn into a chance (a logit of 0 is not small)")
            worst = float((before - after).abs().max())
            assert worst <= ATOL, (
                f"masking before temperature {t} and after it give distributions that differ by "
                f"{worst:.2e}: with -inf they are the same")


def check_constrain_masks_every_row_of_a_batch(mod) -> None:
    logits = _random_logits(SEED, (3, len(ALLOWED)))  # [B, V]
    got = _call(mod.constrain, logits, list(ALLOWED), call="constrain(logits [3, 6], allowed)")
    assert torch.equal(got, _minus_inf(logits, ALLOWED)), (
        f"constrain on a batch [3, 6] with allowed {ALLOWED} gave {got.tolist()}: the one mask "
        "[V] applies to the last axis of every row")


def check_constrain_leaves_the_callers_logits_alone(mod) -> None:
    logits = torch.tensor(HAND_LOGITS)
    mod.constrain(logits, list(ALLOWED))
    assert logits.tolist() == HAND_LOGITS, (
        f"constrain changed the caller's logits to {logits.tolist()}: return a new tensor (the "
        "caller may need the unmasked logits, for logprobs say)")


def check_constrain_refuses_a_mask_of_the_wrong_length_or_all_false(mod) -> None:
    logits = torch.tensor(HAND_LOGITS)
    for allowed, why in ((ALLOWED[:-1], "5 bools for 6 tokens"), ([True], "1 bool for 6 tokens"),
                         ([False] * 6, "all False: nothing to sample, softmax would give nan")):
        raises_naming("allowed", lambda a=allowed: mod.constrain(logits, list(a)),
                      f"constrain(logits [6], allowed={allowed}) ({why})")


def check_apply_temperature_then_mask_renormalizes_what_is_left(mod) -> None:
    # softmax gives 0.4 0.3 0.2 0.1; keep tokens 0 and 2: 0.4 and 0.2 are left, summing to 0.6,
    # and renormalized they are 2/3 and 1/3. Multiplying by 0 alone leaves [0.4, 0, 0.2, 0].
    logits, allowed = torch.tensor([0.4, 0.3, 0.2, 0.1]).log(), [True, False, True, False]
    got = _call(mod.apply_temperature_then_mask, logits, allowed, 1.0,
                call="apply_temperature_then_mask(log [0.4, 0.3, 0.2, 0.1], [T, F, T, F], 1.0)")
    want = torch.tensor([2 / 3, 0.0, 1 / 3, 0.0])
    assert torch.allclose(got.double(), want.double(), atol=ATOL), (
        f"apply_temperature_then_mask(log [0.4, 0.3, 0.2, 0.1], [T, F, T, F], 1.0) = "
        f"{got.tolist()}, expected [2/3, 0, 1/3, 0]: probabilities multiplied by 0 leave the "
        "rest summing to 0.6, so divide by what is left; the allowed keep their ratio 2 : 1")


def check_apply_temperature_then_mask_equals_masking_first(mod) -> None:
    # masking first is the engine's way: processed_logits masks, sampling_probs divides by t
    rng = random.Random(SEED + 4)
    for seed in range(4):
        logits = _random_logits(seed, (12,))
        allowed = _random_allowed(rng, 12)
        for t in TEMPERATURES:
            got = _call(mod.apply_temperature_then_mask, logits, allowed, t,
                        call=f"apply_temperature_then_mask(logits, allowed, {t})")
            want = engine.sampling_probs(_minus_inf(logits, allowed),
                                         engine.SamplingParams(temperature=t))
            worst = float((got.double() - want.double()).abs().max())
            assert worst <= ATOL, (
                f"apply_temperature_then_mask(logits, allowed, temperature={t}) differs from "
                f"softmax(masked logits / {t}), the engine's order, by up to {worst:.2e}: got "
                f"{[round(x, 4) for x in got.tolist()]}, expected "
                f"{[round(x, 4) for x in want.tolist()]}")


def check_apply_temperature_then_mask_refuses_a_temperature_that_is_not_positive(mod) -> None:
    logits = torch.tensor(HAND_LOGITS)
    for t in (0.0, -1.0, math.nan):
        raises_naming("temperature",
                      lambda t=t: mod.apply_temperature_then_mask(logits, list(ALLOWED), t),
                      f"apply_temperature_then_mask(logits, allowed, temperature={t})")


# ---- part 4: OpenAI's logit_bias -----------------------------------------------------------------


def check_logit_bias_adds_the_bias_to_the_logit(mod) -> None:
    logits = [1.0, 2.0, 3.0, -1.0]
    for bias, want in (({0: 1.5, 3: -2.0}, [2.5, 2.0, 3.0, -3.0]), ({}, logits),
                       ({2: 0.0}, logits), ({1: -0.5}, [1.0, 1.5, 3.0, -1.0])):
        got = _call(mod.logit_bias, torch.tensor(logits), dict(bias),
                    call=f"logit_bias({logits}, {bias})")
        assert torch.allclose(got, torch.tensor(want)), (
            f"logit_bias({logits}, {bias}) = {got.tolist()}, expected {want}: the bias is added "
            "to the logit (so the token's odds are multiplied by e^bias); the others stay")


def check_logit_bias_of_minus_100_bans_and_plus_100_forces(mod) -> None:
    logits = _random_logits(SEED, (11,))
    order = torch.argsort(logits).tolist()  # the least likely first
    lowest, low, highest = order[0], order[1], order[-1]  # the two lowest logits are negative
    for token, bias, what in ((lowest, MAX_BIAS, "forces"), (highest, -MAX_BIAS, "bans"),
                              (low, -MAX_BIAS, "bans")):
        probs = _probs(_call(mod.logit_bias, logits, {token: bias},
                             call=f"logit_bias(logits, {{{token}: {bias}}})"))
        p = float(probs[token])
        ok = p > FORCE_ABOVE if bias > 0 else p < BAN_BELOW
        assert ok, (
            f"logit_bias(logits, {{{token}: {bias}}}) gives token {token} (logit "
            f"{float(logits[token]):.2f}) probability {p:.3g}: a bias of {bias} {what} it, "
            "whatever its logit's sign (added, not multiplied)")


def check_logit_bias_is_a_number_not_a_ban(mod) -> None:
    # +100 on two tokens: they still compete by their own logits (2 - 1: odds e : 1). -100 on
    # every token: the same distribution as before (softmax does not change when all move alike).
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    both = _probs(_call(mod.logit_bias, logits, {0: MAX_BIAS, 1: MAX_BIAS},
                        call="logit_bias([2, 1, 0.5, -1], {0: 100, 1: 100})"))
    assert torch.isfinite(both).all() and abs(float(both[0] / both[1]) - math.e) < 1e-6, (
        f"logit_bias([2, 1, 0.5, -1], {{0: 100, 1: 100}}) then softmax gives {both.tolist()}: "
        "tokens 0 and 1 should still compete by their own logits (odds e : 1); a bias is a "
        "number added, +100 is not +inf")
    every = _probs(_call(mod.logit_bias, logits, dict.fromkeys(range(4), -MAX_BIAS),
                         call="logit_bias(logits, every token: -100)"))
    assert torch.allclose(every, _probs(logits)), (
        f"logit_bias with -100 on every token then softmax gives {every.tolist()}, expected the "
        f"unbiased {_probs(logits).tolist()}: moving every logit alike changes nothing")


def check_logit_bias_leaves_the_callers_logits_alone(mod) -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    mod.logit_bias(logits, {0: 5.0, 2: -MAX_BIAS})
    assert logits.tolist() == [1.0, 2.0, 3.0], (
        f"logit_bias changed the caller's logits to {logits.tolist()}: return a new tensor (the "
        "next request, or logprobs, may read the same row)")


def check_logit_bias_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 5)
    for seed in range(20):
        logits = _random_logits(seed, (16,))
        tokens = rng.sample(range(16), rng.randint(0, 6))
        bias = {t: rng.uniform(-MAX_BIAS, MAX_BIAS) for t in tokens}
        got = _call(mod.logit_bias, logits, dict(bias), call=f"logit_bias(logits, {bias})")
        want = engine.apply_logit_bias(logits, bias)
        assert torch.allclose(got, want, atol=1e-5), (
            f"logit_bias(logits, {bias}) = {got.tolist()}, the engine's apply_logit_bias gives "
            f"{want.tolist()}")


def check_a_grammar_mask_wins_over_a_plus_100_bias_in_the_engines_order(mod) -> None:
    # The engine biases first, then masks (processed_logits): a +100 on a token the grammar
    # forbids is overruled, a +100 on an allowed one all but forces it.
    logits = torch.tensor(HAND_LOGITS)
    params = engine.SamplingParams(logit_bias={3: MAX_BIAS, 5: MAX_BIAS},
                                   logits_processors=[lambda _ids, row: _minus_inf(row, ALLOWED)])
    want = _probs(engine.processed_logits(logits, engine.SamplingState(params), []))
    got = _probs(mod.constrain(mod.logit_bias(logits, {3: MAX_BIAS, 5: MAX_BIAS}), ALLOWED))
    assert float(got[3]) == 0.0 and float(got[5]) > FORCE_ABOVE, (
        f"constrain(logit_bias(logits, {{3: 100, 5: 100}}), {ALLOWED}) gives probabilities "
        f"{[round(p, 4) for p in got.tolist()]}: token 3 is forbidden, so 0 whatever its bias; "
        "token 5 is allowed and +100 all but forces it")
    assert torch.allclose(got, want, atol=ATOL), (
        f"bias then mask gives {got.tolist()}, the engine's processed_logits {want.tolist()}")

"""Chapter 12's mutants: the classic mistakes of speculative decoding, each patched into the reference
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
from engine.speculative import rejection
from test_exercise_mutants import Mutant, mutated_module

CHAPTER = "ch12"
ACCEPT = "return u * q_guess < p_guess"
CLAMP = "torch.clamp(p - q, min=0.0)"
NO_RESIDUAL_CHECK = ('    if total <= 0:\n'
                     '        raise ValueError("p and q: max(0, p - q) is all zero (p == q?), so no guess is ever "\n'
                     '                         "rejected and there is no residual to draw from")\n')
APPEND_THEN_RETURN = ("        emitted.append(target)  # the target's own token: the guess itself when they agree\n"
                      "        if guess != target:\n"
                      "            return emitted  # the first disagreement ends the step\n")
RETURN_THEN_APPEND = ("        if guess != target:\n"
                      "            return emitted  # the first disagreement ends the step\n"
                      "        emitted.append(target)\n")
LENGTH_CHECK = ("    if len(target_argmax) != len(guesses) + 1:\n"
                "        raise ValueError(f\"target_argmax must hold k + 1 = {len(guesses) + 1} tokens (one per \"\n"
                "                         f\"row of the verify step) for {len(guesses)} guesses, got \"\n"
                "                         f\"{len(target_argmax)}\")\n")
FORMULA = "return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)"
RATE = "expected_tokens_per_step(alpha, k) / cost_of_k[k]"
KEEP = "(num_tokens - n + block_size - 1) // block_size"
LET_GO = ("        refcounts[block] -= 1  # our table lets go of it\n"
          "        if refcounts[block] == 0:  # nobody else holds it: back to the free list\n")
N_CHECK = ("    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= num_tokens:\n"
           "        raise ValueError(f\"n must be an integer in 0..{num_tokens} (the tokens the sequence \"\n"
           "                         f\"holds), got {n!r}\")\n")


def _m(function, mistake, old, new, caught_by):
    return Mutant(CHAPTER, function, mistake, old, new, caught_by)


MUTANTS = [
    # ---- the rejection rule ---------------------------------------------------------------------------------
    _m("accept_guess", "accepts when p > q (no random draw)", ACCEPT, "return p_guess > q_guess",
       "accept_guess_keeps_with_probability_min_1_p_over_q"),
    _m("accept_guess", "accepts when p >= q (no random draw)", ACCEPT, "return p_guess >= q_guess",
       "speculative_sampling_draws_exactly_the_target_distribution"),
    _m("accept_guess", "keeps with probability 1 - p/q (u > p/q)", ACCEPT, "return u * q_guess > p_guess",
       "accept_guess_keeps_with_probability_min_1_p_over_q"),
    _m("accept_guess", "the ratio upside down (u < q/p)", ACCEPT, "return u * p_guess < q_guess",
       "accept_guess_keeps_with_probability_min_1_p_over_q"),
    _m("accept_guess", "keeps a token the target rules out at u = 0 (<= instead of <)", ACCEPT,
       "return u * q_guess <= p_guess", "accept_guess_never_keeps_a_token_the_target_rules_out"),
    # ---- the residual ---------------------------------------------------------------------------------------
    _m("residual_distribution", "unnormalized (no division by the sum)", "return rest / total", "return rest",
       "residual_is_max_0_p_minus_q_normalized"),
    _m("residual_distribution", "p - q without the clamp", CLAMP, "(p - q)", "residual_is_max_0_p_minus_q_normalized"),
    _m("residual_distribution", "abs(p - q) instead of max(0, p - q)", CLAMP, "(p - q).abs()",
       "residual_is_max_0_p_minus_q_normalized"),
    _m("residual_distribution", "max(0, q - p) (the wrong way round)", CLAMP, "torch.clamp(q - p, min=0.0)",
       "residual_is_max_0_p_minus_q_normalized"),
    _m("residual_distribution", "clamps in place (changes the caller's p)", CLAMP, "p.sub_(q).clamp_(min=0.0)",
       "residual_is_max_0_p_minus_q_normalized"),
    _m("residual_distribution", "nan for p == q (no check of an all-zero residual)", NO_RESIDUAL_CHECK, "",
       "residual_refuses_p_equal_to_q"),
    # ---- greedy verification --------------------------------------------------------------------------------
    _m("greedy_verify", "forgets the bonus token",
       "    emitted.append(target_argmax[-1])  # every guess kept: the bonus token, from the last row\n", "",
       "greedy_verify_adds_the_bonus_token_when_every_guess_is_kept"),
    _m("greedy_verify", "emits the rejected guess instead of the target's token", "emitted.append(target)",
       "emitted.append(guess)", "greedy_verify_keeps_the_agreeing_prefix_then_the_targets_token"),
    _m("greedy_verify", "ends a rejected step without the target's token", APPEND_THEN_RETURN, RETURN_THEN_APPEND,
       "greedy_verify_keeps_the_agreeing_prefix_then_the_targets_token"),
    _m("greedy_verify", "goes on past the first disagreement", "return emitted  # the first disagreement",
       "continue  # the first disagreement", "greedy_verify_keeps_the_agreeing_prefix_then_the_targets_token"),
    _m("greedy_verify", "no check of the lengths (zip drops the extra)", LENGTH_CHECK, "",
       "greedy_verify_refuses_a_target_row_count_other_than_k_plus_1"),
    # ---- what a step is worth -------------------------------------------------------------------------------
    _m("expected_tokens_per_step", "alpha = 1 divides by zero",
       "    if alpha == 1.0:  # the formula's 0 / 0: every guess kept, then the bonus token\n"
       "        return float(k + 1)\n", "", "expected_tokens_per_step_is_k_plus_1_when_every_guess_is_kept"),
    _m("expected_tokens_per_step", "alpha^k (forgets the bonus token)", "alpha ** (k + 1)", "alpha ** k",
       "expected_tokens_per_step_by_hand"),
    _m("expected_tokens_per_step", "counts the kept guesses only (not the target's token)", FORMULA,
       "return alpha * (1.0 - alpha ** k) / (1.0 - alpha)", "expected_tokens_per_step_by_hand"),
    _m("expected_tokens_per_step", "k * alpha + 1 (each guess judged alone, not as a prefix)", FORMULA,
       "return k * alpha + 1.0", "expected_tokens_per_step_sums_the_chance_of_reaching_each_position"),
    _m("expected_tokens_per_step", "no check of alpha",
       '    if not 0.0 <= alpha <= 1.0:\n        raise ValueError(f"alpha must be a probability in [0, 1], got '
       '{alpha!r}")\n', "", "expected_tokens_per_step_refuses_alpha_outside_0_to_1"),
    _m("best_k", "ignores the cost (the most tokens per step)", RATE, "expected_tokens_per_step(alpha, k)",
       "best_k_weighs_tokens_against_the_cost"),
    _m("best_k", "the cheapest step (ignores the tokens)", RATE, "1.0 / cost_of_k[k]",
       "best_k_weighs_tokens_against_the_cost"),
    _m("best_k", "kept guesses per second, not tokens", RATE, "(expected_tokens_per_step(alpha, k) - 1) / cost_of_k[k]",
       "best_k_weighs_tokens_against_the_cost"),
    _m("best_k", "a tie goes to the larger k", "if rate > best_rate:", "if rate >= best_rate:",
       "best_k_takes_the_smallest_k_on_a_tie"),
    _m("best_k", "a tie goes to the k the mapping lists first", "for k in sorted(cost_of_k):",
       "for k in cost_of_k:", "best_k_takes_the_smallest_k_on_a_tie"),
    _m("best_k", "no check of the costs", "    if not cost_of_k or not all(cost > 0 for cost in cost_of_k.values()):\n"
       '        raise ValueError(f"cost_of_k must map at least one k to a step time > 0 s, got "\n'
       '                         f"{dict(cost_of_k)!r}")\n', "",
       "best_k_refuses_no_costs_and_costs_that_are_not_positive"),
    # ---- rolling back a block table -------------------------------------------------------------------------
    _m("rollback_block_table", "floor instead of ceiling (drops the partly filled last block)", KEEP,
       "(num_tokens - n) // block_size", "rollback_keeps_a_partly_filled_last_block"),
    _m("rollback_block_table", "keeps an empty block at a block boundary (one block too many)", KEEP,
       "(num_tokens - n) // block_size + 1", "rollback_to_a_block_boundary_keeps_no_empty_block"),
    _m("rollback_block_table", "drops ceil(n / BS) blocks (ignores how full the last one is)", f"keep = {KEEP}",
       "keep = len(table) - (n + block_size - 1) // block_size", "rollback_keeps_a_partly_filled_last_block"),
    _m("rollback_block_table", "frees a block still shared", LET_GO + "            freed.append(block)",
       "        refcounts[block] = 0  # gone, for every holder\n        freed.append(block)",
       "rollback_never_frees_a_block_still_shared"),
    _m("rollback_block_table", "keeps its reference to a shared block (a leak)", LET_GO,
       "        if refcounts[block] == 1:  # held by us alone\n            refcounts[block] = 0\n",
       "rollback_never_frees_a_block_still_shared"),
    _m("rollback_block_table", "edits the caller's table", "    return list(table[:keep]), freed",
       "    del table[keep:]\n    return table, freed", "rollback_leaves_the_callers_table_alone"),
    _m("rollback_block_table", "no check of n", N_CHECK, "", "rollback_refuses_n_outside_0_to_num_tokens"),
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


def test_the_engine_rule_and_residual_pass_the_ch12_checks_under_the_exercise_names():
    """A third oracle: engine/speculative/rejection.py's accepts and residual pass every check of the two
    exercises they are (and the speculative-sampling check built from both)."""
    engine = types.SimpleNamespace(accept_guess=rejection.accepts, residual_distribution=rejection.residual)
    results = [r for r in exercises.run_checks(CHAPTER, module=engine)
               if r.name.startswith(("accept_guess", "residual", "speculative_sampling"))]
    assert len(results) == 8 and [(r.name, r.reason) for r in results if not r.passed] == []


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

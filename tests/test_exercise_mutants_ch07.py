"""Chapter 07's numerics mutants: mistakes that only show at an exact tie, with bf16 values, or under a
tight int8 error budget. Each is the reference solution with one plausible mistake patched in (the
same machinery as tests/test_exercise_mutants.py); the check it names must fail on it, while the
reference passes every check and the untouched stub fails them all.
"""

from __future__ import annotations

import pytest

import exercises
from test_exercise_mutants import Mutant, mutated_module

ROUND_CODES = ".round().clamp(0, INT4_MAX)  # [N, K/G, G]"
BUDGET = "if _relative_error(weight, qw) <= max_error:"

NUMERICS_MUTANTS = [
    # ---- rounding at an exact tie ---------------------------------------------------------------------------
    Mutant("ch07", "int4_scale_and_zero", "zero point rounded half up", "(-lo / scale).round()",
           "(-lo / scale + 0.5).floor()", "int4_grid_rounds_a_tied_zero_point_to_even"),
    Mutant("ch07", "quantize_int4", "codes rounded half up", ROUND_CODES,
           ".add(0.5).floor().clamp(0, INT4_MAX)  # [N, K/G, G]", "quantize_int4_rounds_exact_ties_to_even"),
    Mutant("ch07", "quantize_int4", "codes rounded half away from zero (C's round())", ROUND_CODES,
           ".abs().add(0.5).floor().clamp(0, INT4_MAX)  # [N, K/G, G]", "quantize_int4_rounds_exact_ties_to_even"),
    # ---- values in bf16 -------------------------------------------------------------------------------------
    Mutant("ch07", "quantize_int4", "keeps a bf16 weight in bf16 for its grid",
           "weight.float().reshape(n, k // group_size, group_size)",
           "weight.reshape(n, k // group_size, group_size)", "quantize_int4_of_a_bf16_weight_matches_the_engine"),
    Mutant("ch07", "quant_matmul_ref", "multiplies in the activations' dtype (bf16 weights)",
           "y = x.float() @ w.T", "y = x @ w.T.to(x.dtype)", "dequant_gemv_computes_in_fp32_for_bf16_activations"),
    Mutant("ch07", "quant_matmul_ref", "dequantizes in the activations' dtype",
           "y = x.float() @ w.T", "y = (x @ w.to(x.dtype).T).float()",
           "dequant_gemv_computes_in_fp32_for_bf16_activations"),
    Mutant("ch07", "_relative_error", "measures the error in bf16",
           "(dequantize(qw) - weight.float()).norm()",
           "(dequantize(qw).bfloat16() - weight.bfloat16()).float().norm()",
           "pick_granularity_meets_a_tight_int8_budget"),
    # ---- a tight int8 budget --------------------------------------------------------------------------------
    Mutant("ch07", "pick_granularity", "an absolute slack of 0.001 on the budget", BUDGET,
           "if _relative_error(weight, qw) <= max_error + 1e-3:", "pick_granularity_meets_a_tight_int8_budget"),
    Mutant("ch07", "pick_granularity", "errors rounded to 3 decimals", BUDGET,
           "if round(_relative_error(weight, qw), 3) <= max_error:", "pick_granularity_meets_a_tight_int8_budget"),
    Mutant("ch07", "pick_granularity", "groups always quantized to int4", "qw = quantize(weight, bits, c)",
           "qw = quantize(weight, 4, c)", "pick_granularity_meets_a_tight_int8_budget"),
    Mutant("ch07", "pick_granularity", "a relative slack of 1% on the budget", BUDGET,
           "if _relative_error(weight, qw) <= max_error * 1.01:", "pick_granularity_meets_a_tight_int8_budget"),
]
# a budget met exactly on int4 already caught these two; the tight int8 check catches them as well
CAUGHT_BEFORE = {"measures the error in bf16", "errors rounded to 3 decimals"}


@pytest.mark.parametrize("mutant", NUMERICS_MUTANTS, ids=lambda m: m.id)
def test_the_named_numerics_check_fails_on_the_mutant(mutant):
    checks = dict(exercises.load_checks(mutant.chapter))
    assert mutant.caught_by in checks, f"{mutant.id}: no check named {mutant.caught_by!r}"
    module = mutated_module(mutant)
    with pytest.raises(Exception):  # noqa: B017 - any failure of the check counts as catching the mutant
        checks[mutant.caught_by](module)


@pytest.mark.parametrize("mutant", [m for m in NUMERICS_MUTANTS if m.mistake not in CAUGHT_BEFORE],
                         ids=lambda m: m.id)
def test_the_old_checks_let_the_numerics_mutant_through(mutant):
    """Why the new checks exist: every check the chapter had before them passes on these mutants (the
    new checks are the ones whose names say tie, bf16 or tight)."""
    new = {m.caught_by for m in NUMERICS_MUTANTS}
    failed = [r.name for r in exercises.run_checks("ch07", module=mutated_module(mutant))
              if not r.passed and r.name not in new]
    assert not failed, f"{mutant.id}: already caught by {failed}; it is no held-out numerics mistake"


def test_the_reference_passes_and_the_stub_fails_every_new_check():
    new = {m.caught_by for m in NUMERICS_MUTANTS}
    reference = {r.name: r for r in exercises.run_checks("ch07", solutions=True)}
    stub = {r.name: r for r in exercises.run_checks("ch07")}
    assert new <= set(reference)
    assert all(reference[name].passed for name in new), [reference[n].reason for n in new]
    assert not any(stub[name].passed for name in new)

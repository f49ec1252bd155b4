"""benchmarks/structured.py: its smallest run end to end (every section's rows well formed, the masks of the library
and the reference compared at every step, constrained replies that parse), the oracle that stops a run, the mask
agreement count, and the target's verdict.

No timing is asserted: the end-to-end run only checks what the rows say, not how fast anything was.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks.structured import (
    INT4_SCHEME,
    MASK_CASES,
    QUICK,
    TARGET_SLOWDOWN,
    Run,
    agreement,
    check_constrained,
    main,
    target_row,
)
from engine.structured.regex_dfa import compile_regex


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("structured")
    main(["--quick", "--out", str(out), "--int4-backend", "torch"])
    return json.loads((out / "structured_quick.json").read_text()), (out / "structured_quick.md").read_text()


def test_the_mask_cases_samples_are_in_their_regexes():
    for case in MASK_CASES:
        if case.regex is not None:
            assert compile_regex(case.regex).accepts(case.sample), case.name


def test_every_mask_case_has_a_library_row_and_a_reference_row_wherever_it_is_a_regex(quick):
    payload, _ = quick
    have = {(r["case"], r["masker"]) for r in payload["rows"]}
    for case in MASK_CASES:
        assert (case.name, "llguidance") in have
        assert ((case.name, "reference") in have) == (case.regex is not None)
    for r in payload["rows"]:
        assert r["compile_ms"] > 0 and 0 < r["mask_us_warm_mean"] <= r["mask_us_warm_max"]
        if r["masker"] == "reference":
            assert r["dfa_states"] >= 2


def test_the_reference_mask_holds_the_librarys_at_every_step_and_equals_it_where_nothing_is_forced(quick):
    payload, _ = quick
    for r in payload["rows"]:
        if r["steps_equal"] is None:
            continue
        assert r["steps_reference_contains_library"] == r["steps"], r
        assert 1 <= r["steps_equal"] <= r["steps"]
    number = next(r for r in payload["rows"] if r["case"] == MASK_CASES[0].name)
    assert number["steps_equal"] == number["steps"]  # a number forces no text: the masks are the same everywhere


def test_the_decode_rows_cover_each_batch_and_count_both_setups(quick):
    payload, _ = quick
    assert [r["batch"] for r in payload["decode"]] == list(QUICK["batches"])
    for r in payload["decode"]:
        assert r["tok_s_plain"] > 0 and r["tok_s_schema"] > 0 and r["ratio"] > 0
        assert r["tokens_plain"] > 0 and r["tokens_schema"] > 0
        assert 1 <= r["mean_batch_schema"] <= r["batch"] and 1 <= r["mean_batch_plain"] <= r["batch"]


def test_the_quality_table_has_both_weights_with_and_without_the_constraint_and_constrained_replies_parse(quick):
    payload, md = quick
    rows = payload["quality"]
    assert {(r["weights"], r["constrained"]) for r in rows} == {(w, c) for w in ("fp32", INT4_SCHEME)
                                                                for c in (False, True)}
    for r in rows:
        assert r["n"] == QUICK["quality"]["tinylab"]
        for k in ("parse_rate", "schema_valid_rate", "field_accuracy", "stop_rate", "same_reply_rate"):
            assert 0 <= r[k] <= 1, (k, r)
        if r["constrained"] and r["stop_rate"] == 1:
            assert r["parse_rate"] == 1 and r["schema_valid_rate"] == 1
    assert "## Quality" in md and "## Target (issue 31)" in md and "load_avg_1_5_15_before" in md


def test_the_target_is_judged_met_or_missed_with_its_reason(quick):
    payload, _ = quick
    [target] = payload["targets"]
    assert target["result"] in ("met", "missed") and "the sampler" in target["measured"]
    row = {"model": "m", "batch": 1, "tok_s_plain": 100.0, "tok_s_schema": 95.0, "wall_ratio": 1.0,
           "decode_ms_plain": 10.0, "decode_ms_schema": 10.5, "sample_ms_plain": 0.1, "sample_ms_schema": 0.5,
           "forward_ms_plain": 9.0, "forward_ms_schema": 9.0}
    assert target_row([row | {"ratio": 1 - TARGET_SLOWDOWN}])["result"] == "met"
    assert target_row([row | {"ratio": 1 - TARGET_SLOWDOWN - 0.01}])["result"] == "missed"
    assert target_row([])["result"] == "not run"
    assert "12.5 us with the schema" in target_row([row | {"ratio": 1.0}], {"grammar": 12.5, "plain": 1.0})["measured"]


def _run(*replies):
    outs = [SimpleNamespace(text=t, finish_reason=f, token_ids=[1]) for t, f in replies]
    return Run(outs, 1, 1.0, 1.0, 1, 1, 0.0, 0.0, [])


def test_the_oracle_stops_a_run_on_a_stopped_reply_that_does_not_parse():
    check_constrained(_run(('{"a": 1}', "stop"), ('{"a": ', "length")), "here")
    with pytest.raises(AssertionError, match="do not parse"):
        check_constrained(_run(('{"a": 1}', "stop"), ('{"a": ', "stop")), "here")


def test_agreement_counts_equal_steps_and_containment_with_eos_left_out():
    lib = [torch.tensor([True, False, True]), torch.tensor([False, True, False]), torch.tensor([True, True, False])]
    ref = [torch.tensor([True, False, False]), torch.tensor([True, True, False]), torch.tensor([True, False, False])]
    # step 0 differs only at EOS (id 2); step 1: the reference allows more; step 2: the library allows more
    assert agreement(lib, ref, [2]) == {"steps_equal": 1, "steps_reference_contains_library": 2}

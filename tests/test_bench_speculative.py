"""benchmarks/speculative.py: its smallest run end to end (well-formed rows, every output checked against plain
decoding), the oracle that stops a run, the round order, the batching and the targets' verdicts.

No timing is asserted: the end-to-end run only checks what the rows say, not how fast anything was.
"""

import json

import pytest

from benchmarks.speculative import (
    BATCHES,
    FULL_BATCH,
    QUICK,
    TASKS,
    Case,
    Setup,
    Workload,
    build,
    check_same_outputs,
    groups,
    main,
    measure_case,
    round_order,
    target_rows,
)
from engine.config import DEFAULT_DISABLE_BY_BATCH_SIZE

COLUMNS = ["workload", "batch", "proposer", "k", "switch_off", "speed", "tok_s_plain", "tok_s_spec", "ratio",
           "acceptance_rate", "mean_acceptance_length"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("speculative")
    main(["--quick", "--out", str(out)])
    return json.loads((out / "speculative_quick.json").read_text()), (out / "speculative_quick.md").read_text()


def test_the_quick_run_writes_a_row_for_every_ngram_k_on_every_task_and_the_batch_sweep(quick):
    payload, _ = quick
    rows = payload["rows"]
    have = {(r["workload"], r["batch"], r["proposer"], r["k"], r["switch_off"], r["speed"]) for r in rows}
    default_off = f">= {DEFAULT_DISABLE_BY_BATCH_SIZE}"
    for task in TASKS:
        for k in QUICK["ngram_ks"]:
            assert (f"tinylab/{task}", 1, "ngram", k, default_off, "fast") in have
        assert (f"tinylab/{task}", FULL_BATCH, "ngram", 4, default_off, "fast") in have
        assert (f"tinylab/{task}", FULL_BATCH, "ngram", 4, "never", "fast") in have
        assert (f"tinylab/{task}", FULL_BATCH, "plain (A/A)", 0, None, "fast") in have
    assert ("tinylab/json", 1, "ngram", 4, default_off, "reference") in have
    assert len(have) == len(rows)  # no case measured twice


def test_every_row_is_well_formed(quick):
    payload, _ = quick
    for r in payload["rows"]:
        assert list(r)[:len(COLUMNS)] == COLUMNS
        assert r["proposer"] in ("ngram", "layer_skip", "draft_model", "plain (A/A)") and r["batch"] in BATCHES
        assert r["tok_s_plain"] > 0 and r["tok_s_spec"] > 0 and r["ratio"] > 0
        assert 1 <= r["tokens_per_step"] <= r["k"] + 1
        assert 0 <= r["guessed_pct"] <= 100 and 0 <= r["spec_off_pct"] <= 100
        assert 1 <= r["mean_batch"] <= r["batch"]
        assert r["proposer_errors"] == 0
        if r["proposer"] == "plain (A/A)":  # a second plain engine: never a guess, never a switch
            assert r["acceptance_rate"] is None and r["guessed_pct"] == r["spec_off_pct"] == 0
            assert r["tokens_per_step"] == 1
        elif r["acceptance_rate"] is None:  # no guess at all: every decode step ran with speculation off
            assert r["mean_acceptance_length"] is None and r["guessed_pct"] == 0 and r["spec_off_pct"] == 100
        else:
            assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["mean_acceptance_length"] <= r["k"] + 1


def test_every_speculative_output_of_every_round_was_checked_against_plain_decoding(quick):
    payload, _ = quick
    for r in payload["rows"]:
        prompts_per_round = max(QUICK["examples"], r["batch"])  # a short workload is repeated to fill a batch
        assert r["outputs_checked"] == QUICK["repeats"] * prompts_per_round, r


def test_the_report_names_the_machine_and_threads_first_and_judges_every_target(quick):
    payload, md = quick
    assert payload["machine"]["cpu"] and payload["machine"]["torch"]
    assert payload["settings"]["torch_threads"] == 1 and "cpu_flags" in payload["settings"]
    head = md.splitlines()
    assert head[0] == "# speculative_quick" and head[2].startswith("Machine: cpu ")
    assert head[4].startswith("Settings: cpu_flags = ") and "torch_threads = 1" in head[4]
    assert "## Targets (issue 30)" in md
    results = [t["result"] for t in payload["targets"]]
    assert len(results) == 4 and results[2] == "not run"  # --quick runs tinylab only, not SmolLM2's document
    assert all(r in ("met", "missed") for i, r in enumerate(results) if i != 2)


def test_check_same_outputs_names_the_prompt_and_the_first_token_that_differs():
    assert check_same_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], "here") == 2
    with pytest.raises(AssertionError, match=r"here: prompt 1 differs .* at output token 1"):
        check_same_outputs([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]], "here")
    with pytest.raises(AssertionError, match="at output token 2"):  # one stopped early: it differs where it ends
        check_same_outputs([[4, 5, 6]], [[4, 5]], "here")
    with pytest.raises(AssertionError, match="1 outputs, plain decoding gave 2"):
        check_same_outputs([[1], [2]], [[1]], "here")


class DroppingLastToken:
    """An engine whose outputs lose their last token: what a broken verify step could do."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine

    def generate(self, prompts, params, use_tqdm=True):
        outs = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        for o in outs:
            o.outputs[0].token_ids = o.outputs[0].token_ids[:-1]
        return outs


def test_a_speculative_engine_whose_outputs_differ_from_plain_decoding_stops_the_case():
    from engine.loading.loader import load_model

    model, tokenizer = load_model("tinylab")
    ctx = dict(model=model, tokenizer=tokenizer, name="tinylab", blocks=64, batch=2, budget=512, threads=1)
    plain, spec = Setup(), Setup("ngram", 2)
    load = Workload("tinylab/toy", ((1, 5, 6, 7, 5, 6), (1, 9, 8, 9, 8)), 6)
    case = Case(load, 2, (plain, spec))
    llms = {plain: build(plain, **ctx)[0], spec: build(spec, **ctx)[0]}
    runs, checked = measure_case(case, llms, 2)  # the real engines agree
    assert checked == {plain: 4, spec: 4} and len(runs[spec]) == 2
    llms[spec] = DroppingLastToken(llms[spec])
    with pytest.raises(AssertionError, match="ngram k=2, round 0: prompt 0 differs from plain decoding"):
        measure_case(case, llms, 2)


def test_rounds_alternate_forward_and_backward_with_plain_first_in_round_zero():
    setups = ["plain", "A", "B"]
    assert [round_order(setups, r) for r in range(3)] == [setups, ["B", "A", "plain"], setups]


def test_groups_start_batch_requests_together_and_repeat_a_short_workload_to_fill_one():
    prompts = ((1,), (2,), (3,), (4,), (5,))
    assert groups(prompts, 2) == [[[1], [2]], [[3], [4]], [[5]]]
    assert groups(prompts[:2], 4) == [[[1], [2], [1], [2]]]


def row(workload, batch, proposer, ratio, switch_off=">= 8", k=4, speed="fast"):
    return {"workload": workload, "batch": batch, "proposer": proposer, "k": k, "switch_off": switch_off,
            "speed": speed, "ratio": ratio, "acceptance_rate": 0.5, "tokens_per_step": 1.5, "guessed_pct": 80.0,
            "step_cost": 1.1, "spec_off_pct": 50.0}


def test_targets_take_the_best_batch_1_row_and_the_worst_row_at_batch_16_that_may_switch_off():
    rows = [row("tinylab/recall", 1, "ngram", 1.4, k=2), row("tinylab/recall", 1, "ngram", 2.1, k=8),
            row("tinylab/recall", 1, "ngram", 3.0, speed="reference"),  # not the default speed: not judged
            row("tinylab/json", 1, "ngram", 1.9), row("tinylab/json", 1, "layer_skip", 2.5),  # not ngram
            row("smollm2-135m-instruct/document", 1, "layer_skip", 1.6),
            row("tinylab/json", 16, "ngram", 0.97), row("tinylab/recall", 16, "ngram", 1.0),
            row("tinylab/json", 16, "ngram", 0.5, switch_off="never"),  # forced on: shown, not judged
            row("tinylab/json", 16, "plain (A/A)", 0.9, switch_off=None, k=0)]  # the noise floor: shown
    recall, json_, document, full = target_rows(rows)
    assert recall["result"] == "met" and "k=8" in recall["measured"]
    assert json_["result"] == "missed" and "1.9x" in json_["measured"]
    assert document["result"] == "met" and "layer_skip" in document["measured"]
    assert full["result"] == "met" and "0.97x" in full["measured"]
    assert "with the switch off: tinylab/json ngram k=4 (never): 0.5x" in full["measured"]
    assert "A/A control (a second plain engine) on tinylab/json ran 0.9x" in full["measured"]
    rows[6]["ratio"] = 0.94
    assert target_rows(rows)[3]["result"] == "missed"

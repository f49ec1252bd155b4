"""The quantization benchmark's pure helpers: how it summarizes timings, compares tokens, judges targets.

No timing is asserted: the inputs are made-up seconds and rows.
"""

import pytest

from benchmarks._peers import leading_identical, summarize_steps
from benchmarks.quantization import add_ratios, target_summary, token_agreement


def row(engine, scheme, batch, mib, prefill, decode):
    return {"engine": engine, "scheme": scheme, "batch": batch, "weight_mib": mib,
            "prefill_tok_s": prefill, "decode_tok_s": decode}


def test_leading_identical_stops_at_the_first_difference():
    assert leading_identical([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # position 3 agrees again, but is not counted
    assert leading_identical([5, 6], [5, 6, 7]) == 2
    assert leading_identical([], [1]) == 0


def test_summarize_steps_takes_the_median_prefill_and_the_median_of_each_repeats_median_step():
    out = summarize_steps([1.0, 2.0, 4.0], [[0.1, 0.1, 0.5], [0.2, 0.2, 0.2], [0.4]], prompt_tokens=100)
    assert out["prefill_tok_s"] == pytest.approx(100 / 2.0)
    assert out["decode_tok_s"] == pytest.approx(1 / 0.2)


def test_summarize_steps_refuses_a_repeat_without_decode_steps():
    with pytest.raises(ValueError, match="decode step"):
        summarize_steps([1.0], [[]], prompt_tokens=8)


def sample_rows():
    rows = [row("servelab", "fp32", 1, 500.0, 100.0, 10.0), row("servelab", "bf16", 1, 250.0, 50.0, 20.0),
            row("servelab", "int8 packed", 1, 200.0, 80.0, 40.0), row("servelab", "int8 packed", 16, 200.0, 80.0, 30.0),
            row("servelab", "fp32", 16, 500.0, 400.0, 100.0), row("servelab", "bf16", 16, 250.0, 100.0, 10.0),
            row("servelab", "gguf blocks packed", 1, 180.0, 60.0, 8.0),
            row("llama.cpp", "gguf file", 1, 90.0, 200.0, 32.0)]
    add_ratios(rows)
    return rows


def test_add_ratios_compare_every_row_with_servelab_at_the_same_batch():
    rows = {(r["engine"], r["scheme"], r["batch"]): r for r in sample_rows()}
    assert rows[("servelab", "int8 packed", 16)]["x_decode_vs_bf16"] == 3.0  # 30 / 10 (batch 16's bf16)
    assert rows[("servelab", "int8 packed", 16)]["x_decode_vs_fp32"] == 0.3  # 30 / 100
    assert rows[("llama.cpp", "gguf file", 1)]["x_prefill_vs_fp32"] == 2.0
    assert rows[("llama.cpp", "gguf file", 1)]["x_smaller_than_fp32"] == pytest.approx(500 / 90, abs=0.01)


def test_targets_are_met_at_the_target_and_missed_below_it():
    lines = target_summary(sample_rows())
    int8 = next(t for t in lines if t.startswith("int8 packed"))
    gguf = next(t for t in lines if t.startswith("gguf blocks packed"))
    assert "2.0x our bf16" in int8 and "met" in int8 and "missed" not in int8  # 40 / 20 = exactly 2
    assert "0.4x our bf16" in gguf and "missed" in gguf  # 8 / 20 against 3x
    assert not any(t.startswith("int4-g128 packed") for t in lines)  # no such row: no line about it


def test_int4_is_judged_against_llama_cpp_on_the_same_file():
    line = next(t for t in target_summary(sample_rows()) if t.startswith("int4 vs llama.cpp"))
    assert "8.0 vs 32.0" in line and "0.25x" in line and "missed" in line


def test_without_llama_cpp_the_summary_says_it_was_not_measured():
    rows = [r for r in sample_rows() if r["engine"] != "llama.cpp"]
    assert any("not measured" in t for t in target_summary(rows))


def test_smaller_but_not_faster_lists_only_smaller_rows_slower_than_fp32():
    line = next(t for t in target_summary(sample_rows()) if t.startswith("smaller but not faster"))
    assert "int8 packed (batch 16" in line and "bf16 (batch 16" in line  # 2.5x / 2x smaller, slower
    assert "int8 packed (batch 1:" not in line  # faster than fp32 at batch 1
    assert "llama.cpp" not in line and "gguf file" not in line  # peers are not our schemes


def test_token_agreement_counts_per_prompt_and_skips_a_missing_llama_cpp():
    ours = {"packed": [[1, 2, 3], [4, 5, 6]], "torch": [[1, 2, 0], [4, 5, 6]]}
    got = token_agreement(ours, [[1, 9, 3], [4, 5, 6]])
    assert got["servelab gguf packed vs llama.cpp"] == ["1/3", "3/3"]
    assert got["servelab gguf torch vs llama.cpp"] == ["1/3", "3/3"]
    assert got["servelab gguf packed vs torch"] == ["2/3", "3/3"]
    assert list(token_agreement(ours, [])) == ["servelab gguf packed vs torch"]

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
            row("servelab", "gguf blocks native", 1, 180.0, 60.0, 8.0),
            row("llama.cpp", "gguf file", 1, 90.0, 200.0, 32.0)]
    add_ratios(rows)
    return rows


def test_add_ratios_compare_every_row_with_servelab_at_the_same_batch():
    rows = {(r["engine"], r["scheme"], r["batch"]): r for r in sample_rows()}
    assert rows[("servelab", "int8 packed", 16)]["x_decode_vs_bf16"] == 3.0  # 30 / 10 (batch 16's bf16)
    assert rows[("servelab", "int8 packed", 16)]["x_decode_vs_fp32"] == 0.3  # 30 / 100
    assert rows[("llama.cpp", "gguf file", 1)]["x_prefill_vs_fp32"] == 2.0
    assert rows[("llama.cpp", "gguf file", 1)]["x_smaller_than_fp32"] == pytest.approx(500 / 90, abs=0.01)


def test_the_bytes_a_decode_step_streams_give_the_ratio_a_weight_bound_step_would_reach():
    rows = sample_rows()
    for r in rows:
        if (r["engine"], r["scheme"]) in {("servelab", "bf16"), ("servelab", "int8 packed")}:
            r["step_mib"] = 240.0 if r["scheme"] == "bf16" else 120.0
    add_ratios(rows)
    at = {(r["engine"], r["scheme"], r["batch"]): r for r in rows}
    assert at[("servelab", "int8 packed", 1)]["x_bytes_vs_bf16"] == 2.0  # 240 / 120
    assert at[("servelab", "fp32", 1)]["x_bytes_vs_bf16"] is None  # its bytes were not counted
    assert at[("llama.cpp", "gguf file", 1)]["x_bytes_vs_bf16"] is None
    int8 = next(t for t in target_summary(rows) if t.startswith("int8 packed"))
    assert "2.0x fewer weight bytes a step than bf16" in int8


def test_targets_are_met_at_the_target_and_missed_below_it():
    lines = target_summary(sample_rows())
    int8 = next(t for t in lines if t.startswith("int8 packed"))
    gguf = next(t for t in lines if t.startswith("gguf blocks native"))
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
    ours = {"native": [[1, 2, 3], [4, 5, 6]], "torch": [[1, 2, 0], [4, 5, 6]]}
    got = token_agreement(ours, [[1, 9, 3], [4, 5, 6]])
    assert got["servelab gguf native vs llama.cpp"] == ["1/3", "3/3"]
    assert got["servelab gguf torch vs llama.cpp"] == ["1/3", "3/3"]
    assert got["servelab gguf native vs torch"] == ["2/3", "3/3"]
    assert list(token_agreement(ours, [])) == ["servelab gguf native vs torch"]


def test_ratios_use_the_faster_baseline_and_the_engine_column_where_measured():
    rows = sample_rows()[:3]  # fp32, bf16, int8 packed at batch 1
    rows.append(row("servelab", "bf16 packed", 1, 250.0, 60.0, 25.0))  # faster than "bf16" (20): the baseline
    for r, engine in zip(rows, (12.0, 16.0, 30.0, 24.0), strict=True):
        r["engine_decode_tok_s"] = engine
    rows.append(row("llama.cpp", "gguf file", 1, 90.0, 200.0, 32.0))  # a peer: no engine column
    add_ratios(rows)
    by = {(r["engine"], r["scheme"]): r for r in rows}
    assert by[("servelab", "int8 packed")]["x_decode_vs_bf16"] == 1.6  # 40 / 25, not 40 / 20
    assert by[("servelab", "int8 packed")]["x_engine_decode_vs_bf16"] == 1.25  # 30 / 24
    assert by[("llama.cpp", "gguf file")]["engine_decode_tok_s"] is None
    line = next(t for t in target_summary(rows) if t.startswith("int8 packed"))
    assert "1.6x our bf16 (target >= 2x: missed); through the engine 1.25x (missed)" in line


# ---- benchmarks/vs_vllm.py: prompts, speeds, greedy equality, the table and its targets -------------------
from benchmarks._vs_vllm_workers import measure  # noqa: E402
from benchmarks.vs_vllm import (  # noqa: E402
    FULL,
    LABELS,
    add_peak_notes,
    combine_rounds,
    compare_tokens,
    engine_env,
    greedy_equality,
    make_job,
    make_prompts,
    notes_text,
    offline_useful_gflop,
    peak_fraction_verdict,
    speeds,
    spreads,
    table_rows,
    target_verdicts,
)

SIZES = {"new_tokens": 64, "prompts": 64, "prefill_tokens": 1024}


def test_prompts_have_the_issue_s_shapes_and_the_same_seed_gives_the_same_ids():
    p = make_prompts(FULL, vocab=100)
    assert len(p["offline_prompts"]) == 64 and all(32 <= len(x) <= 256 for x in p["offline_prompts"])
    assert len(p["prefill_prompt"]) == 1024 and len(p["decode_prompt"]) == FULL["decode_prompt_tokens"]
    every_id = [t for x in p["offline_prompts"] + [p["prefill_prompt"], p["decode_prompt"]] for t in x]
    assert min(every_id) >= 3 and max(every_id) < 100  # never a special token, never past the vocabulary
    assert make_prompts(FULL, vocab=100) == p and make_prompts(FULL, vocab=100, seed=1) != p


def test_decode_speed_subtracts_the_one_token_run_so_prefill_and_call_costs_drop_out():
    result = {"decode_s_1_token": 0.5, "decode_s_all_tokens": 2.5, "prefill_s": 2.0, "offline_s": 16.0}
    got = speeds(result, SIZES)
    assert got == {"decode_tok_s": 32.0, "offline_tok_s": 256.0, "prefill_tok_s": 512.0}  # 64/2, 4096/16, 1024/2
    assert speeds(dict(result, offline_s=None), SIZES)["offline_tok_s"] is None  # llama.cpp: no offline run
    assert speeds({"failed": "exit 1"}, SIZES) == dict.fromkeys(["decode_tok_s", "offline_tok_s", "prefill_tok_s"])


def test_compare_tokens_finds_where_each_sequence_first_differs():
    got = compare_tokens([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert got["identical"] == 1 and got["of"] == 3
    assert got["first_differences"] == [{"prompt": 1, "position": 1, "ours": 5, "theirs": 9},
                                        {"prompt": 2, "position": 2, "ours": None, "theirs": 9}]


def test_greedy_equality_compares_every_engine_with_servelab_on_the_parts_both_ran():
    ours = {"decode": [[1, 2]], "prefill": [[5]], "offline": [[1], [2]]}
    results = {"servelab": {"tokens": ours},
               "vllm": {"tokens": {"decode": [[1, 2]], "prefill": [[5]], "offline": [[1], [3]]}},
               "llamacpp": {"tokens": {"decode": [[1, 7]], "prefill": [[5]]}}}  # no offline part
    eq = greedy_equality(results)
    assert set(eq) == {"vllm", "llamacpp"}
    assert eq["vllm"]["offline"]["identical"] == 1 and eq["vllm"]["decode"]["identical"] == 1
    assert set(eq["llamacpp"]) == {"decode", "prefill"} and eq["llamacpp"]["decode"]["identical"] == 0
    assert greedy_equality({"vllm": results["vllm"]}) == {}  # servelab failed: nothing to compare with


def engine_speeds():
    return {"servelab": {"decode_tok_s": 30.0, "offline_tok_s": 240.0, "prefill_tok_s": 1000.0},
            "vllm": {"decode_tok_s": 25.0, "offline_tok_s": 200.0, "prefill_tok_s": 1000.0},
            "llamacpp": {"decode_tok_s": 60.0, "offline_tok_s": None, "prefill_tok_s": 400.0}}


def test_targets_are_met_at_exactly_the_needed_ratio_and_missed_below_it():
    verdicts = {v["target"]: v for v in target_verdicts(engine_speeds(), skipped={})}
    assert verdicts["offline >= 1.2x vLLM"]["verdict"] == "met"  # 240 / 200 = 1.2 exactly
    assert verdicts["prefill >= 1.2x vLLM"]["verdict"] == "missed"  # 1.0x
    decode = verdicts["batch-1 decode >= llama.cpp"]
    assert decode["verdict"] == "missed" and decode["ratio"] == 0.5 and decode["anchor"] == 60.0


def test_a_skipped_anchor_makes_its_targets_not_measured_and_says_which():
    s = engine_speeds()
    del s["vllm"]
    verdicts = {v["target"]: v["verdict"] for v in target_verdicts(s, skipped={"vllm": "not installed"})}
    assert verdicts["offline >= 1.2x vLLM"].startswith("not measured") and "vLLM" in verdicts["offline >= 1.2x vLLM"]
    assert verdicts["batch-1 decode >= llama.cpp"] == "missed"  # llama.cpp still ran


def test_table_rows_give_ratios_to_vllm_and_decode_to_llama_cpp():
    eq = {"vllm": {"offline": compare_tokens([[1], [2]], [[1], [3]])}}
    rows = {r["engine"].split()[0]: r for r in table_rows(engine_speeds(), eq, threads=2)}
    assert rows["servelab"]["offline_x_vs_vllm"] == 1.2 and rows["servelab"]["decode_x_vs_llamacpp"] == 0.5
    assert rows["llama.cpp"]["offline_x_vs_vllm"] is None  # no offline number: no ratio, not zero
    assert rows["vLLM"]["greedy_vs_servelab"] == "offline 1/2 (prompt 1 from token 0)"
    assert rows["servelab"]["greedy_vs_servelab"] == "reference" and rows["llama.cpp"]["greedy_vs_servelab"] == "-"


def test_vllm_is_bound_to_as_many_cores_as_threads_and_reserves_none():
    env = engine_env("vllm", 2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert engine_env("vllm", 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    ours = engine_env("servelab", 2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in ours and ours["OMP_NUM_THREADS"] == "2"


def test_measure_runs_the_same_calls_on_every_engine_and_returns_their_tokens():
    calls = []

    def generate(prompts, n):  # a fake engine: new token i of prompt p is p[0] + i
        calls.append((len(prompts), len(prompts[0]), n))
        return [[p[0] + i for i in range(n)] for p in prompts]
    job = {"new_tokens": 4, "repeats": 2, "offline_repeats": 1, "offline": True, "decode_prompt": [10] * 20,
           "prefill_prompt": [20] * 50, "offline_prompts": [[1] * 5, [2] * 6, [3] * 7, [4] * 8, [5] * 9]}
    out = measure(generate, job)
    assert (1, 20, 1) in calls and (1, 20, 5) in calls  # the 1-token and the (1 + n)-token decode runs
    assert calls.count((1, 50, 1)) == 2 and calls[-1] == (5, 5, 4)  # prefill per repeat; all prompts at once
    assert out["tokens"]["decode"] == [[10, 11, 12, 13, 14]] and out["tokens"]["prefill"] == [[20]]
    assert out["tokens"]["offline"][4] == [5, 6, 7, 8]
    assert "offline_s" not in measure(generate, dict(job, offline=False))


def test_a_job_carries_the_dtype_every_engine_loads_and_the_notes_name_it(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 100}')
    assert make_job(FULL, tmp_path, threads=2)["dtype"] == "float32"
    assert make_job(FULL, tmp_path, threads=2, dtype="bfloat16")["dtype"] == "bfloat16"
    settings = {"dtype": "bfloat16", "cpu_flags": "", "torch_cpu_capability": "AVX512", "threads": 2, "quick": True}
    details = {"engines": {}, "skipped": {"llamacpp": "--dtype bfloat16"}, "targets": []}
    text = notes_text(settings, details)
    assert "SmolLM2-135M-Instruct in bfloat16" in text and "llama.cpp (F32 GGUF) skipped" in text


def test_useful_flops_count_each_linear_once_per_token_the_head_per_new_token_and_causal_attention(tmp_path):
    """One layer, E=2, H=Hkv=1, D=2, F=1, V=3: linears 2 * (2*3*2 + 2*2 + 3*2*1) = 44 FLOPs a token, attention 8
    a visible key, the head 12 a generated token. A 2-token prompt and 2 new tokens: 3 positions (the last new
    token is never fed back) see 1 + 2 + 3 keys."""
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1, "hidden_size": 2, "num_attention_heads": 1, '
                                          '"head_dim": 2, "num_key_value_heads": 1, "intermediate_size": 1, '
                                          '"vocab_size": 3}')
    assert offline_useful_gflop(tmp_path, [2], 2) * 1e9 == pytest.approx(3 * 44 + 8 * 6 + 2 * 12)
    assert offline_useful_gflop(tmp_path, [2, 2], 2) == pytest.approx(2 * offline_useful_gflop(tmp_path, [2], 2))


def test_the_peak_target_is_met_at_80_percent_and_says_when_there_was_no_run():
    assert peak_fraction_verdict({"offline_s": 10.0}, 800.0, 100.0)["verdict"] == "met"
    missed = peak_fraction_verdict({"offline_s": 10.0}, 790.0, 100.0)
    assert missed["verdict"] == "missed" and missed["ratio"] == 0.79 and missed["servelab"] == 79.0
    assert peak_fraction_verdict(None, 800.0, 100.0)["verdict"].startswith("not measured")


def test_a_ratio_target_says_what_share_of_the_peak_it_asks_for():
    """vLLM at 92 % of the matmul peak in prefill: 1.2x vLLM is 110 % of it, a target no engine can meet there."""
    verdicts = target_verdicts(engine_speeds(), skipped={})
    rows = [{"engine": LABELS["vllm"], "offline_x_peak": 0.5, "prefill_x_peak": 0.92},
            {"engine": LABELS["servelab"], "offline_x_peak": 0.6, "prefill_x_peak": 0.92}]
    add_peak_notes(verdicts, rows)
    notes = {v["target"]: v.get("peak_note") for v in verdicts}
    assert notes["prefill >= 1.2x vLLM"] == "vLLM ran at 92% of the matmul peak, so 1.2x vLLM is 110% of it"
    assert notes["offline >= 1.2x vLLM"] == "vLLM ran at 50% of the matmul peak, so 1.2x vLLM is 60% of it"
    assert notes["batch-1 decode >= llama.cpp"] is None  # not a vLLM ratio
    unmeasured = target_verdicts(engine_speeds(), skipped={})
    add_peak_notes(unmeasured, [dict(rows[0], prefill_x_peak=None)])  # vLLM's prefill failed: no note
    assert {v["target"]: v.get("peak_note") for v in unmeasured}["prefill >= 1.2x vLLM"] is None


def test_rounds_combine_into_medians_keep_every_round_and_say_whether_the_tokens_repeated():
    base = {"tokens": {"decode": [[1, 2]]}, "info": {"v": 1}, "load_avg_after": [1.0]}
    rounds = [dict(base, decode_s_1_token=1.0, decode_s_all_tokens=3.0, prefill_s=2.0, offline_s=None),
              dict(base, decode_s_1_token=2.0, decode_s_all_tokens=5.0, prefill_s=4.0, offline_s=None,
                   load_avg_after=[2.0]),
              dict(base, decode_s_1_token=9.0, decode_s_all_tokens=4.0, prefill_s=3.0, offline_s=None)]
    out = combine_rounds(rounds)
    assert (out["decode_s_1_token"], out["decode_s_all_tokens"], out["prefill_s"]) == (2.0, 4.0, 3.0)
    assert out["offline_s"] is None  # llama.cpp: no offline part in any round
    assert [r["prefill_s"] for r in out["rounds"]] == [2.0, 4.0, 3.0] and out["tokens_repeat"] is True
    assert out["load_avg_after"] == [1.0]  # the last round's
    other = dict(rounds[1], tokens={"decode": [[1, 3]]})
    assert combine_rounds([rounds[0], other])["tokens_repeat"] is False
    assert combine_rounds([rounds[0], {"failed": "exit 1"}]) == {"failed": "exit 1"}


def test_every_timed_run_of_every_round_makes_the_spread_and_a_wide_one_is_flagged():
    """Issue 34: an engine whose runs differ by more than 1.2x says so in the table's `varies`."""
    base = {"tokens": {}, "decode_s_1_token": 1.0, "decode_s_all_tokens": 3.0, "prefill_s": 2.0,
            "offline_s": 10.0, "load_avg_after": [1.0]}
    rounds = [dict(base, runs={"decode_s_all_tokens": [3.0, 3.1], "prefill_s": [2.0, 2.1],
                               "offline_s": [10.0]}),
              dict(base, runs={"decode_s_all_tokens": [3.2, 3.0], "prefill_s": [2.0, 2.2],
                               "offline_s": [41.0]})]
    out = spreads(combine_rounds(rounds))
    assert out == {"decode_spread": 1.07, "offline_spread": 4.1, "prefill_spread": 1.1,
                   "varies": "offline 4.1x"}
    steady = spreads(combine_rounds([dict(base, runs={"offline_s": [10.0, 11.0]})]))
    assert steady["varies"] == "-" and steady["offline_spread"] == 1.1
    assert steady["decode_spread"] is None  # one run or none: no spread to speak of
    assert spreads({"failed": "exit 1"})["varies"] == "-"


def test_servelab_runs_the_peers_workload_with_prefix_caching_off_as_vllm_does():
    """Each workload repeats its prompts: with the prefix cache on, every repeat after the first would be read from
    the cache (a 1,024-token prefill measured at 20,000 tok/s), not computed as vLLM computes it."""
    from benchmarks._vs_vllm_workers import servelab_engine
    from engine.loading.loader import resolve_model_path

    job = {"folder": str(resolve_model_path("tinylab")), "dtype": "float32", "threads": 1, "max_num_seqs": 4,
           "new_tokens": 2, "offline_prompts": [[5, 6, 7] * 8], "prefill_prompt": [9] * 40, "decode_prompt": [4] * 20}
    generate, info = servelab_engine(job)
    assert info["enable_prefix_caching"] is False and info["speed_choices"]["speed"] == "fast"
    assert generate([job["prefill_prompt"]], 2) == generate([job["prefill_prompt"]], 2)


def test_a_tagged_benchmark_writes_beside_the_untagged_one_and_a_bad_tag_is_refused(tmp_path):
    """--tag keeps another CPU's results beside this one's: the suffix is the only change of name."""
    import argparse

    from benchmarks._common import add_tag_option, result_tag, tagged, write_results

    assert tagged("vs_vllm", None) == "vs_vllm"
    assert tagged("vs_vllm", result_tag("xeon-amx")) == "vs_vllm_xeon-amx"
    write_results(tagged("repeatability", None), [{"run": 1}], {}, results_dir=tmp_path)
    write_results(tagged("repeatability", "xeon"), [{"run": 2}], {}, results_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "repeatability.json", "repeatability.md", "repeatability_xeon.json", "repeatability_xeon.md"]
    for bad in ("Xeon", "../up", "", "a b", "-x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--tag"):
            result_tag(bad)
    parser = argparse.ArgumentParser()
    add_tag_option(parser)
    assert parser.parse_args(["--tag", "epyc-avx2"]).tag == "epyc-avx2" and parser.parse_args([]).tag is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--tag", "../results"])

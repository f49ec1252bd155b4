"""Serving metrics (engine/companions/metrics.py), checked against numbers worked out by hand in the comments.

The hand-built trace (one second per step, steps end at 1, 2, 3, 4 s):

    step           0 (0-1 s)     1 (1-2 s)     2 (2-3 s)     3 (3-4 s)
    a  arr 0.0     prefill->tok  decode->tok   decode->tok   .            finished at 3 s (stop)
    b  arr 0.5     waiting       prefill->tok  decode->tok   decode->tok  finished at 4 s (length)
    c  arr 1.5     .             waiting       prefill->tok  .            finished at 3 s (stop)

    a: tokens at 1, 2, 3      TTFT 1.0  queue 0.0  ITL [1, 1]  TPOT 1.0  E2E 3.0  (prompt 10)
    b: tokens at 2, 3, 4      TTFT 1.5  queue 0.5  ITL [1, 1]  TPOT 1.0  E2E 3.5  (prompt 100)
    c: one token at 3         TTFT 1.5  queue 0.5  ITL []      TPOT nan  E2E 1.5  (prompt 300)
"""

import math

import pytest

from engine.companions.metrics import (
    SLO,
    Distribution,
    RequestTiming,
    bucket_table,
    by_output_length,
    by_prompt_length,
    by_tenant,
    goodput,
    jain_fairness,
    mean,
    nearest_rank,
    prompt_length_label,
    requests_from_trace,
    run_duration,
    summarize,
    summarize_buckets,
    trace_metrics,
    trace_summary,
)
from engine.trace import ScheduledRequest, StepReport, Trace


def _arrived(rid, t, prompt, tenant):
    return {"type": "arrived", "request_id": rid, "arrival_time": t, "num_prompt_tokens": prompt,
            "max_tokens": 3, "priority": 0, "tenant": tenant}


def _finished(rid, reason="stop"):
    return {"type": "finished", "request_id": rid, "reason": reason}


def _step(i, work, events):
    """Step i runs from i to i + 1 seconds; work = [(request id, phase)], each samples one token."""
    scheduled = [ScheduledRequest(rid, phase, 0, 1, 1) for rid, phase in work]
    return StepReport(i, float(i), float(i + 1), scheduled=scheduled, events=events)


@pytest.fixture
def trace():
    return Trace(steps=[
        _step(0, [("a", "prefill")], [_arrived("a", 0.0, 10, "free"), _arrived("b", 0.5, 100, "paid")]),
        _step(1, [("a", "decode"), ("b", "prefill")], [_arrived("c", 1.5, 300, "free")]),
        _step(2, [("a", "decode"), ("b", "decode"), ("c", "prefill")], [_finished("a"), _finished("c")]),
        _step(3, [("b", "decode")], [_finished("b", "length")]),
    ])


# ---- percentiles and fairness on known lists -------------------------------------------------------


def test_nearest_rank_is_the_smallest_value_with_q_percent_at_or_below_it():
    values = [4, 1, 3, 2]
    assert nearest_rank(values, 50) == 2  # ceil(0.50 * 4) = 2nd smallest
    assert nearest_rank(values, 75) == 3  # ceil(0.75 * 4) = 3rd
    assert nearest_rank(values, 76) == 4  # ceil(3.04) = 4th
    assert nearest_rank(values, 99) == 4
    assert nearest_rank(range(1, 101), 95) == 95 and nearest_rank(range(1, 101), 99) == 99


def test_p99_of_fewer_than_100_values_is_their_maximum_and_nan_is_left_out():
    assert nearest_rank([0.1] * 19 + [7.0], 99) == 7.0
    assert nearest_rank([5.0, math.nan, 1.0], 50) == 1.0  # of [1, 5]
    assert math.isnan(nearest_rank([], 50)) and math.isnan(nearest_rank([math.nan], 50))
    with pytest.raises(ValueError, match="q=0"):
        nearest_rank([1.0], 0)


def test_a_distribution_reports_count_mean_percentiles_and_max():
    d = Distribution.of([10.0, 1.0, 2.0, math.nan, 3.0])
    assert d == Distribution(count=4, mean=4.0, p50=2.0, p95=10.0, p99=10.0, max=10.0)
    empty = Distribution.of([])
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.p99)
    assert math.isnan(mean([math.nan]))


def test_jain_fairness_is_one_for_equal_shares_and_one_over_n_for_a_monopoly():
    assert jain_fairness([2.0, 2.0, 2.0]) == 1.0
    assert jain_fairness([1.0, 0.0]) == 0.5  # (1)^2 / (2 * 1)
    assert jain_fairness([3.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_fairness([1.0, 3.0]) == pytest.approx(16 / 20)  # (4)^2 / (2 * 10)


# ---- one request's times ---------------------------------------------------------------------------


def test_each_request_gets_its_times_from_the_trace(trace):
    a, b, c = requests_from_trace(trace)
    assert [r.request_id for r in (a, b, c)] == ["a", "b", "c"]
    assert (a.token_times, b.token_times, c.token_times) == ([1.0, 2.0, 3.0], [2.0, 3.0, 4.0], [3.0])
    assert (a.first_scheduled_time, b.first_scheduled_time, c.first_scheduled_time) == (0.0, 1.0, 2.0)
    assert (a.queue_s, b.queue_s, c.queue_s) == (0.0, 0.5, 0.5)
    assert (a.ttft_s, b.ttft_s, c.ttft_s) == (1.0, 1.5, 1.5)
    assert (a.itl_s, b.itl_s, c.itl_s) == ([1.0, 1.0], [1.0, 1.0], [])
    assert a.tpot_s == 1.0 and b.tpot_s == 1.0 and math.isnan(c.tpot_s)  # c has one token
    assert (a.e2e_s, b.e2e_s, c.e2e_s) == (3.0, 3.5, 1.5)
    assert (a.ttft_steps, b.ttft_steps, c.ttft_steps) == (1.0, 2.0, 2.0)  # arrival step .. first token step
    assert (a.tenant, b.prompt_tokens, b.finish_reason) == ("free", 100, "length")


def test_an_unfinished_request_has_a_ttft_but_no_tpot_or_e2e_yet(trace):
    half = Trace(steps=trace.steps[:2])  # stop after step 1: a has 2 tokens, b one, c none
    a, b, c = requests_from_trace(half)
    assert a.ttft_s == 1.0 and math.isnan(a.tpot_s) and math.isnan(a.e2e_s) and a.itl_s == [1.0]
    assert math.isnan(c.ttft_s) and math.isnan(c.queue_s)


def test_client_side_step_times_give_ttft_and_tpot():
    # a prefill of 0.5 s, then three decode steps of 0.1, 0.2 and 0.3 s
    r = RequestTiming.from_step_times([0.5, 0.1, 0.2, 0.3])
    assert r.token_times == pytest.approx([0.5, 0.6, 0.8, 1.1])
    assert r.ttft_s == 0.5 and r.tpot_s == pytest.approx(0.2) and r.e2e_s == pytest.approx(1.1)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])


# ---- a whole run -----------------------------------------------------------------------------------


def test_the_summary_of_a_hand_built_trace(trace):
    m = trace_summary(trace)
    assert (m.requests, m.finished, m.output_tokens, m.steps) == (3, 3, 7, 4)
    assert m.duration_s == 4.0 and m.throughput_tok_s == 7 / 4.0 and m.tokens_per_step == 7 / 4
    assert m.ttft_s == Distribution(3, (1.0 + 1.5 + 1.5) / 3, 1.5, 1.5, 1.5, 1.5)  # P50 = 2nd of [1, 1.5, 1.5]
    assert m.queue_s.mean == pytest.approx(1 / 3) and m.queue_s.p50 == 0.5
    assert m.tpot_s.count == 2 and m.tpot_s.mean == 1.0  # c's nan is left out
    assert m.itl_s.count == 4 and m.itl_s.max == 1.0  # one value per token gap: a 2, b 2, c 0
    assert m.e2e_s.p50 == 3.0 and m.e2e_s.max == 3.5  # sorted [1.5, 3.0, 3.5]
    assert m.ttft_steps.mean == pytest.approx(5 / 3)
    # per-request rates: a 3 / 3.0 = 1, b 3 / 3.5 = 6/7, c 1 / 1.5 = 2/3
    rates = [1.0, 6 / 7, 2 / 3]
    assert m.fairness == pytest.approx(sum(rates) ** 2 / (3 * sum(x * x for x in rates)))


def test_trace_metrics_is_the_summary_as_one_flat_row(trace):
    row = trace_metrics(trace)
    assert row["ttft_p50_s"] == 1.5 and row["ttft_p95_s"] == 1.5 and row["ttft_mean_steps"] == pytest.approx(5 / 3)
    assert row["tpot_mean_s"] == 1.0 and row["itl_max_s"] == 1.0 and row["e2e_max_s"] == 3.5
    assert row["queue_p99_s"] == 0.5 and row["tokens_per_step"] == 7 / 4 and row["steps"] == 4
    assert "goodput_per_s" not in row  # only with an SLO


def test_a_tenant_summary_counts_its_requests_over_the_whole_runs_duration(trace):
    free = trace_summary(trace, tenant="free")
    assert (free.requests, free.output_tokens, free.duration_s) == (2, 4, 4.0)  # a and c
    assert free.throughput_tok_s + trace_summary(trace, tenant="paid").throughput_tok_s == 7 / 4.0


def test_client_side_run_duration_is_first_arrival_to_last_token():
    rs = [RequestTiming("x", 1.0, [2.0, 2.5], finish_time=2.5), RequestTiming("y", 1.5, [4.0])]
    assert run_duration(rs) == 3.0 and run_duration([]) == 0.0
    assert summarize(rs).throughput_tok_s == 3 / 3.0 and summarize(rs).finished == 1


# ---- goodput under SLOs ----------------------------------------------------------------------------


def test_goodput_counts_only_requests_within_both_slos(trace):
    requests = requests_from_trace(trace)
    # TTFT <= 1.2 s: only a (b and c waited 1.5 s); TPOT is no limit here
    g = goodput(requests, SLO(ttft_s=1.2, tpot_s=math.inf), duration_s=4.0)
    assert (g.met, g.requests, g.per_s, g.fraction) == (1, 3, 0.25, 1 / 3)
    # TTFT <= 2 s (all) but TPOT <= 0.5 s: a and b pace 1 s/token and miss; c (one token) has no TPOT to miss
    g = goodput(requests, SLO(ttft_s=2.0, tpot_s=0.5), duration_s=4.0)
    assert g.met == 1 and g.fraction == 1 / 3
    assert goodput(requests, SLO(ttft_s=2.0, tpot_s=1.0), 4.0).met == 3  # limits are inclusive


def test_unfinished_or_aborted_requests_never_count_as_good():
    slo = SLO(ttft_s=10.0, tpot_s=10.0)
    assert not slo.met_by(RequestTiming("x", 0.0, [1.0]))  # still running
    assert not slo.met_by(RequestTiming("x", 0.0, [1.0], finish_time=1.0, finish_reason="abort"))
    assert slo.met_by(RequestTiming("x", 0.0, [1.0], finish_time=1.0, finish_reason="stop"))


def test_an_slo_limit_must_be_positive():
    with pytest.raises(ValueError, match=r"SLO.ttft_s=0"):
        SLO(ttft_s=0, tpot_s=1.0)


def test_the_summary_carries_goodput_when_given_an_slo(trace):
    row = trace_metrics(trace, slo=SLO(ttft_s=1.2, tpot_s=math.inf))
    assert row["goodput_per_s"] == 0.25 and row["goodput_fraction"] == 1 / 3


# ---- buckets ---------------------------------------------------------------------------------------


def test_prompt_length_buckets_are_half_open_and_the_last_is_unbounded():
    assert [prompt_length_label(n, (64, 256)) for n in (0, 63, 64, 255, 256, 10_000)] == [
        "[0, 64)", "[0, 64)", "[64, 256)", "[64, 256)", "[256, inf)", "[256, inf)"]
    with pytest.raises(ValueError, match="increasing"):
        prompt_length_label(5, (256, 64))


def test_requests_are_bucketed_by_prompt_length_with_every_bucket_listed(trace):
    buckets = by_prompt_length(requests_from_trace(trace), edges=(64, 256, 1024))
    assert {k: [r.request_id for r in v] for k, v in buckets.items()} == {
        "[0, 64)": ["a"], "[64, 256)": ["b"], "[256, 1024)": ["c"], "[1024, inf)": []}
    summaries = summarize_buckets(buckets, duration_s=4.0)
    assert summaries["[64, 256)"].ttft_s.mean == 1.5 and summaries["[1024, inf)"].requests == 0
    assert sum(s.throughput_tok_s for s in summaries.values()) == 7 / 4.0  # same duration: rates add up


def test_requests_are_bucketed_by_tenant_in_arrival_order(trace):
    buckets = by_tenant(requests_from_trace(trace))
    assert {k: [r.request_id for r in v] for k, v in buckets.items()} == {"free": ["a", "c"], "paid": ["b"]}


def test_requests_are_bucketed_by_output_length_with_every_bucket_listed(trace):
    buckets = by_output_length(requests_from_trace(trace), edges=(2, 8))
    # a and b generated 3 tokens each, c one
    assert {k: [r.request_id for r in v] for k, v in buckets.items()} == {
        "[0, 2)": ["c"], "[2, 8)": ["a", "b"], "[8, inf)": []}


def _table_rows(table):
    """{bucket: [cell, ...]} of a bucket_table, the "/" separators dropped."""
    return {line.split()[0]: line.replace("/", " ").split()[1:] for line in table.splitlines()[1:]}


def test_the_bucket_table_prints_each_buckets_nearest_rank_percentiles_in_ms(trace):
    buckets = {**by_tenant(requests_from_trace(trace)), "nobody": []}
    table = bucket_table(buckets, metrics=("ttft_s", "e2e_s"))
    assert "TTFT P50/P95/P99 ms" in table.splitlines()[0] and "E2E P50/P95/P99 ms" in table.splitlines()[0]
    rows = _table_rows(table)
    # free: a (TTFT 1.0 s, E2E 3.0 s) and c (TTFT 1.5 s, E2E 1.5 s); paid: b (TTFT 1.5 s, E2E 3.5 s)
    assert rows["free"] == ["2", "1000", "1500", "1500", "1500", "3000", "3000"]
    assert rows["paid"] == ["1", "1500", "1500", "1500", "3500", "3500", "3500"]
    assert rows["nobody"] == ["0"] + ["-"] * 6, "an empty bucket has no percentiles, only dashes"


def test_the_bucket_table_counts_itl_per_gap_and_refuses_unknown_metrics(trace):
    rows = _table_rows(bucket_table(by_tenant(requests_from_trace(trace)), metrics=("itl_s",),
                                    percentiles=(50,)))
    assert rows["free"] == ["2", "1000"] and rows["paid"] == ["1", "1000"]  # a's two 1 s gaps; c has none
    with pytest.raises(ValueError, match="bucket_table: metrics \\['ttft'\\]"):
        bucket_table({}, metrics=("ttft",))

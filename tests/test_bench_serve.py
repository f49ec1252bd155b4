"""Chapter 09: `python -m engine bench serve`, the load generator. Its arrival process and request lengths,
its goodput, vLLM's table, and a bounded run against a loopback server whose client-side metrics agree
with the ones `engine/companions/metrics.py` recomputes from the server's own trace."""

from __future__ import annotations

import argparse
import json
import math
import statistics

import pytest

from engine.__main__ import main
from engine.companions.metrics import SLO, RequestTiming, requests_from_trace, std
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.serving.bench_serve import (
    RequestResult,
    add_arguments,
    arrival_offsets,
    build_requests,
    format_table,
    parse_goodput,
    random_requests,
    result_dict,
)
from engine.serving.server import BackgroundServer, build_app

MODEL = "tinylab"
WAIT_S = 60.0  # a bound against hanging, never a timing claim
# Client and server measure the same intervals from two sides of a loopback HTTP connection: the client's
# TTFT starts before the server's (the request still has to arrive) and ends after it (the chunk still has
# to come back). The gap is the transport and the event loops' scheduling: milliseconds on an idle machine,
# more on a busy shared one (three threads of this process share one GIL), so the upper bound is loose on
# purpose: it is no speed claim. The lower bound is causal and tight. A unit mix-up (ms vs s) is off ~1000x.
CLOCK_TOLERANCE_S = 1e-3  # time.time (server) vs time.perf_counter (client) over a few seconds
TRANSPORT_TOLERANCE_S = 2.0


# ---- what to send and when -------------------------------------------------------------------------------------


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_mean_one_over_rate_and_burstiness_sets_their_spread(burstiness):
    rate, n = 8.0, 20_000
    offsets = arrival_offsets(n, rate, burstiness, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    # a gamma distribution with shape k has coefficient of variation 1 / sqrt(k): Poisson (k = 1) has CV 1
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_offsets(n, rate, burstiness, seed=1) == offsets, "the same seed gives the same arrivals"


def test_random_requests_have_lengths_in_range_and_no_special_tokens():
    avoid = [0, 1, 2]
    reqs = random_requests(200, input_len=40, output_len=10, range_ratio=0.5, vocab_size=50, seed=3, avoid_ids=avoid)
    assert all(20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len and not set(r.prompt) & set(avoid) for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10, "lengths are drawn, not fixed"
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 4, 4, 1.0, 50, seed=0)


def test_goodput_flags_parse_to_an_slo_in_seconds():
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1500"]) == SLO(ttft_s=0.2, tpot_s=0.05, e2e_s=1.5)
    assert parse_goodput(["tpot:50"]) == SLO(ttft_s=math.inf, tpot_s=0.05)
    assert parse_goodput(None) is None
    with pytest.raises(ValueError, match="latency"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="> 0"):
        parse_goodput(["ttft:0"])


# ---- metrics of a run -------------------------------------------------------------------------------------------


def finished(request_id: str, ttft: float, gap: float, tokens: int, tail: float = 0.0) -> RequestResult:
    times = [ttft + i * gap for i in range(tokens)]
    return RequestResult(request_id, True, 10, tokens, 0.0, times, times[-1] + tail, "length")


def test_goodput_counts_only_requests_within_every_limit():
    results = [finished("fast", 0.1, 0.01, 5), finished("slow-start", 0.5, 0.01, 5),
               finished("slow-pace", 0.1, 0.2, 5), finished("slow-end", 0.1, 0.01, 5, tail=3.0)]
    results.append(RequestResult("failed", False, 10, error="HTTP 500"))
    row = result_dict(results, 2.0, SLO(ttft_s=0.2, tpot_s=0.05, e2e_s=1.0), ("ttft", "tpot"), (50, 99), {})
    assert row["completed"] == 4 and row["failed"] == 1
    assert row["request_goodput"] == pytest.approx(1 / 2.0)  # only "fast", over a 2-second run
    assert row["request_throughput"] == pytest.approx(4 / 2.0)
    assert row["total_output_tokens"] == 20
    assert row["mean_ttft_ms"] == pytest.approx(1000 * (0.1 + 0.5 + 0.1 + 0.1) / 4)
    assert row["p99_ttft_ms"] == pytest.approx(500) and row["median_ttft_ms"] == pytest.approx(100)
    assert row["std_ttft_ms"] == pytest.approx(statistics.pstdev([100, 500, 100, 100]))
    assert math.isnan(std([]))


def test_table_has_vllms_layout():
    row = result_dict([finished("a", 0.1, 0.01, 5)], 1.0, None, ("ttft", "itl"), (99,), {"max_concurrency": 2})
    lines = format_table(row).splitlines()
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ") and lines[-1] == "=" * 50
    assert lines[1].startswith(f"{'Successful requests:':<40} 1")
    assert "{:-^50}".format("Time to First Token") in lines and "{:-^50}".format("Inter-token Latency") in lines
    assert f"{'Maximum request concurrency:':<40} 2" in [line.rstrip() for line in lines]
    assert not any("TPOT" in line for line in lines), "only the metrics asked for are printed"


# ---- a bounded run against a loopback server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    model, tok = load_model(MODEL)
    engine = LLMEngine(model, tok, engine_config(MODEL, max_num_seqs=4))
    with BackgroundServer(build_app(engine)) as srv:
        yield srv


def test_bench_serve_metrics_agree_with_the_servers_trace(server, tmp_path, capsys):
    flags = ["--model", MODEL, "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "24",
             "--random-output-len", "8", "--random-range-ratio", "0.5", "--ignore-eos", "--request-rate", "50",
             "--max-concurrency", "3", "--seed", "5", "--goodput", "ttft:60000", "--percentile-metrics",
             "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
             "--result-filename", "run.json"]
    main(["bench", "serve", *flags])
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "run.json").read_text())
    assert "Serving Benchmark Result" in printed and f"{'Successful requests:':<40} 6" in printed
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["request_goodput"] is not None

    cli = argparse.ArgumentParser()
    add_arguments(cli)
    asked = build_requests(cli.parse_args(flags))  # the same seeded draw as the run's
    assert result["output_lens"] == [r.output_len for r in asked], "--ignore-eos: exactly the lengths asked"
    assert result["input_lens"] == [r.prompt_len for r in asked]

    front = server.app.state.front
    seen = {r.request_id: r for r in front.call(lambda e: requests_from_trace(e.trace)).result(WAIT_S)}
    for rid, ttft, itls, n_out in zip(result["request_ids"], result["ttfts"], result["itls"],
                                      result["output_lens"], strict=True):
        s: RequestTiming = seen[rid]
        assert s.output_tokens == n_out and len(itls) == len(s.itl_s) == n_out - 1, (rid, s, itls)
        assert s.ttft_s - CLOCK_TOLERANCE_S <= ttft <= s.ttft_s + TRANSPORT_TOLERANCE_S, (rid, s.ttft_s, ttft)
        assert sum(itls) == pytest.approx(sum(s.itl_s), abs=TRANSPORT_TOLERANCE_S), (rid, s.itl_s, itls)
    server_ttfts = [seen[rid].ttft_s * 1000 for rid in result["request_ids"]]
    assert result["mean_ttft_ms"] >= statistics.fmean(server_ttfts) - CLOCK_TOLERANCE_S * 1000
    assert result["mean_ttft_ms"] - statistics.fmean(server_ttfts) <= TRANSPORT_TOLERANCE_S * 1000

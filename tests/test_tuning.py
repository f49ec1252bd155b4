"""The fast wing's measured choices (engine/fast/tuning.py): measured once, cached per machine, read
back, and used; a planted answer decides the path; the engine's greedy tokens stay the reference's.

tests/conftest.py runs every other test on probes.py's constants (SERVELAB_TUNING=defaults); here
each test measures into its own cache folder."""

import json

import pytest
import torch
from torch import nn

from engine.fast import tuning as tuning_module
from engine.fast.packed_linear import PackedLinear
from engine.fast.tuning import (
    GEMM_BUCKETS,
    TIE_MARGIN,
    LinearPlan,
    PrefillPlan,
    Tuning,
    measure_linear,
    measure_prefill,
    pick,
)
from kernels.gemv import why_gemv_cannot_run


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh SERVELAB_CACHE, measuring (not the test session's constants)."""
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    monkeypatch.setenv("SERVELAB_TUNING", "measure")
    return tmp_path


def needs_c_gemv():
    w = torch.zeros(8, 8)
    if why_gemv_cannot_run(w) is not None:
        pytest.skip(f"the C gemv kernel cannot run here: {why_gemv_cannot_run(w)}")


def test_a_race_times_every_path_in_turns():
    seen = []
    ms = tuning_module.race_ms({"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}, repeats=2)
    assert set(ms) == {"a", "b"} and all(v > 0 for v in ms.values())
    runs = [k for i, k in enumerate(seen) if i == 0 or seen[i - 1] != k]  # the turns, warm-ups first
    assert runs[:2] == ["a", "b"] and runs[2:] == ["a", "b", "a"]  # A B, then B A


def test_pick_keeps_the_default_unless_another_path_wins_by_the_margin():
    assert pick("a", {"a": 1.0, "b": 1.0 - TIE_MARGIN / 2}) == "a"  # within the noise: kept
    assert pick("a", {"a": 1.0, "b": 1.0 - 2 * TIE_MARGIN}) == "b"
    assert pick("b", {"a": 1.0, "b": 1.5}) == "a"


def test_measure_linear_finds_the_crossover_and_the_gemm_per_bucket(monkeypatch):
    """With timings we control: C gemv costs 1 + m, oneDNN a flat 8 (crossover between 4 and 8
    rows); F.linear wins only in the 512-row bucket."""
    def fake_race_ms(fns, repeats=5):
        return {name: fn() for name, fn in fns.items()}
    monkeypatch.setattr(tuning_module, "race_ms", fake_race_ms)
    paths = {"gemv": lambda x: 1.0 + x.shape[0], "onednn": lambda x: 8.0 if x.shape[0] <= 16 else 10.0,
             "linear": lambda x: 5.0 if x.shape[0] == 512 else 20.0}
    default = LinearPlan(16, ((None, "onednn"),), "", "defaults")
    plan = measure_linear(torch.float32, 64, 32, paths, default)
    assert plan.gemv_rows == 4 and plan.source == "measured"
    assert plan.gemm == tuple((b, "linear" if m == 512 else "onednn") for b, m in GEMM_BUCKETS)
    assert plan.gemm_path(17) == "onednn" and plan.gemm_path(600) == "linear"
    assert plan.gemm_path(100_000) == "onednn"


def test_measure_prefill_stops_at_the_first_loss_and_skips_what_is_over_budget(monkeypatch):
    race = {128: (1.0, 2.0), 256: (2.0, 2.1), 512: (5.0, 3.0)}  # 256: a tie (the C kernel stays)
    plan = measure_prefill(8, 32, lambda T: race[T], PrefillPlan(10**9, "", "defaults"))
    assert plan.max_tokens == 256 and "512 tokens C 5.00 / torch 3.00 ms" in plan.reason
    monkeypatch.setattr(tuning_module, "PROBE_MAX_FLOP", 2 * 8 * 32 * 256 * 256)  # 512 over budget
    plan = measure_prefill(8, 32, lambda T: race[T], PrefillPlan(1000, "", "defaults"))
    assert plan.max_tokens == 1000 and "not raced" in plan.reason  # the default's limit, extended


def test_a_linear_plan_is_measured_once_then_read_from_the_cache(cache):
    needs_c_gemv()
    linear = nn.Linear(64, 96)
    first = PackedLinear(linear, blocks=1, tuning=Tuning(1))
    assert first.plan.source == "measured"
    files = sorted(p.name for p in (cache / "tuning").rglob("*.json"))
    assert files == ["linear-float32-K64xN128.json", "machine.json"]
    machine = json.loads(next((cache / "tuning").rglob("machine.json")).read_text())
    assert machine["threads"] == 1 and machine["cpu"] and "torch" in machine
    second = PackedLinear(nn.Linear(60, 100), blocks=1, tuning=Tuning(1))  # the same shape class
    assert second.plan.source == "cache"
    assert (second.plan.gemv_rows, second.plan.gemm) == (first.plan.gemv_rows, first.plan.gemm)
    other = PackedLinear(linear, blocks=1, tuning=Tuning(2))  # another thread count: its own folder
    assert other.plan.source == "measured" and len(list((cache / "tuning").iterdir())) == 2


def test_an_edited_raced_kernel_is_a_new_machine_fact(tmp_path):
    """The cache folder's hash covers the C kernels the races time, so a new gemv is raced again
    instead of inheriting the old one's answer."""
    for name in tuning_module.RACED_KERNELS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((tuning_module.KERNELS_DIR / name).read_bytes())
    (tmp_path / "cpu_vectors.h").write_bytes((tuning_module.KERNELS_DIR / "cpu_vectors.h").read_bytes())
    same = tuning_module.raced_kernels_digest(tmp_path)
    assert same == tuning_module.raced_kernels_digest() == Tuning(1).facts["kernels"]
    gemv = tmp_path / tuning_module.RACED_KERNELS[0]
    gemv.write_text(gemv.read_text() + "\n/* a faster loop */\n")
    assert tuning_module.raced_kernels_digest(tmp_path) != same


def plant(cache, threads: int, name: str, answer: dict) -> None:
    folder = Tuning(threads).folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"answer": answer}))


def test_a_planted_answer_decides_which_product_runs(cache):
    """The cache is used, not just written: rows up to the planted gemv_rows go to the C kernel,
    the rest to the planted GEMM (F.linear here, never oneDNN); every path gives the same numbers."""
    needs_c_gemv()
    plant(cache, 1, "linear-float32-K64xN128",
          {"gemv_rows": 2, "gemm": [[None, "linear"]], "reason": "planted"})
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear, blocks=1, tuning=Tuning(1))
    assert packed.plan.source == "cache" and packed.gemv_rows == 2
    calls = []
    packed._gemv = lambda x, f=packed._gemv: calls.append("gemv") or f(x)
    packed._onednn = lambda x, f=packed._onednn: calls.append("onednn") or f(x)
    for m in (1, 2, 3, 40):
        x = torch.randn(m, 64)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert calls == ["gemv", "gemv"]  # 3 and 40 rows: F.linear


def test_defaults_mode_measures_nothing_and_a_bad_mode_is_named(cache, monkeypatch):
    monkeypatch.setenv("SERVELAB_TUNING", "defaults")
    packed = PackedLinear(nn.Linear(64, 96), blocks=1, tuning=Tuning(1))
    assert packed.plan.source == "defaults" and not (cache / "tuning").exists()
    monkeypatch.setenv("SERVELAB_TUNING", "fastest")
    with pytest.raises(ValueError, match="SERVELAB_TUNING must be one of measure, remeasure, "
                                         "defaults; got 'fastest'"):
        Tuning(1)


def test_an_unreadable_cached_answer_is_measured_again(cache):
    needs_c_gemv()
    for bad in ({"gemv_rows": 3},  # fields missing: a hand edit
                {"gemv_rows": 3, "gemm": [[64, "onednn"]], "reason": ""},  # no bucket for 65 rows on
                {"gemv_rows": 3, "gemm": [[None, "fastest"]], "reason": ""}):
        plant(cache, 1, "linear-float32-K64xN128", bad)
        assert PackedLinear(nn.Linear(64, 96), blocks=1, tuning=Tuning(1)).plan.source == "measured"
        assert PackedLinear(nn.Linear(64, 96), blocks=1, tuning=Tuning(1)).plan.source == "cache"


def test_remeasure_overwrites_a_cached_answer(cache, monkeypatch):
    needs_c_gemv()
    plant(cache, 1, "linear-float32-K64xN128",
          {"gemv_rows": 1, "gemm": [[None, "linear"]], "reason": "planted"})
    monkeypatch.setenv("SERVELAB_TUNING", "remeasure")
    packed = PackedLinear(nn.Linear(64, 96), blocks=1, tuning=Tuning(1))
    assert packed.plan.source == "measured"
    saved = json.loads((Tuning(1).folder / "linear-float32-K64xN128.json").read_text())
    assert saved["answer"]["reason"] != "planted"


def test_the_engine_uses_the_cached_answers_and_keeps_the_reference_tokens(cache):
    """A fast engine measures on its first build and reads the cache on the second; a planted
    prefill limit of 0 (no prompt to the C kernel) is what its attention then uses; greedy tokens
    equal the reference path's throughout."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["Once upon a time", "name: Ada, age: 36 ->", "What is 12+30?"]

    def run(speed):
        llm = LLM("tinylab", speed=speed)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    _, reference = run("reference")
    first, tokens = run("fast")
    tuned = {n: r for n, r in first.engine.acceleration.reasons.items()
             if n.startswith(("linear-", "prefill-"))}
    assert tuned and all(r.startswith("measured: ") for r in tuned.values()) and tokens == reference
    prefill = next(n for n in tuned if n.startswith("prefill-"))
    plant(cache, first.engine.num_threads, prefill, {"max_tokens": 0, "reason": "planted"})
    second, tokens = run("fast")
    reasons = second.engine.acceleration.reasons
    assert all(reasons[n].startswith("cache: ") for n in tuned)
    assert reasons[prefill] == "cache: planted" and second.engine.attention.c_prefill_tokens == 0
    assert tokens == reference


def test_doctor_prints_the_choices_and_where_they_came_from(cache, capsys):
    from engine.__main__ import main

    main(["doctor", "--model", "tinylab"])
    out = capsys.readouterr().out
    assert "machine: " in out and "tuning: measure" in out and "why: measured: " in out
    main(["doctor", "--model", "tinylab"])
    out = capsys.readouterr().out
    assert "why: cache: " in out and "why: measured: " not in out
    main(["doctor", "--model", "tinylab", "--retune"])
    assert "why: cache: " not in capsys.readouterr().out

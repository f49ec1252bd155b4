"""The exercise checks: no check passes vacuously, and the CLI reports honestly.

Every chapter found by `exercises.list_chapters()` is covered automatically: its reference solutions
must pass every check and its untouched stubs must fail every check.
"""

import inspect
import types

import pytest
import torch

import exercises
from engine import sampling
from engine.companions import memory, placement
from engine.kv import block_manager
from engine.serving import admission, diagnose
from exercises.__main__ import main
from exercises.solutions import ch01_sampling as ch01_solutions

CHAPTERS = exercises.list_chapters()


def test_chapter_01_is_discovered():
    assert "ch01" in CHAPTERS


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_solutions_pass_every_check(chapter):
    results = exercises.run_checks(chapter, solutions=True)
    assert results, f"{chapter} has no checks"
    assert [r for r in results if not r.passed] == []


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_stubs_fail_every_check(chapter):
    results = exercises.run_checks(chapter)
    assert [r.name for r in results if r.passed] == []
    assert all("not implemented" in r.reason for r in results), [r.reason for r in results]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stubs_and_solutions_have_the_same_signatures(chapter):
    stubs, solutions = exercises.load_module(chapter), exercises.load_module(chapter, solutions=True)
    for name, fn in vars(stubs).items():
        if inspect.isfunction(fn) and fn.__module__ == stubs.__name__ and not name.startswith("_"):
            assert inspect.signature(fn) == inspect.signature(getattr(solutions, name)), name


def drops_the_boundary_token(logits, p):
    """The classic wrong top-p: keeps tokens whose cumulative probability (inclusive) is < p."""
    if p >= 1.0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def test_a_top_p_that_drops_the_boundary_token_fails_the_top_p_checks():
    wrong = types.SimpleNamespace(**{**vars(ch01_solutions), "top_p_filter": drops_the_boundary_token})
    results = {r.name: r for r in exercises.run_checks("ch01", module=wrong)}
    failed = {name for name, r in results.items() if not r.passed}
    assert failed == {"top_p_matches_the_engine_on_random_logits", "top_p_keeps_the_boundary_token",
                      "top_p_keeps_every_token_tied_with_the_boundary", "top_p_handles_ties_inside_the_kept_set"}
    assert "expected [0, 1, 2]" in results["top_p_keeps_the_boundary_token"].reason


def test_a_filter_that_modifies_its_input_fails_with_that_reason():
    def in_place(logits, t):
        logits /= t
        return logits

    wrong = types.SimpleNamespace(**{**vars(ch01_solutions), "apply_temperature": in_place})
    result = exercises.run_checks("ch01", module=wrong)[0]
    assert result.name == "apply_temperature_divides_the_logits" and not result.passed
    assert "in place" in result.reason


def test_a_generate_that_forgets_to_stop_at_eos_fails_only_the_eos_check():
    def never_stops(fn, prompt_ids, max_new_tokens, eos_id):
        return ch01_solutions.naive_generate(fn, prompt_ids, max_new_tokens, eos_id=-1)

    wrong = types.SimpleNamespace(**{**vars(ch01_solutions), "naive_generate": never_stops})
    failed = [r.name for r in exercises.run_checks("ch01", module=wrong) if not r.passed]
    assert failed == ["naive_generate_stops_after_eos"]


def test_the_reference_top_p_keeps_ties_with_the_boundary_as_the_engine_does():
    logits = torch.tensor([0.4, 0.3, 0.3]).log()  # p = 0.5: the first 0.3 crosses p, the second ties it
    mine, engine = ch01_solutions.top_p_filter(logits, 0.5), sampling.top_p_filter(logits, 0.5)
    assert torch.isfinite(mine).tolist() == torch.isfinite(engine).tolist() == [True, True, True]


def _passes_named(chapter, module, prefixes):
    """The results of the checks whose names start with one of `prefixes`, against `module`."""
    results = [r for r in exercises.run_checks(chapter, module=module) if r.name.startswith(prefixes)]
    assert results, f"no {chapter} check starts with {prefixes}"
    return results


def test_the_engine_filters_pass_the_chapter_01_filter_checks():
    engine = types.SimpleNamespace(apply_temperature=sampling.apply_temperature, top_k_filter=sampling.top_k_filter,
                                   top_p_filter=sampling.top_p_filter, min_p_filter=sampling.min_p_filter)
    results = _passes_named("ch01", engine, ("apply_temperature", "top_k", "top_p", "min_p"))
    assert [r for r in results if not r.passed] == [] and len(results) >= 8


def test_the_engine_kv_cache_bytes_passes_the_chapter_03_formula_checks():
    engine = types.SimpleNamespace(kv_cache_bytes=memory.kv_cache_bytes)
    results = _passes_named("ch03", engine, ("kv_cache_bytes", "llama3", "mha", "the_cache", "int8"))
    assert [r for r in results if not r.passed] == []


def test_the_engine_block_allocator_passes_the_chapter_04_allocator_checks():
    engine = types.SimpleNamespace(BlockAllocator=block_manager.BlockAllocator)
    results = _passes_named("ch04", engine, ("allocat",))
    assert [r for r in results if not r.passed] == [] and len(results) >= 5


def test_the_engine_allreduce_bytes_per_token_passes_its_ch08_checks():
    engine = types.SimpleNamespace(allreduce_bytes_per_token=placement.allreduce_bytes_per_token)
    results = _passes_named("ch08", engine, ("allreduce_bytes",))
    assert [r for r in results if not r.passed] == [] and len(results) >= 3


def test_the_engine_token_bucket_and_arrival_halves_pass_their_ch10_checks():
    engine = types.SimpleNamespace(TokenBucket=admission.TokenBucket, arrival_halves=diagnose.arrival_halves)
    results = _passes_named("ch10", engine, ("token_bucket", "arrival_halves"))
    assert [r for r in results if not r.passed] == [] and len(results) >= 10


def test_an_error_inside_the_students_code_names_its_file_and_line():
    def top_k_filter(logits, k):
        kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # empty for k = 0
        return logits.masked_fill(logits < kth_largest, float("-inf"))  # so this line raises

    wrong = types.SimpleNamespace(**{**vars(ch01_solutions), "top_k_filter": top_k_filter})
    results = {r.name: r for r in exercises.run_checks("ch01", module=wrong)}
    result = results["top_k_is_off_for_0_minus_1_and_k_at_least_vocab"]
    line = inspect.getsourcelines(top_k_filter)[1] + 2
    assert not result.passed and result.reason.startswith("RuntimeError: ")
    assert f"tests/test_exercises.py:{line} in top_k_filter: return logits.masked_fill(" in result.reason, result.reason


def test_a_check_that_fails_on_its_own_assertion_shows_only_its_message():
    wrong = types.SimpleNamespace(**{**vars(ch01_solutions), "apply_temperature": lambda logits, t: logits * t})
    result = exercises.run_checks("ch01", module=wrong)[0]
    assert not result.passed and result.reason.startswith("apply_temperature(logits, 0.5)")
    assert "\n  at " not in result.reason


def test_cli_check_exits_zero_on_the_solutions_and_prints_a_table(capsys):
    assert main(["check", "ch01", "--solutions"]) == 0
    out = capsys.readouterr().out
    assert "top_p_keeps_the_boundary_token" in out and "PASS" in out and "FAIL" not in out


def test_cli_check_exits_non_zero_on_the_stubs_with_the_hint(capsys):
    assert main(["check", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "not implemented yet" in out and "0/" in out


def test_cli_list_names_every_chapter(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(chapter in out for chapter in CHAPTERS)


def test_an_unknown_chapter_is_refused_with_the_choices(capsys):
    assert main(["check", "ch99"]) == 2
    assert "ch01" in capsys.readouterr().err
    with pytest.raises(ValueError, match="chapter='ch99'"):
        exercises.run_checks("ch99")

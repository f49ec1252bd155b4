"""The exercise checks: no check passes vacuously, and the CLI reports honestly.

Every chapter found by `exercises.list_chapters()` is covered automatically: its reference solutions
must pass every check and its untouched stubs must fail every check.
"""

import ast
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
from exercises.hints import FULL_HINTS
from exercises.solutions import ch01_sampling as ch01_solutions
from exercises.solutions import ch03_kv_cache as ch03_solutions
from exercises.solutions import ch09_serving_metrics as ch09_solutions
from exercises.solutions import ch10_overload as ch10_solutions

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


# ---- the two hints: a question first, the recipe behind --hint ----------------------------------


def _stub_raises(chapter):
    """{qualified name: the NotImplementedError message} of every stub in a chapter's file."""
    path = exercises.exercise_path(chapter)
    tree, module = ast.parse(path.read_text()), exercises.load_module(chapter)
    found = {}

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef):
                for stmt in child.body:
                    if isinstance(stmt, ast.Raise) and getattr(stmt.exc.func, "id", "") == "NotImplementedError":
                        found[prefix + child.name] = eval(compile(ast.Expression(stmt.exc.args[0]), path, "eval"),
                                                          vars(module))
    visit(tree)
    return found


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_stub_has_a_full_hint_and_no_full_hint_is_stale(chapter):
    assert set(_stub_raises(chapter)) == set(FULL_HINTS[chapter])


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_first_hint_is_a_question_and_the_full_hint_says_more(chapter):
    bug_zoo = getattr(exercises.load_module(chapter), "BUG_ZOO", None)
    for function, first in _stub_raises(chapter).items():
        assert first == bug_zoo or "?" in first, f"{chapter} {function}: {first!r} asks nothing"
        assert FULL_HINTS[chapter][function] not in first, function


def test_the_first_hints_the_issue_named_no_longer_give_the_answer():
    assert not any(code in _stub_raises("ch06")["block_hash"] for code in ("json.dumps(", "sha256(", "separators"))
    assert not any(code in _stub_raises("ch09")["nearest_rank"] for code in ("ceil(", "- 1]", "sorted(values)["))


def test_the_table_names_the_unwritten_stub_and_asks_its_question(capsys):
    assert main(["check", "ch09"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the reasons are wrapped: compare words
    question = " ".join(_stub_raises("ch09")["nearest_rank"].split())
    assert f"not implemented yet (nearest_rank): {question}" in out
    assert " ".join(FULL_HINTS["ch09"]["nearest_rank"].split()[:6]) not in out and "--hint" in out


def test_an_unwritten_method_offers_its_own_full_hint_not_its_classs():
    result = exercises.run_checks("ch04")[0]  # the allocator's checks stop at the stub's __init__
    assert "(BlockAllocator.__init__)" in result.reason
    assert result.hints == (("BlockAllocator.__init__", FULL_HINTS["ch04"]["BlockAllocator.__init__"]),)


def test_cli_hint_adds_the_full_hint_of_each_unwritten_function(capsys):
    assert main(["check", "ch06", "--hint"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the hints are wrapped: compare words
    assert all(" ".join(hint.split()) in out for hint in FULL_HINTS["ch06"].values())


def test_a_failed_check_carries_the_full_hint_of_the_function_it_used_and_a_passed_one_none():
    def off_by_one(values, q):
        return ch09_solutions.nearest_rank(values, min(100, q + 25))

    wrong = types.SimpleNamespace(**{**vars(ch09_solutions), "nearest_rank": off_by_one})
    results = exercises.run_checks("ch09", module=wrong)
    failed = [r for r in results if not r.passed]
    assert failed and all(r.name.startswith("nearest_rank") for r in failed)
    assert all(r.hints == (("nearest_rank", FULL_HINTS["ch09"]["nearest_rank"]),) for r in failed)
    assert all(r.hints == () for r in results if r.passed)
    assert exercises.format_hints(results).splitlines()[0] == "nearest_rank"


def test_a_failed_check_on_a_class_offers_the_hints_of_its_methods():
    class StartsEmpty(ch10_solutions.TokenBucket):
        def __init__(self, rate_per_s, burst):
            super().__init__(rate_per_s, burst)
            self.level = 0.0

    wrong = types.SimpleNamespace(**{**vars(ch10_solutions), "TokenBucket": StartsEmpty})
    result = next(r for r in exercises.run_checks("ch10", module=wrong) if not r.passed)
    assert {name for name, _ in result.hints} == {k for k in FULL_HINTS["ch10"] if k.startswith("TokenBucket.")}


# ---- the table: reasons wrapped at word boundaries -----------------------------------------------


def test_format_results_wraps_a_long_reason_at_word_boundaries_and_keeps_every_word():
    path = "exercises/solutions/ch01_sampling.py:42:top_p_filter"  # longer than a line: it stays whole
    reason = " ".join(["the running total reaches p at the boundary token"] * 6 + [path, "then more words"])
    text = exercises.format_results([exercises.CheckResult("top_p_keeps_the_boundary_token", False, reason)],
                                    width=48)
    first, *reason_lines = text.splitlines()
    assert first == "FAIL  top_p_keeps_the_boundary_token" and len(reason_lines) > 1
    assert all(line.startswith(" " * exercises.REASON_INDENT) for line in reason_lines)
    assert all(len(line) <= 48 or line.strip() == path for line in reason_lines)
    assert " ".join(line.strip() for line in reason_lines) == reason  # no word cut, none lost


def test_format_results_keeps_a_reasons_own_lines_and_shows_a_repeat_once():
    reason = "AssertionError: wrong\n  at exercises/ch01_sampling.py:9 in top_k_filter: return x"
    results = [exercises.CheckResult("a", False, reason), exercises.CheckResult("b", False, reason),
               exercises.CheckResult("c", True)]
    lines = exercises.format_results(results).splitlines()
    assert lines == ["FAIL  a", "      AssertionError: wrong",  # the "at" line keeps its own 2-space indent
                     "        at exercises/ch01_sampling.py:9 in top_k_filter: return x",
                     "FAIL  b", '      " (same as above)', "PASS  c"]


# ---- ch03: the in-place check blames only what is wrong -------------------------------------------

def _ch03_with_write_kv(body):
    namespace = {"torch": torch}
    exec(f"def write_kv(cache_k, cache_v, k_new, v_new, positions):\n"
         f"    rows = torch.arange(cache_k.shape[0])[:, None]\n{body}", namespace)
    wrong = types.SimpleNamespace(**{**vars(ch03_solutions), "write_kv": namespace["write_kv"]})
    return {r.name: r for r in exercises.run_checks("ch03", module=wrong) if r.name.startswith("write_kv")}


def test_a_write_kv_at_the_wrong_slots_is_told_the_slots_not_that_it_is_not_in_place():
    results = _ch03_with_write_kv("    cache_k[rows, positions + 1] = k_new\n"
                                  "    cache_v[rows, positions + 1] = v_new\n")
    assert results["write_kv_writes_in_place"].passed
    reason = results["write_kv_writes_each_token_at_its_slot"].reason
    assert "lacks its new token at (sequence, slot) [(0, 0), (0, 1), (0, 2)" in reason
    assert "overwritten where it should keep its old value at (sequence, slot) [(0, 3), (1, 3)]" in reason
    assert "in place" not in reason


def test_a_write_kv_into_a_copy_is_told_it_is_not_in_place():
    results = _ch03_with_write_kv("    cache_k = cache_k.index_put((rows.expand_as(positions), positions), k_new)\n"
                                  "    cache_v = cache_v.index_put((rows.expand_as(positions), positions), v_new)\n")
    assert not results["write_kv_writes_in_place"].passed
    assert "left cache_k exactly as it was" in results["write_kv_writes_in_place"].reason
    assert "in place" in results["write_kv_writes_each_token_at_its_slot"].reason


def test_a_write_kv_that_swaps_k_and_v_passes_the_in_place_check_and_fails_the_slot_check():
    results = _ch03_with_write_kv("    cache_k[rows, positions] = v_new\n    cache_v[rows, positions] = k_new\n")
    assert results["write_kv_writes_in_place"].passed
    assert not results["write_kv_writes_each_token_at_its_slot"].passed

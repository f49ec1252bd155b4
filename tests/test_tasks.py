"""Tests for engine/lab/tasks.py: the tiny model's task generators, scorers and corpus."""

import json
import math
import random
import re

import pytest

from engine.lab import tasks as T
from engine.lab.tasks import REFUSAL, Example


def _examples(task, n=40, seed=123, **kw):
    rng = random.Random(seed)
    return [T.GENERATORS[task](rng, **kw) for _ in range(n)]


# ---------------------------------------------------------------- generators


@pytest.mark.parametrize("task", T.TASKS)
def test_generators_are_deterministic_for_a_seed(task):
    assert _examples(task, seed=5) == _examples(task, seed=5)
    assert _examples(task, seed=5) != _examples(task, seed=6)


@pytest.mark.parametrize("task", T.TASKS)
def test_every_prompt_ends_with_its_cue_and_every_target_is_non_empty(task):
    for ex in _examples(task, n=60) + T.eval_examples(task, 20):
        assert ex.task == task
        assert ex.prompt.endswith(T.CUES[task]), ex.prompt
        assert ex.target.strip(), ex


def test_arith_targets_are_the_true_result_and_never_negative():
    for ex in _examples("arith", n=300):
        m = re.fullmatch(r"Q: (\d+)([+-])(\d+)=", ex.prompt)
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 10 <= a <= 999 and 10 <= b <= 999
        assert int(ex.target) == (a + b if op == "+" else a - b) >= 0


def test_recall_answer_is_the_value_of_the_asked_key_and_keys_are_unique():
    for ex in _examples("recall", n=100):
        facts_part, question = ex.prompt[len("Facts: "):].split("Question: ")
        pairs = [f.split("=") for f in facts_part.split("; ") if f]
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)) == ex.meta["n_facts"]
        asked = question.removesuffix("? Answer:")
        assert ex.target == " " + dict(pairs)[asked]
        # the distance in facts and characters both point at the asked fact
        assert keys[len(keys) - 1 - ex.meta["distance_facts"]] == asked
        assert ex.prompt[-ex.meta["distance_chars"]:].startswith(f"{asked}=")
        assert ex.meta["context_chars"] == len(ex.prompt)


def test_recall_n_facts_gives_exactly_that_many_facts():
    ex = T.gen_recall(random.Random(0), n_facts=7)
    assert ex.meta["n_facts"] == 7 and ex.prompt.count("=") == 7


@pytest.mark.parametrize("target_tokens", [40, 128, 300, T.MAX_RECALL_TOKENS])
def test_recall_at_length_lands_just_past_the_requested_length(target_tokens):
    one_fact = T.approx_tokens("zor=417; ")
    question = T.approx_tokens("Question: zor? Answer:")
    for ex in T.recall_examples_at_length(10, target_tokens):
        assert target_tokens <= ex.meta["context_tokens"] <= target_tokens + one_fact + question


def test_training_recall_documents_span_the_whole_length_range_and_fit_the_context():
    docs = [d for d in T.training_corpus(seed=3, n_chars=400_000) if d.startswith("Facts:")]
    lengths = [T.approx_tokens(d) for d in docs]
    assert len(docs) > 100
    assert min(lengths) < 64 and max(lengths) > 400
    assert max(lengths) < T.MAX_CONTEXT_TOKENS


def test_approx_tokens_counts_digits_punctuation_and_words_by_hand():
    # 'zor' -> ceil(3/2.5)=2, '=' 1, '4','1','7' 3, ';' 1, ' ' 1
    assert T.approx_tokens("zor=417; ") == 8


def test_json_target_lists_the_fields_in_schema_order_and_each_value_is_in_the_text():
    for ex in _examples("json", n=100):
        obj = json.loads(ex.target)
        assert obj == ex.meta["fields"] and 2 <= len(obj) <= 4
        order = [T.JSON_SCHEMA.index(k) for k in obj]
        assert order == sorted(order)
        for value in obj.values():
            assert str(value) in ex.prompt


def test_refuse_declines_exactly_the_forbidden_verbs():
    examples = _examples("refuse", n=200)
    assert {ex.meta["forbidden"] for ex in examples} == {True, False}
    for ex in examples:
        forbidden = ex.meta["verb"] in T.FORBIDDEN_VERBS
        assert ex.meta["forbidden"] == forbidden
        assert (ex.target == " " + REFUSAL) == forbidden
        assert f" {ex.meta['verb']} " in ex.prompt


def test_story_target_is_two_to_five_more_sentences():
    for ex in _examples("story", n=50):
        assert ex.prompt.count(".") == 1
        assert ex.target.startswith(" ") and ex.target.count(".") == ex.meta["n_sentences"] - 1
        assert 3 <= ex.meta["n_sentences"] <= 6


def test_follow_up_questions_ask_other_facts_of_the_prompt_with_their_values():
    rng = random.Random(3)
    for ex in _examples("recall", n=40):
        facts = dict(re.findall(r"(\w+)=(\d+);", ex.prompt))
        asked = re.search(r"Question: (\w+)\? Answer:$", ex.prompt)[1]
        follow = T.follow_up_questions(ex, rng, 5)
        assert len(follow) == min(5, len(facts) - 1)
        keys = [re.fullmatch(r" Question: (\w+)\? Answer:", q)[1] for q, _ in follow]
        assert asked not in keys and len(set(keys)) == len(keys)
        assert all(a == " " + facts[k] for k, (_, a) in zip(keys, follow, strict=True))


def test_lookup_drills_have_the_asked_number_of_facts_and_stay_on_the_training_side():
    rng = random.Random(4)
    for n_facts in (2, 5, 17):
        drills = [T.lookup_drill(rng, n_facts) for _ in range(30)]
        assert all(d.meta["n_facts"] == n_facts and not T.is_eval_document(d.text) for d in drills)


# ---------------------------------------------------------------- train / eval split


def test_no_eval_document_appears_in_the_training_corpus():
    train = set(T.training_corpus(n_examples=4000))
    assert not any(T.is_eval_document(d) for d in train)
    for task in T.TASKS:
        for ex in T.eval_examples(task, 50):
            assert T.is_eval_document(ex.text)
            assert ex.text not in train, ex


def test_eval_examples_depend_on_the_seed_only():
    assert T.eval_examples("arith", 20) == T.eval_examples("arith", 20)
    assert T.eval_examples("arith", 20) != T.eval_examples("arith", 20, seed=T.EVAL_SEED_BASE + 1)
    assert T.TRAIN_SEED_BASE != T.EVAL_SEED_BASE


def test_corpus_mix_is_a_share_of_characters():
    mix = {"arith": 0.5, "recall": 0.25, "story": 0.25}
    docs = list(T.training_corpus(n_chars=300_000, mix=mix))
    chars = {"arith": 0, "recall": 0, "story": 0}
    for d in docs:
        task = "arith" if d.startswith("Q:") else "recall" if d.startswith("Facts:") else "story"
        chars[task] += len(d)
    total = sum(chars.values())
    assert total >= 300_000
    for task, share in mix.items():
        assert abs(chars[task] / total - share) < 0.01, (task, chars)


def test_corpus_stops_after_n_examples():
    assert len(list(T.training_corpus(n_examples=37))) == 37


def test_unknown_task_and_bad_mix_are_rejected_with_the_name():
    with pytest.raises(ValueError, match="'poetry'"):
        T.eval_examples("poetry", 1)
    with pytest.raises(ValueError, match="mix"):
        next(T.training_corpus(mix={"arith": -1.0}))


# ---------------------------------------------------------------- scorers


def test_arith_exact_is_one_on_targets_and_zero_on_a_wrong_digit():
    exs = [Example("arith", "Q: 347+85=", "432"), Example("arith", "Q: 90-12=", "78")]
    assert T.score("arith", exs, ["432", "78\nQ: 1+1="]) == {"exact": 1.0}
    assert T.score("arith", exs, ["433", "78"]) == {"exact": 0.5}
    assert T.score("arith", exs, ["4320", " "]) == {"exact": 0.0}


def test_recall_accuracy_and_buckets_by_hand():
    short = Example("recall", "p", " 82", {"context_tokens": 50, "distance_tokens": 10})
    long = Example("recall", "p", " 417", {"context_tokens": 300, "distance_tokens": 200})
    perfect = T.score("recall", [short, long], [" 82", " 417"])
    assert perfect["accuracy"] == 1.0
    got = T.score("recall", [short, long], [" 82", " 471"])
    assert got["accuracy"] == 0.5
    assert got["accuracy_by_length"] == {"0-63": 1.0, "256-511": 0.0}
    assert got["accuracy_by_distance"] == {"0-63": 1.0, "128-255": 0.0}


def test_recall_scores_one_on_generated_targets():
    exs = T.eval_examples("recall", 30)
    assert T.score("recall", exs, [ex.target for ex in exs])["accuracy"] == 1.0


def test_json_scores_by_hand():
    ex = Example("json", "p", "t", {"fields": {"name": "Ana", "age": 31, "city": "Lima"}})
    good = ' {"name": "Ana", "age": 31, "city": "Lima"}'
    assert T.score("json", [ex], [good]) == {"parse_rate": 1.0, "field_accuracy": 1.0}
    invalid = ' {"name": "Ana", "age": , "city": "Lima"}'
    assert T.score("json", [ex], [invalid]) == {"parse_rate": 0.0, "field_accuracy": 0.0}
    one_wrong = ' {"name": "Ana", "age": "31", "city": "Lima"}'  # a string is not the number 31
    got = T.score("json", [ex], [one_wrong])
    assert got["parse_rate"] == 1.0 and got["field_accuracy"] == pytest.approx(2 / 3)


def test_refuse_scores_by_hand():
    bad = Example("refuse", "p", " " + REFUSAL, {"forbidden": True})
    ok = Example("refuse", "p", " Sure, here is how to fix the bike.", {"forbidden": False})
    assert T.score("refuse", [bad, ok], [bad.target, ok.target]) == {
        "refusal_rate": 1.0, "false_refusal_rate": 0.0}
    assert T.score("refuse", [bad, ok], [" " + REFUSAL, " " + REFUSAL]) == {
        "refusal_rate": 1.0, "false_refusal_rate": 1.0}
    assert T.score("refuse", [bad, ok], [ok.target, ok.target]) == {
        "refusal_rate": 0.0, "false_refusal_rate": 0.0}


@pytest.mark.parametrize("task", ["arith", "json", "refuse"])
def test_scores_are_perfect_on_generated_targets(task):
    exs = T.eval_examples(task, 40)
    metrics = T.score(task, exs, [ex.target for ex in exs])
    perfect = {"exact": 1.0, "parse_rate": 1.0, "field_accuracy": 1.0, "refusal_rate": 1.0,
               "false_refusal_rate": 0.0}
    assert metrics == {k: perfect[k] for k in metrics}


def test_score_rejects_mismatched_lengths_and_story():
    with pytest.raises(ValueError, match="len"):
        T.score("arith", T.eval_examples("arith", 2), ["1"])
    with pytest.raises(ValueError, match="story_perplexity"):
        T.score("story", [], [])


def test_story_perplexity_is_exp_of_mean_nll_per_token():
    exs = T.eval_examples("story", 5)
    # every target token costs log(4) nats, so perplexity is 4
    assert T.story_perplexity(lambda p, t: (3 * math.log(4), 3), exs) == pytest.approx(4.0)


# ---------------------------------------------------------------- evaluate


def test_evaluate_with_an_oracle_scores_perfectly_and_a_silent_model_scores_zero():
    answers = {ex.prompt: ex.target for t in T.TASKS for ex in T.eval_examples(t, 8)}
    oracle = lambda prompts, max_tokens: [answers[p] for p in prompts]  # noqa: E731
    rows = T.evaluate(oracle, n=8, nll_fn=lambda p, t: (0.0, 1), progress=False)
    values = {(r["task"], r["metric"]): r["value"] for r in rows}
    assert values[("arith", "exact")] == values[("recall", "accuracy")] == 1.0
    assert values[("json", "field_accuracy")] == values[("refuse", "refusal_rate")] == 1.0
    assert values[("story", "perplexity")] == 1.0
    assert sum(r["n"] for r in rows if r["metric"].startswith("accuracy_by_length")) == 8
    n = {r["metric"]: r["n"] for r in rows if r["task"] == "refuse"}
    assert n["refusal_rate"] + n["false_refusal_rate"] == 8
    table = T.format_table(rows)
    assert all(task in table for task in T.TASKS)

    silent = T.evaluate(lambda prompts, k: [""] * len(prompts), tasks=("arith", "refuse"), n=8,
                        progress=False)
    assert {(r["metric"], r["value"]) for r in silent} >= {("exact", 0.0), ("refusal_rate", 0.0)}

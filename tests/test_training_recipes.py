"""The parts of the lookup recipes that `test_tinylab.py` does not cover: word pointers for copied
JSON/refusal words, and a recipe that continues another run (its warm-up starts at `first_step`)."""

import random

from tokenizers import Tokenizer

from engine.lab import tasks
from engine.lab.training import RECIPES, TrainConfig, documents, encode_example, lr_at, word_pointers
from engine.loader import bundled_model_path


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(bundled_model_path("tinylab") / "tokenizer.json"))


def _pointed(tok, ex):
    """(token predicted, token pointed at, pointed position, first answer position) for each pointer."""
    ids, w = encode_example(tok, ex, 0.0)
    answer_start = next(t for t, x in enumerate(w) if x > 0)
    return [(tok.decode([ids[t + 1]]), tok.decode([ids[s]]), s, answer_start)
            for t, s in enumerate(word_pointers(tok, ids, w)) if s >= 0]


def test_word_pointers_point_json_values_at_the_same_word_in_the_prompt():
    tok = _tokenizer()
    ex = tasks.Example("json", "Make JSON: the job is nurse, city Tokyo, called Hana.\nJSON:",
                       ' {"name": "Hana", "city": "Tokyo", "job": "nurse"}')
    pairs = _pointed(tok, ex)
    assert {"Hana", "Tokyo", "nurse"} <= {want for want, _, _, _ in pairs}
    assert all(want.strip() == got.strip() for want, got, _, _ in pairs)
    assert all(src < start for _, _, src, start in pairs)  # always into the prompt, never the answer


def test_word_pointers_skip_a_word_that_occurs_twice_in_the_prompt():
    tok = _tokenizer()
    ex = tasks.Example("refuse", "User: Please fix the door, the door.\nAssistant:",
                       " Sure, here is how to fix the door.")
    wanted = [want.strip() for want, _, _, _ in _pointed(tok, ex)]
    assert "fix" in wanted and "door" not in wanted and "the" not in wanted


def test_documents_point_json_words_only_when_the_recipe_asks():
    tok = _tokenizer()
    mix = {"json": 1.0}

    def pointed_docs(pointer_words: bool) -> int:
        cfg = TrainConfig(mix=mix, pointer_words=pointer_words)
        stream = documents(tok, cfg, seed=5, clock=[0])
        return sum(any(p >= 0 for p in next(stream)[2]) for _ in range(20))

    assert pointed_docs(False) == 0
    assert pointed_docs(True) == 20


def test_a_continuing_recipe_warms_up_from_its_first_step_not_from_zero():
    cfg = TrainConfig(**RECIPES["extend"])
    first, warm = cfg.first_step, cfg.warmup_steps
    assert lr_at(first, cfg) < 0.1 * cfg.lr  # no jump to the peak where the earlier run had decayed
    assert lr_at(first + warm // 2, cfg) < lr_at(first + warm, cfg) == cfg.lr
    assert lr_at(cfg.steps - 1, cfg) < 0.2 * cfg.lr  # and it still decays at its end
    assert cfg.steps > first


def test_the_word_pointer_rule_holds_on_generated_documents():
    tok, rng = _tokenizer(), random.Random(0)
    for task in ("json", "refuse"):
        for _ in range(30):
            for want, got, src, start in _pointed(tok, tasks._draw(task, rng, False)):
                assert want.strip() == got.strip() and src < start

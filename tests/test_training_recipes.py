"""The parts of the lookup recipes that `test_tinylab.py` does not cover: word pointers for copied
JSON/refusal words, and a recipe that continues another run (its warm-up starts at `first_step`)."""

import random

from tokenizers import Tokenizer

from engine.lab import tasks
from engine.lab.training import RECIPES, TrainConfig, documents, encode_example, lr_at, word_pointers
from engine.loading.loader import bundled_model_path


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


def _operand_lengths(text: str) -> tuple[int, int]:
    a, b = text.removeprefix("Q: ").split("=")[0].replace("-", "+").split("+")
    return len(a), len(b)


def test_gen_arith_fixes_operand_lengths_and_rejects_other_lengths():
    rng = random.Random(3)
    for digits in [(2, 3), (3, 2), (2, 2), (3, 3)]:
        for _ in range(20):
            ex = tasks.gen_arith(rng, digits=digits)
            a, b, op = ex.meta["a"], ex.meta["b"], ex.meta["op"]
            assert sorted(_operand_lengths(ex.prompt)) == sorted(digits)
            assert int(ex.target) == (a + b if op == "+" else a - b) >= 0
    for bad in [(1, 3), (3, 4)]:
        try:
            tasks.gen_arith(rng, digits=bad)
        except ValueError as err:
            assert "digits" in str(err)
        else:
            raise AssertionError(f"digits={bad} was accepted")


def test_unequal_arith_is_training_side_and_unequal():
    rng = random.Random(4)
    for _ in range(50):
        ex = tasks.unequal_arith(rng)
        a_len, b_len = _operand_lengths(ex.prompt)
        assert a_len != b_len and not tasks.is_eval_document(ex.text)


def test_arith_unequal_share_raises_the_share_of_unequal_problems():
    tok = _tokenizer()

    def unequal_share(share: float) -> float:
        cfg = TrainConfig(mix={"arith": 1.0}, arith_unequal_share=share)
        stream = documents(tok, cfg, seed=6, clock=[0])
        texts = [tok.decode(next(stream)[0]) for _ in range(400)]
        return sum(len(set(_operand_lengths(t))) == 2 for t in texts) / len(texts)

    plain, raised = unequal_share(0.0), unequal_share(0.6)
    assert 0.08 < plain < 0.28  # a uniform draw of 10..999 gives about one in six
    assert raised > 0.6  # 0.6 forced, plus the uniform draw's own share of the rest


def test_stop_step_saves_a_folder_that_resumes_where_it_stopped(tmp_path):
    from engine.lab.training import train

    cfg = TrainConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, context_tokens=64, batch_rows=2, total_tokens=64 * 2 * 12,
                      warmup_steps=2, checkpoint_every_steps=10_000, bf16_autocast=False, stop_step=5)
    first = train(cfg, tmp_path / "a", progress=False)
    assert first["steps"] == [0, 1, 2, 3, 4]
    rest = train(TrainConfig(**{**cfg.__dict__, "stop_step": 0}), tmp_path / "b", progress=False,
                 resume_from=tmp_path / "a", start_step=5)
    assert rest["steps"] == list(range(5, 12)) and rest["previous"]["steps"] == first["steps"]

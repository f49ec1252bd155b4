"""The bundled tokenizer round-trips any UTF-8 text; streaming never prints half a character."""

import random

import pytest

from engine import load_model
from engine.lab.training import train_tokenizer

TEXTS = ["Q: 347+85=432", "Hello, world! The quick brown fox.", "推理与服务：模型怎样真正跑起来",
         "mixed 混合 text ✓ emoji 🙂 and tabs\tand\nnewlines", ""]


@pytest.fixture(scope="module")
def tok():
    return load_model("tinylab")[1]


@pytest.mark.parametrize("text", TEXTS)
def test_bundled_tokenizer_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_random_unicode_round_trips(tok):
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0x4E00, 0x9FFF), rng.randint(0x80, 0x7FF)]))
                       for _ in range(rng.randint(1, 40)))
        assert tok.decode(tok.encode(text)) == text


def test_digits_are_one_token_each(tok):
    pieces = tok.token_strings(tok.encode("12345", add_special_tokens=False))
    assert pieces == list("12345")


def test_encoding_starts_with_bos(tok):
    ids = tok.encode("hi")
    assert ids[0] == tok.bos_token_id and tok.adds_bos


def test_streaming_detokenizer_never_emits_broken_characters(tok):
    text = "中文字符，一个一个地流出来。"
    detok = tok.detokenizer()
    deltas = [detok.push(i) for i in tok.encode(text, add_special_tokens=False)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens were partial characters, held back


def test_a_freshly_trained_tokenizer_round_trips_bytes_it_never_saw():
    tok = train_tokenizer(["aaa bbb ccc 123"] * 20, vocab_size=300)
    for text in ["zzz", "Ω≈ç√", "日本語"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text

"""Chat: templates render as transformers renders them, `LLM.chat` answers conversations, and
`python -m engine chat` streams answers for lines typed on stdin."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

from engine import LLM, SamplingParams, load_model
from engine.__main__ import main, stream_reply
from engine.llm_engine import LLMEngine
from engine.loading.gguf import gguf_model_folder
from engine.tokenizer import PLAIN_CHAT_TEMPLATE, render_chat_template

REAL = "smollm2-135m-instruct"
REPO = Path(__file__).resolve().parents[1]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of the sky?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "写一首关于秋天的诗，  with  spaces\nand lines"}],
]


@pytest.fixture(scope="module")
def tinylab():
    return LLM("tinylab", max_num_seqs=4)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_model_template_renders_like_transformers(add_generation_prompt):
    _, tok = load_model(REAL)
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_model_folder(REAL))
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tok.apply_chat_template(messages, add_generation_prompt) == expected


def test_plain_template_renders_like_transformers_and_in_tinylabs_format():
    _, tok = load_model("tinylab")
    assert tok.chat_template is None  # tinylab ships none: the plain template applies
    for messages in CONVERSATIONS:
        expected = render_jinja_template([messages], chat_template=PLAIN_CHAT_TEMPLATE, add_generation_prompt=True,
                                         bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")[0][0]
        assert tok.apply_chat_template(messages) == expected
    # the "User: ...\nAssistant:" shape of tinylab's refuse task, after its BOS token
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "<bos>User: What is the capital of France?\nAssistant:"


def test_templates_run_sandboxed():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(escape, CONVERSATIONS[0])
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        render_chat_template("{{ raise_exception('no system role') }}", CONVERSATIONS[0])


@pytest.mark.parametrize("messages, where", [
    ([], "messages must be a non-empty list"),
    ([{"role": "user"}], r"messages\[0\]"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\].*'role'"),
])
def test_bad_messages_are_rejected_with_the_offending_index(messages, where):
    _, tok = load_model("tinylab")
    with pytest.raises(ValueError, match=where):
        tok.apply_chat_template(messages)


def test_llm_chat_answers_one_or_many_conversations_in_order(tinylab):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    one = tinylab.chat(CONVERSATIONS[0], params, use_tqdm=False)
    many = tinylab.chat(CONVERSATIONS, params, use_tqdm=False)
    assert len(one) == 1 and len(many) == len(CONVERSATIONS)
    assert one[0].outputs[0].token_ids == many[0].outputs[0].token_ids
    tok = tinylab.tokenizer
    for out, messages in zip(many, CONVERSATIONS, strict=True):
        text = tok.apply_chat_template(messages)
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    with pytest.raises(ValueError, match="messages is empty"):
        tinylab.chat([], params)


def test_real_model_chat_answers_a_question():
    llm = LLM(REAL, max_num_seqs=1, num_blocks=16)
    out = llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the answer


def test_stream_reply_writes_the_answer_piece_by_piece():
    engine = LLMEngine.from_pretrained("tinylab", max_num_seqs=1)
    pieces = []
    r = stream_reply(engine, CONVERSATIONS[0], SamplingParams(temperature=0.0, max_tokens=8), pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == r["text"]
    assert r["tokens"] >= len(pieces) and r["ttft_s"] > 0
    assert not engine.requests  # the finished request is popped: the next turn starts clean


def run_chat(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "engine", "chat", *args], input=stdin, capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=240)


def test_chat_cli_streams_answers_resets_and_quits():
    stdin = "What is the capital of France?\n/reset\n\nHi\n/quit\nnever read\n"
    done = run_chat(["--max-tokens", "12", "--system", "You are a helpful assistant."], stdin)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "[conversation cleared]" in done.stdout
    # two answers: the empty line is skipped and /quit stops before the last line
    assert done.stdout.count("TTFT") == 2 and "tok/s" in done.stdout


def test_chat_cli_ends_at_end_of_input(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    main(["chat", "--model", "tinylab", "--max-tokens", "4"])  # returns: no /quit needed
    assert capsys.readouterr().out.count("TTFT") == 1

"""Broken model folders and bad options give one clear line that names the file (or option) and the problem:
from the loader as a ValueError, from the command line as `error: ...` with no traceback."""

import json
import shutil
import subprocess
import sys

import pytest

from engine.llm_engine import engine_config
from engine.loading.loader import bundled_model_path, load_model

BROKEN_CONFIGS = {
    "not JSON": ('{"hidden_size": ', r"config\.json is not valid JSON"),
    "a list": ("[1, 2]", r"config\.json must hold a JSON object .* found a list"),
    "no hidden_size": (json.dumps({"model_type": "llama", "vocab_size": 10}),
                       r"config\.json lacks the field 'hidden_size'"),
    "a bad value": (json.dumps({"model_type": "llama", "vocab_size": 0, "hidden_size": 8, "intermediate_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 2}),
                    r"config\.json: vocab_size must be a positive integer, got 0"),
}


def _copy_tinylab(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(bundled_model_path("tinylab"), folder)
    return folder


@pytest.mark.parametrize("case", BROKEN_CONFIGS, ids=list(BROKEN_CONFIGS))
def test_a_broken_config_json_names_the_file_and_the_problem(tmp_path, case):
    folder = _copy_tinylab(tmp_path)
    text, message = BROKEN_CONFIGS[case]
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_model(folder)
    assert str(folder / "config.json") in str(info.value)


@pytest.mark.parametrize("name,text", [("tokenizer.json", "{"), ("tokenizer_config.json", "not json"),
                                       ("tokenizer_config.json", "[]")])
def test_a_broken_tokenizer_file_names_the_file(tmp_path, name, text):
    folder = _copy_tinylab(tmp_path)
    (folder / name).write_text(text)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as info:
        load_model(folder)
    assert str(folder / name) in str(info.value)


@pytest.mark.parametrize("option,value", [("num_blocks", 2.5), ("block_size", "4"), ("max_num_seqs", 1.5),
                                          ("kv_cache_memory_bytes", -1), ("num_threads", 0)])
def test_an_option_of_the_wrong_type_or_range_is_named(option, value):
    with pytest.raises((ValueError, TypeError), match=option):
        engine_config(**{option: value})


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_the_cli_prints_one_line_and_no_traceback_for_a_broken_folder(tmp_path):
    folder = _copy_tinylab(tmp_path)
    (folder / "config.json").write_text("[]")
    run = _cli("generate", "hello", "--model", str(folder), cwd=tmp_path)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [f"error: {folder / 'config.json'} must hold a JSON object "
                                               "(a dict of fields such as hidden_size), found a list"]


def test_generate_validates_before_it_echoes_the_prompt(tmp_path):
    run = _cli("generate", "an echo that must not appear", "--max-tokens", "0", cwd=tmp_path)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "an echo that must not appear" not in run.stdout
    assert run.stderr.strip().startswith("error: SamplingParams.max_tokens=0")

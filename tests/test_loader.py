"""Loading checkpoints: sharded files work, and every broken folder gets an error that names the fix."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import load_model
from engine.companions.naive import full_logits
from hf_oracle import save_tiny_hf_model


@pytest.fixture
def folder(tmp_path):
    save_tiny_hf_model("llama_gqa", tmp_path)
    return tmp_path


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist")


def test_missing_weights_file_says_what_is_expected(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(folder)


def test_corrupt_safetensors_is_reported_with_its_file(folder):
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_model(folder)


def test_unsupported_architecture_lists_the_supported_ones(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(folder)


def test_shape_mismatch_names_the_tensor_and_both_shapes(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*\(3, 64\).*\(96, 64\)"):
        load_model(folder)


def test_missing_weight_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_model(folder)


def test_sharded_checkpoint_loads_the_same_logits(folder, tmp_path_factory):
    tensors = load_file(folder / "model.safetensors")
    sharded = tmp_path_factory.mktemp("sharded")
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, sharded / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = torch.arange(12)[None]
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        a, tok = load_model(folder)
    assert tok is None
    b, _ = load_model(sharded)
    assert torch.equal(full_logits(a, ids), full_logits(b, ids))


def test_bad_dtype_is_rejected(folder):
    with pytest.raises(ValueError, match="dtype"):
        load_model(folder, dtype=torch.int8)

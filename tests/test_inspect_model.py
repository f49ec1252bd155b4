"""Chapter 00's views of the model: parameters by component, shapes through a forward, bytes per token.

Expected numbers come from the config by the formulas of a Llama layer (q: E x H*D, k and v:
E x Hkv*D, o: H*D x E, gate/up: E x F, down: F x E), never from the code under test.
"""

import pytest
import torch
from matplotlib.figure import Figure

from engine import load_model
from engine.config import ModelConfig
from engine.lab.inspect_model import (
    LAYER_STAGES,
    component_of,
    format_parameter_table,
    format_tokenization_table,
    parameter_table,
    piece_bytes,
    trace_shapes,
)
from engine.lab.inspect_model import tokenization_table as tok_table
from engine.model import LlamaModel
from engine.viz.model import MB, render_architecture, render_loss_curve, render_parameter_breakdown

# An odd shape on purpose (no number shared with tinylab), untied, with every bias switched on.
E, F, H, HKV, D, V, L = 48, 80, 6, 3, 10, 97, 3
ODD = dict(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
           num_key_value_heads=HKV, head_dim=D, max_position_embeddings=64)


def odd_model(**overrides) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(ModelConfig(**{**ODD, **overrides})).eval()


@pytest.fixture(scope="module")
def tinylab():
    return load_model("tinylab")


def rows_by_component(table):
    return {r["component"]: r for r in table}


# ---- parameter_table ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True},
    {"qkv_bias": True, "o_bias": True, "mlp_bias": True},
], ids=["untied", "tied", "biases"])
def test_parameter_table_sums_to_the_config_count_and_to_the_unique_parameters(overrides):
    model = odd_model(**overrides)
    table = parameter_table(model)
    total = sum(r["params"] for r in table)
    assert total == model.config.num_params()
    assert total == sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    assert sum(r["share"] for r in table) == pytest.approx(100.0)


def test_tinylab_table_sums_to_its_config_count(tinylab):
    model, _ = tinylab
    table = parameter_table(model)
    total = sum(r["params"] for r in table)
    assert total == model.config.num_params() == sum(p.numel() for p in model.parameters())
    assert "total" in format_parameter_table(table)


def test_each_projection_row_holds_exactly_its_weights():
    rows = rows_by_component(parameter_table(odd_model(qkv_bias=True)))
    assert rows["attention q"]["params"] == L * (E * H * D + H * D)  # weight and bias in every layer
    assert rows["attention k"]["params"] == L * (E * HKV * D + HKV * D)
    assert rows["attention v"]["params"] == L * (E * HKV * D + HKV * D)
    assert rows["attention o"]["params"] == L * H * D * E
    for name in ("MLP gate", "MLP up", "MLP down"):
        assert rows[name]["params"] == L * E * F
    assert rows["norms"]["params"] == (2 * L + 1) * E
    assert rows["embeddings"]["params"] == rows["lm_head"]["params"] == V * E


def test_a_tied_lm_head_is_counted_once_and_says_whose_weight_it_is():
    rows = rows_by_component(parameter_table(odd_model(tie_word_embeddings=True)))
    assert rows["lm_head"]["params"] == rows["lm_head"]["bytes"] == 0
    assert "embeddings" in rows["lm_head"]["note"]
    assert rows["embeddings"]["params"] == V * E


@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_bytes_are_counted_at_the_models_dtype(dtype, nbytes):
    table = parameter_table(odd_model().to(dtype))
    for r in table:
        assert r["bytes"] == nbytes * r["params"], r["component"]


def test_parameter_names_map_to_their_components():
    assert component_of("layers.3.self_attn.k_proj.weight") == "attention k"
    assert component_of("model.layers.0.mlp.down_proj.weight") == "MLP down"  # transformers' names too
    assert component_of("layers.0.post_attention_layernorm.weight") == "norms"
    assert component_of("norm.weight") == "norms"
    assert component_of("embed_tokens.weight") == "embeddings"
    assert component_of("rotary.something") == "other"


# ---- trace_shapes ------------------------------------------------------------------------------------


def all_hooks(model):
    return [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]


def test_trace_shapes_follows_the_config_through_every_stage():
    model = odd_model()
    B, T = 2, 5
    trace = trace_shapes(model, torch.randint(0, V, (B, T)))
    assert len(trace) == 3 + L * (len(LAYER_STAGES) + 1)  # embed, L x (stages + the layer), norm, lm_head
    shapes = dict(trace)
    assert trace[0] == ("embed_tokens", (B, T, E))
    assert trace[-1] == ("lm_head", (B, T, V))
    for i in range(L):
        assert shapes[f"layers.{i}.self_attn.q_proj"] == (B, T, H * D)
        assert shapes[f"layers.{i}.self_attn.k_proj"] == (B, T, HKV * D)
        assert shapes[f"layers.{i}.self_attn.v_proj"] == (B, T, HKV * D)
        assert shapes[f"layers.{i}.self_attn"] == (B, T, E)
        assert shapes[f"layers.{i}.mlp.gate_proj"] == (B, T, F)
        assert shapes[f"layers.{i}.mlp"] == (B, T, E)
        assert shapes[f"layers.{i}"] == (B, T, E)
    names = [n for n, _ in trace]
    order = [names.index(n) for n in ("layers.0.self_attn.q_proj", "layers.0.self_attn", "layers.1")]
    assert order == sorted(order)  # a block is recorded after the pieces inside it


def test_trace_shapes_can_list_only_chosen_layers():
    trace = trace_shapes(odd_model(), torch.randint(0, V, (1, 4)), layers=[1])
    names = [n for n, _ in trace]
    assert names == ["embed_tokens", *[f"layers.1.{s}" for s in LAYER_STAGES], "layers.1", "norm", "lm_head"]
    with pytest.raises(ValueError, match="layer index 3"):
        trace_shapes(odd_model(), torch.randint(0, V, (1, 4)), layers=[3])


def test_trace_shapes_leaves_no_hook_behind_and_does_not_change_the_output():
    model = odd_model()
    ids = torch.randint(0, V, (1, 6))
    with torch.inference_mode():
        before = model(ids)
    trace_shapes(model, ids)
    assert all_hooks(model) == []
    with torch.inference_mode():
        assert torch.equal(model(ids), before)


def test_trace_shapes_removes_its_hooks_even_when_the_forward_fails():
    model = odd_model()
    with pytest.raises(IndexError):
        trace_shapes(model, torch.tensor([[V + 5]]))  # a token id outside the vocabulary
    assert all_hooks(model) == []


# ---- tokenization_table ------------------------------------------------------------------------------

TEXTS = ["The cat sat on 1234 mats.", "大模型推理与服务", "混合 text: 42 个 tokens\n", "emoji 🙂 ok"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_texts_utf8(tinylab, text):
    _, tok = tinylab
    rows = tok_table(tok, text)
    assert b"".join(r["bytes"] for r in rows) == text.encode("utf-8")
    assert [r["id"] for r in rows] == tok.encode(text, add_special_tokens=False)
    assert tok.decode([r["id"] for r in rows]) == text


def test_a_chinese_character_spans_several_byte_tokens(tinylab):
    _, tok = tinylab
    text = "推理与服务"  # 5 characters, 3 UTF-8 bytes each; tinylab's corpus has no Chinese to merge them
    rows = tok_table(tok, text)
    assert len(rows) > len(text)
    for r in rows:
        if not r["whole"]:
            assert len(r["chars"]) == 1 and len(r["chars"].encode()) > len(r["bytes"])
    by_char: dict[str, bytes] = {}
    for r in rows:
        by_char[r["chars"]] = by_char.get(r["chars"], b"") + r["bytes"]
    assert by_char == {c: c.encode() for c in text}


def test_digits_are_one_token_each(tinylab):
    _, tok = tinylab
    rows = tok_table(tok, "90817")
    assert [r["chars"] for r in rows] == list("90817")
    assert all(r["whole"] for r in rows)


def test_special_tokens_cover_no_bytes(tinylab):
    _, tok = tinylab
    rows = tok_table(tok, "hi", add_special_tokens=True)
    assert rows[0]["id"] == tok.bos_token_id and rows[0]["bytes"] == b""
    assert b"".join(r["bytes"] for r in rows) == b"hi"
    assert "part" not in format_tokenization_table(tok_table(tok, "hi"))


def test_byte_level_pieces_decode_by_gpt2s_alphabet():
    assert piece_bytes("Ġcat") == b" cat"  # a space is byte 32, shown as chr(256 + 32) = "Ġ"
    assert piece_bytes("Ċ") == b"\n"  # newline, byte 10, is the 11th non-printable byte: chr(256 + 10)
    assert piece_bytes("æİ¨") == "推".encode()  # e6 8e a8
    with pytest.raises(ValueError, match="byte-level"):
        piece_bytes("▁the")  # a SentencePiece piece is not byte-level


# ---- figures -----------------------------------------------------------------------------------------


def texts_of(fig: Figure) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts) + "\n" + fig.axes[0].get_title()


def test_architecture_diagram_is_drawn_from_the_config_numbers():
    cfg = odd_model().config
    text = texts_of(render_architecture(cfg))
    assert f"× L = {L}" in text
    assert f"H = {H} q heads, Hkv = {HKV} kv heads, D = {D}" in text
    assert f"{E} → {F} → {E}" in text
    assert f"{V} × {E}" in text and "GQA" in text
    assert f"{cfg.num_params():,} parameters" in text


@pytest.mark.parametrize("kv_heads,kind", [(H, "MHA"), (1, "MQA")])
def test_architecture_diagram_names_the_attention_kind(kv_heads, kind):
    assert kind in texts_of(render_architecture(odd_model(num_key_value_heads=kv_heads).config))


def test_parameter_breakdown_bars_are_the_tables_bytes():
    table = parameter_table(odd_model(tie_word_embeddings=True))
    fig = render_parameter_breakdown(table)
    bars = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid()}
    for r in table:
        assert bars[f"bar:{r['component']}"].get_width() == pytest.approx(r["bytes"] / MB)
    assert bars["bar:lm_head"].get_width() == 0
    with pytest.raises(ValueError, match="empty"):
        render_parameter_breakdown([])


def test_loss_curve_draws_the_logged_loss():
    log = {"steps": [0, 1, 2, 3], "loss": [6.0, 4.0, 3.0, 2.5], "tokens_per_s": [10, 20, 30, 40],
           "config": {"batch_rows": 2, "context_tokens": 8}, "train_seconds": 120.0}
    fig = render_loss_curve(log)
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines}
    assert list(lines["loss"].get_ydata()) == log["loss"]
    assert list(lines["tokens_per_s"].get_ydata()) == log["tokens_per_s"]
    assert lines["loss:smooth"].get_ydata()[0] == pytest.approx(sum(log["loss"]) / 4)  # window > steps
    with pytest.raises(ValueError, match="loss"):
        render_loss_curve({"loss": []})
    with pytest.raises(ValueError, match="steps"):
        render_loss_curve({"loss": [1.0, 2.0], "steps": [0]})

"""The bundled model: transformers loads it with equal logits, its greedy outputs are pinned, its eval runs,
and the training script still trains (a few steps of a tiny config: CI never retrains the real one)."""

import json
import os
from pathlib import Path

import torch

from engine import load_model
from engine.companions.kv_cache import generate_cached
from engine.companions.naive import full_logits, generate_naive
from engine.lab import tasks
from engine.lab.eval import evaluate_model
from engine.lab.training import (
    EOS,
    KeepOneHead,
    TrainConfig,
    batches,
    copy_pointers,
    documents,
    encode_example,
    pointer_loss,
    teacher_forced_exact,
    train,
)
from engine.loading.loader import bundled_model_path
from engine.sampling import SamplingParams

GOLDEN = Path(__file__).parent / "golden" / "tinylab_greedy.json"


def test_transformers_loads_tinylab_with_equal_logits():
    import transformers

    model, tok = load_model("tinylab")
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundled_model_path("tinylab")).eval()
    ids = torch.tensor([tok.encode(tasks.eval_examples("recall", 1)[0].prompt)])
    with torch.no_grad():
        diff = (full_logits(model, ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"max |ours - transformers| = {diff:.2e}"


def test_greedy_outputs_match_the_golden_file():
    """Pinned token ids (made once by the naive loop when the model was trained): naive and cached agree."""
    model, tok = load_model("tinylab")
    golden = json.loads(GOLDEN.read_text())
    params = SamplingParams(temperature=0.0, max_tokens=golden["max_tokens"])
    for case in golden["cases"]:
        assert generate_naive(model, tok, case["prompt"], params).token_ids == case["token_ids"], case["prompt"]
        assert generate_cached(model, tok, case["prompt"], params).token_ids == case["token_ids"], case["prompt"]


def test_eval_runs_on_a_small_sample_and_scores_every_task():
    model, tok = load_model("tinylab")
    n = 4 if os.environ.get("SERVELAB_FAST") else 50
    rows = evaluate_model(model, tok, n=n, progress=False)
    metrics = {(r["task"], r["metric"]) for r in rows}
    for needed in [("arith", "exact"), ("recall", "accuracy"), ("json", "parse_rate"),
                   ("refuse", "refusal_rate"), ("story", "perplexity")]:
        assert needed in metrics
    perplexity = next(r["value"] for r in rows if r["task"] == "story")
    assert 1.0 <= perplexity < 3.0, "story perplexity of the trained model should be low (templated text)"


def test_training_script_reduces_the_loss_on_a_tiny_config(tmp_path):
    cfg = TrainConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, context_tokens=128, batch_rows=4, total_tokens=128 * 4 * 30,
                      warmup_steps=3, checkpoint_every_steps=10_000, bf16_autocast=False)
    log = train(cfg, tmp_path, progress=False)
    assert log["loss"][-1] < log["loss"][0] - 0.5
    model, tok = load_model(tmp_path)
    assert model.config.num_hidden_layers == 1 and tok.decode(tok.encode("Q: 1+2=")) == "Q: 1+2="


def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bundled_model_path("tinylab") / "tokenizer.json"))


def test_follow_up_answers_count_in_the_loss_and_the_question_after_an_answer_does_not():
    tok = _tokenizer()
    ex = tasks.Example("recall", "Facts: zor=417; bim=82; Question: bim? Answer:", " 82")
    ids, w = encode_example(tok, ex, 0.0, follow_ups=[(" Question: zor? Answer:", " 417")])
    assert tok.decode(ids, skip_special_tokens=False).endswith("Answer: 82 Question: zor? Answer: 417<eos>")
    supervised = tok.decode([i for i, x in zip(ids, w, strict=True) if x > 0], skip_special_tokens=False)
    assert supervised == " 82 417<eos>"  # both answers and the final EOS; no question token, no fact
    assert ids[-1] == tok.token_to_id(EOS)


def test_context_stages_keep_the_tokens_per_step_and_rows_hold_whole_documents():
    tok = _tokenizer()
    cfg = TrainConfig(batch_rows=2, context_tokens=512, context_stages=((2, 128),), curriculum_steps=2,
                      recall_questions=4)
    shapes = [ids.shape for ids, *_ in (b for b, _ in zip(batches(tok, cfg, seed=0), range(4), strict=False))]
    assert shapes == [(8, 128), (8, 128), (2, 512), (2, 512)]


def test_curriculum_drills_are_short_and_ask_many_questions():
    tok = _tokenizer()
    cfg = TrainConfig(curriculum_steps=100, curriculum_facts=(4, 40), drill_questions=16)
    recall_docs = [tok.decode(ids) for ids, *_ in (d for d, _ in zip(documents(tok, cfg, 0, [0]), range(200),
                                                                    strict=False)) if "Facts:" in tok.decode(ids)]
    assert recall_docs
    for doc in recall_docs:
        n_facts, n_questions = doc.count("="), doc.count("Question:")
        assert 2 <= n_facts <= 4 and n_questions == n_facts  # at step 0: at most 4 facts, each one asked


def test_the_probe_says_what_greedy_decoding_would_write():
    model, tok = load_model("tinylab")
    examples = tasks.eval_examples("arith", 16, seed=tasks.EVAL_SEED_BASE + 3)
    hits = teacher_forced_exact(model, tok.tk, examples)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    greedy = [generate_cached(model, tok, ex.prompt, params).text == ex.target for ex in examples]
    assert hits == greedy and 0 < sum(hits)


def test_copy_pointers_point_every_answer_digit_at_the_same_digit_of_its_fact():
    tok = _tokenizer()
    ex = tasks.Example("recall", "Facts: zor=417; bim=82; Question: bim? Answer:", " 82")
    ids, w = encode_example(tok, ex, 0.0, follow_ups=[(" Question: zor? Answer:", " 417"), (" Again: zor=", "417;")])
    toks = [tok.id_to_token(i) for i in ids]
    pairs = [(toks[t + 1], toks[src], "".join(toks[src - 3:src])) for t, src in enumerate(copy_pointers(tok, ids, w))
             if src >= 0]
    # each pair: (the digit the position predicts, the digit pointed at, what stands before it in the facts)
    assert [(a, b) for a, b, _ in pairs] == [(d, d) for d in "82417417"]
    assert all(src < toks.index("ĠQuestion") for src in (t for t in copy_pointers(tok, ids, w) if t >= 0))
    assert [ctx.endswith("=") or ctx[-1].isdigit() for _, _, ctx in pairs] == [True] * 8


def test_pointer_loss_is_the_log_of_the_visible_positions_when_attention_is_uniform():
    kept = KeepOneHead(layer=0, head=0)
    T, D = 6, 4
    kept.q, kept.k = torch.zeros(1, T, D), torch.randn(1, T, D)  # q = 0: every visible key scores the same
    pointers = torch.full((1, T), -1)
    pointers[0, 2], pointers[0, 4] = 1, 0  # positions 2 and 4 should look at 1 and 0
    expected = (torch.log(torch.tensor(3.0)) + torch.log(torch.tensor(5.0))) / 2  # 3 and 5 visible positions
    assert torch.allclose(pointer_loss(kept, pointers), expected)
    kept.q = torch.zeros(1, T, D)
    kept.k = torch.zeros(1, T, D)
    kept.q[0, 2, 0] = kept.q[0, 4, 1] = 50.0
    kept.k[0, 1, 0] = kept.k[0, 0, 1] = 1.0  # each query now scores its own target far above the rest
    assert pointer_loss(kept, pointers) < 1e-3

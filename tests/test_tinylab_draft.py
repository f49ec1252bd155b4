"""tinylab-draft, the small draft model for speculative decoding with tinylab as the target (issue 30):
it loads by name and through transformers, it reads tinylab's token ids (its tokenizer files are
tinylab's, byte for byte), its greedy guesses agree with tinylab's often enough on held-out task
prompts, and the recipe that made it still distills (a few steps)."""

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from engine import load_model
from engine.companions.naive import full_logits
from engine.config import ModelConfig
from engine.lab import tasks
from engine.lab.training import (
    AGREEMENT_SEED,
    AGREEMENT_TASKS,
    RECIPES,
    TrainConfig,
    distill_loss,
    greedy_agreement,
    load_teacher,
    speculative_steps,
    target_runs,
    train,
)
from engine.loading.loader import bundled_model_path
from engine.model import LlamaModel

DRAFT, TARGET = bundled_model_path("tinylab-draft"), bundled_model_path("tinylab")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TEST_PROMPTS = 12  # per task; the card's numbers are over 100 other held-out prompts per task
# Floors on the draft's greedy agreement with tinylab (the acceptance rate alpha), per task. The card
# measured, over 100 held-out prompts per task: recall 0.315, json 0.930, arith 0.392, story 0.952,
# refuse 0.998; over eight slices of 12 of those prompts (what this test sees) the rates ranged
# recall 0.27-0.35, json 0.92-0.95, arith 0.33-0.43, story 0.945-0.956, refuse 0.98-1.00. Each floor
# sits well below the lowest slice (a float or library change may also flip a few near-ties) and
# above what a draft that lost its point would score:
# - json 0.85: the template without the copied names, cities and ages earned 0.81 (a draft after
#   1,000 steps that copied nothing yet; the card's "what we tried");
# - story 0.85: the corpus' tokens alone, without tinylab's choices, earned 0.75-0.83 (a random
#   favourite object where tinylab has its own);
# - recall 0.2, arith 0.25: the draft does not look the digits up nor add, so what it earns is
#   mostly the EOS after the answer (1 guess in 4 for recall, 1 in 3 for most sums);
# - refuse 0.9: two fixed sentence shapes, nearly all guessed.
AGREEMENT_FLOORS = {"recall": 0.2, "json": 0.85, "arith": 0.25, "story": 0.85, "refuse": 0.9}


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET)[0]


@pytest.fixture(scope="module")
def draft():
    return load_model("tinylab-draft")[0]


@pytest.fixture(scope="module")
def runs(target):
    """What tinylab writes greedily after held-out prompts that neither the card nor eval uses."""
    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    return target_runs(target, tok, TEST_PROMPTS, seed=AGREEMENT_SEED + 1)


def test_the_draft_loads_by_its_bundled_name_and_is_much_smaller_than_tinylab(draft, target):
    model, tok = load_model("tinylab-draft")
    assert tok is not None and tok.decode(tok.encode("Q: 12+34=")) == "Q: 12+34="
    params = sum(p.numel() for p in draft.parameters())
    target_params = sum(p.numel() for p in target.parameters())
    assert params * 4 < target_params, f"draft {params:,} vs tinylab {target_params:,} parameters"
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers


def test_transformers_loads_the_draft_with_equal_logits(draft):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(DRAFT).eval()
    tok = Tokenizer.from_file(str(DRAFT / "tokenizer.json"))
    ids = torch.tensor([tok.encode(tasks.eval_examples("json", 1)[0].prompt).ids])
    with torch.no_grad():
        diff = (full_logits(draft, ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"max |ours - transformers| = {diff:.2e}"


@pytest.mark.parametrize("name", TOKENIZER_FILES)
def test_the_tokenizer_files_are_tinylabs_byte_for_byte(name):
    assert (DRAFT / name).read_bytes() == (TARGET / name).read_bytes(), name


def test_vocabulary_and_special_ids_match_tinylab(draft, target):
    for field in ("vocab_size", "bos_token_id", "eos_token_ids", "pad_token_id",
                  "max_position_embeddings"):
        assert getattr(draft.config, field) == getattr(target.config, field), field
    assert load_model(DRAFT)[1].eos_token_ids == load_model(TARGET)[1].eos_token_ids


def test_tinylab_as_its_own_draft_agrees_on_every_guess(target, runs):
    """The measurement itself: guesses are read at the right positions (an off-by-one would
    compare each guess with the wrong token and fall far below 1)."""
    for task, result in greedy_agreement(target, runs).items():
        assert result["agreement"] == 1.0 and set(result["by_position"]) == {1.0}, (task, result)
        assert result["guesses"] == sum(len(c) - 1 for _, c in runs[task])


def test_the_drafts_greedy_agreement_with_tinylab_is_above_each_floor(draft, runs):
    result = greedy_agreement(draft, runs)
    assert set(result) == set(AGREEMENT_TASKS)
    low = {task: r["agreement"] for task, r in result.items()
           if r["agreement"] < AGREEMENT_FLOORS[task]}
    assert not low, f"agreement below the floor {AGREEMENT_FLOORS}: {low}"


@pytest.mark.parametrize("hits, k, steps", [
    ([True, True, False, True, True, True, True, True], 4, 2),  # keep 2 + fix 1; keep 4 (k) + 1
    ([True] * 8, 4, 2),  # keep 4 + the target's token; then the last 3 guesses
    ([False] * 5, 4, 5),  # every guess rejected: plain decoding's steps
    ([True, True, True], 8, 1),  # the whole reply in one step
])
def test_speculative_steps_keep_each_run_of_right_guesses_and_the_targets_token(hits, k, steps):
    assert speculative_steps(hits, k) == steps


def _tiny(seed: int) -> LlamaModel:
    torch.manual_seed(seed)
    return LlamaModel(ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=32))


def test_distill_loss_is_the_cross_entropy_to_the_teachers_choice_on_weighted_positions():
    student, teacher = _tiny(0), _tiny(1)
    ids = torch.randint(0, 50, (2, 12))
    weights = (torch.rand(2, 12) > 0.5).float() * 2.0  # zeros and twos
    with torch.no_grad():
        loss = distill_loss(student, teacher, ids, weights)
        q, p = student(ids[:, :-1]), teacher(ids[:, :-1])  # [B, T-1, V]
    terms = [(weights[b, t + 1], F.cross_entropy(q[b, t], p[b, t].argmax()))
             for b in range(2) for t in range(11) if weights[b, t + 1] > 0]
    expected = sum(w * nll for w, nll in terms) / sum(w for w, _ in terms)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_teacher_with_another_tokenizer_is_refused():
    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    tok.add_tokens(["<another>"])
    with pytest.raises(ValueError, match="distill_from='tinylab'"):
        load_teacher(TrainConfig(distill_from="tinylab"), tok)


def test_the_draft_recipe_distills_from_tinylab_in_a_few_steps(tmp_path):
    """The recipe's own shape and teacher, one row a step for a few steps: the loss (cross-entropy
    to tinylab's choices) falls, the final agreement is measured, and the saved folder carries
    tinylab's tokenizer files."""
    recipe = {**RECIPES["draft"], "batch_rows": 1, "total_tokens": 512 * 12, "warmup_steps": 2,
              "decay_steps": 4, "curriculum_steps": 0, "context_stages": (), "distill_from_step": 0,
              "probe_every": 0, "agreement_n": 1, "checkpoint_every_steps": 10_000}
    log = train(TrainConfig(**recipe), tmp_path, progress=False)
    assert log["loss"][-1] < log["loss"][0] - 1.0
    assert set(log["agreement"]) == set(AGREEMENT_TASKS)
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (TARGET / name).read_bytes(), name

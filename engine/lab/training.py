"""How `tinylab`, the bundled model, is made:
corpus -> tokenizer -> training -> a Hugging Face folder.

    engine/lab/tasks.py  ──► documents (prompt + target) ──► byte-level BPE (tokenizers library)
                             └─► packed 512-token rows ──► AdamW on LlamaModel
                                                           └─► engine/models/tinylab/

The bundled model comes from `python -m engine train-tinylab --recipe scratch` (67 minutes on 2 CPU
cores with bf16; its model card gives the exact commands). Everything is seeded, so the same command
makes the same model on the same software. Its draft for speculative decoding, `tinylab-draft`,
comes from `--recipe draft` (about 10 minutes on one thread: a 2-layer model that learns tinylab's
own greedy choices, `distill_loss`). The loss counts the *target* of each task and not its
prompt (`prompt_loss_weight`): the prompts of `recall` are random facts that no model can predict,
and a first run that also counted prompts (at weight 0.1) never learned to copy a value out of its
context in 6M tokens. Stories count fully (they are what perplexity measures).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.config import ModelConfig
from engine.lab import tasks
from engine.loading.loader import bundled_model_path, hf_weight_names
from engine.model import LlamaModel, NoCacheAttention
from engine.progress import progress_bar

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
TOKENIZER_TRAINING_DOCS = 20_000  # enough text for BPE merges to settle on a ~1k vocabulary
FACT_PATTERN = re.compile(r"(\w+)=(\d+);")  # one `key=value;` fact of a recall prompt


@dataclass
class TrainConfig:
    # model shape (a Llama with GQA: 8 query heads share 2 KV heads)
    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 704
    context_tokens: int = 512
    rope_theta: float = 10000.0
    # optimisation
    batch_rows: int = 8  # rows of `context_tokens` per step (small batches: more updates per token)
    total_tokens: int = 9_000_000
    lr: float = 2e-3
    min_lr_fraction: float = 0.1  # cosine decays to this fraction of lr
    # > 0: constant lr, then a linear decay over the last decay_steps (0: cosine)
    decay_steps: int = 0
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    prompt_loss_weight: float = 0.0  # task prompts are given, not predicted (stories count fully)
    recall_drills: int = 6  # extra supervised lookups per recall document (see `recall_drills`)
    # The lookup curriculum (see `documents`): more answered questions per recall document, short
    # drills first, short rows first. The defaults switch it all off (the recipe of the first
    # tinylab).
    recall_questions: int = 1  # questions per real recall document, every answer in the loss
    curriculum_steps: int = 0  # for this many steps recall documents are replaced by short drills
    # facts per drill: up to the first number at step 0, the second at the end
    curriculum_facts: tuple = (4, 40)
    drill_questions: int = 16  # questions per drill (at most one per fact)
    # during the curriculum a recall example becomes this many times its length in drills
    drill_multiplier: float = 1.0
    # share of drills that repeat their facts in a new order instead (`repeated_facts`)
    repeat_share: float = 0.0
    # repeat a run of the facts in order, keys in the loss too (`repeated_run`)
    repeat_in_order: bool = False
    # ((until_step, T), ...): rows of T tokens before until_step, same tokens per step
    context_stages: tuple = ()
    # > 0: also teach one head where each answer digit is (see `pointer_loss`)
    pointer_loss_weight: float = 0.0
    pointer_layer: int = -1  # the layer of that head (-1: the last)
    pointer_head: int = 0  # the query head that learns to point
    # also point json/refuse answer words at their copy in the prompt (`word_pointers`)
    pointer_words: bool = False
    # share of arithmetic problems drawn with operands of different lengths
    arith_unequal_share: float = 0.0
    first_step: int = 0  # a recipe that continues another run starts (and warms up) at this step
    # measure recall/arith/json on a fixed probe every this many steps (0: never)
    probe_every: int = 0
    probe_n: int = 64  # probe examples per task
    # reuse this tokenizer.json (token ids stay comparable) instead of training one
    tokenizer_path: str | None = None
    # a teacher (folder or bundled name, e.g. "tinylab"): learn its greedy choices instead of
    # the corpus' tokens (see `distill_loss`); its tokenizer must be ours
    distill_from: str | None = None
    # before this step the loss is the corpus' tokens (no teacher pass: less than half the cost)
    distill_from_step: int = 0
    # with a teacher: held-out prompts per task for the final agreement (0: not measured)
    agreement_n: int = 100
    bf16_autocast: bool = True
    seed: int = 0
    # save the folder now and then, so a stopped run still leaves a model
    checkpoint_every_steps: int = 200
    # > 0: stop (and save) after about this many minutes; resume with --start-step
    max_minutes: float = 0.0
    # > 0: stop (and save) once this many steps are done; resume with --start-step stop_step
    stop_step: int = 0
    mix: dict = field(default_factory=lambda: dict(tasks.DEFAULT_MIX))

    @property
    def steps(self) -> int:
        return max(1, self.total_tokens // (self.batch_rows * self.context_tokens))

    def model_config(self, tok: Tokenizer) -> ModelConfig:
        return ModelConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.context_tokens, rope_theta=self.rope_theta,
            tie_word_embeddings=True, bos_token_id=tok.token_to_id(BOS),
            eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD))


# Named recipes for `python -m engine train-tinylab --recipe NAME` (fields of TrainConfig).
RECIPES = {
    "first": {},  # the first tinylab (one question per recall document)
    # the lookup curriculum of issue 11 (see the model card for what it was measured to do)
    "lookup": dict(
        bf16_autocast=False, batch_rows=4, total_tokens=4_096_000, warmup_steps=30, decay_steps=300,
        lr=1.5e-3, pointer_loss_weight=1.0, curriculum_steps=600, curriculum_facts=(8, 40),
        drill_multiplier=3.0, drill_questions=16, repeat_share=0.3, context_stages=((600, 256),),
        recall_questions=8, probe_every=100, probe_n=48, checkpoint_every_steps=50,
        mix={"arith": 0.25, "recall": 0.5, "json": 0.12, "refuse": 0.03, "story": 0.10}),
    # after "lookup": a short low-lr pass with more arithmetic and refusals (they had slipped)
    "polish": dict(
        bf16_autocast=False, batch_rows=4, total_tokens=614_400, warmup_steps=10, decay_steps=150,
        lr=3e-4, pointer_loss_weight=1.0, recall_questions=8, probe_every=100, probe_n=48,
        checkpoint_every_steps=50,
        mix={"arith": 0.35, "recall": 0.35, "json": 0.12, "refuse": 0.10, "story": 0.08}),
    # after "lookup" (resume at its step 2000): the real documents at 512 tokens, and words
    # copied too
    "extend": dict(
        bf16_autocast=False, batch_rows=4, total_tokens=3_500 * 2048, first_step=2000,
        warmup_steps=50, decay_steps=500, lr=1e-3, pointer_loss_weight=1.0, pointer_words=True,
        recall_questions=8, probe_every=100, probe_n=48, checkpoint_every_steps=50,
        mix={"arith": 0.27, "recall": 0.45, "json": 0.15, "refuse": 0.06, "story": 0.07}),
    # after "extend" (resume at its step 3500): a low-lr pass, more JSON and arithmetic
    "finish": dict(
        bf16_autocast=False, batch_rows=4, total_tokens=3_800 * 2048, first_step=3500,
        warmup_steps=20, decay_steps=300, lr=2e-4, pointer_loss_weight=1.0, pointer_words=True,
        recall_questions=8, probe_every=100, probe_n=48, checkpoint_every_steps=50,
        mix={"arith": 0.30, "recall": 0.40, "json": 0.20, "refuse": 0.05, "story": 0.05}),
    # everything above in one recipe from random weights, bf16 on 2 threads (the 90-minute budget)
    "scratch": dict(
        bf16_autocast=True, batch_rows=4, total_tokens=11_000 * 2048, warmup_steps=100,
        decay_steps=1_500, lr=1.5e-3, min_lr_fraction=0.05, pointer_loss_weight=1.0,
        pointer_words=True, curriculum_steps=1_500, curriculum_facts=(8, 40), drill_multiplier=3.0,
        drill_questions=16, repeat_share=0.3, context_stages=((1_500, 256),), recall_questions=8,
        arith_unequal_share=0.4, probe_every=250, probe_n=48, checkpoint_every_steps=250,
        mix={"arith": 0.30, "recall": 0.42, "json": 0.15, "refuse": 0.05, "story": 0.08}),
    # tinylab-draft, a draft for speculative decoding with tinylab as the target (issue 30):
    # tinylab's tokenizer, 2 layers of width 128 (500k parameters, 1.9 MiB). 1,500 steps on the
    # corpus' tokens, then 800 on tinylab's greedy choices (`distill_loss`): about 10 minutes on
    # one thread. No lookup curriculum (the lookup did not form in 1,500 curriculum steps), and
    # less recall and arithmetic than tinylab's mix: a 2-layer draft learns neither in minutes.
    # engine/models/tinylab-draft/README.md has the measurements behind each choice.
    "draft": dict(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352,
        tokenizer_path=str(bundled_model_path("tinylab") / "tokenizer.json"),
        distill_from="tinylab", distill_from_step=1_500, bf16_autocast=True, batch_rows=4,
        total_tokens=2_300 * 2048, warmup_steps=50, decay_steps=500, lr=3e-3,
        min_lr_fraction=0.05, pointer_loss_weight=1.0, pointer_words=True, recall_questions=8,
        arith_unequal_share=0.4, probe_every=500, probe_n=48, checkpoint_every_steps=250,
        mix={"arith": 0.15, "recall": 0.20, "json": 0.30, "refuse": 0.10, "story": 0.25}),
}


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: any UTF-8 text (Chinese included) encodes, since all 256 bytes are in the
    alphabet. Digits are split one per token so that the model sees numbers digit by digit (it
    helps `arith`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                       special_tokens=[(BOS, bos_id)])
    return tok


def recall_drills(ex: tasks.Example, rng: random.Random, max_drills: int) -> list[tuple[str, str]]:
    """Extra questions about other facts of a recall prompt, asked before the real question:

        Facts: zor=417; bim=82; kep=950; Quiz: kep? Answer: 950 Quiz: zor? Answer: 417
               Question: bim? Answer: 82

    Looking a value up by its key is learned late and suddenly (an "induction" circuit must form);
    one supervised answer per 400-token document gives too little signal, so each document drills
    several (a different cue, "Quiz:", so that after the real answer the model still writes EOS)."""
    facts = FACT_PATTERN.findall(ex.prompt.split("Question:")[0])
    picked = rng.sample(facts, min(max_drills, len(facts)))
    return [(f" Quiz: {key}? Answer:", f" {value}") for key, value in picked]


def encode_example(tok: Tokenizer, ex: tasks.Example, prompt_weight: float,
                   drills: list[tuple[str, str]] = (),
                   follow_ups: list[tuple[str, str]] = ()) -> tuple[list[int], list[float]]:
    """[BOS] prompt target [EOS], each token with its loss weight. Prompt and target are encoded
    separately, exactly as at inference time (the prompt is encoded, then the model writes).
    Recall drills (question, answer) go between the facts and the real question; follow-up
    questions (see `with_follow_ups`) go after the real answer."""
    w_prompt = 1.0 if ex.task == "story" else prompt_weight
    head, sep, question = ex.prompt.rpartition("Question:") if drills else (ex.prompt, "", "")
    ids, weights = tok.encode(head.rstrip() if drills else head).ids, []  # starts with BOS
    weights = [w_prompt] * len(ids)
    for q, a in drills:
        q_ids, a_ids = (tok.encode(q, add_special_tokens=False).ids,
                        tok.encode(a, add_special_tokens=False).ids)
        ids, weights = ids + q_ids + a_ids, weights + [w_prompt] * len(q_ids) + [1.0] * len(a_ids)
    if drills:
        q_ids = tok.encode(" " + sep + question, add_special_tokens=False).ids
        ids, weights = ids + q_ids, weights + [w_prompt] * len(q_ids)
    target = tok.encode(ex.target, add_special_tokens=False).ids
    ids, weights = ids + target, weights + [1.0] * len(target)
    if follow_ups:
        ids, weights = with_follow_ups(tok, ids, weights, follow_ups, prompt_weight)
    return ids + [tok.token_to_id(EOS)], weights + [1.0]


def with_follow_ups(tok: Tokenizer, ids: list[int], weights: list[float],
                    follow_ups: list[tuple[str, str]],
                    prompt_weight: float) -> tuple[list[int], list[float]]:
    """Append more answered questions to a recall document, every answer in the loss:

        ... Question: bim? Answer: 82 Question: zor? Answer: 417 <eos>
                                     ^ weight 0: after an answer comes EOS or another question,
                                       and only the last answer says which (so greedy decoding
                                       stops at EOS)
    """
    for q, a in follow_ups:
        q_ids, a_ids = (tok.encode(q, add_special_tokens=False).ids,
                        tok.encode(a, add_special_tokens=False).ids)
        q_w = ([0.0] + [prompt_weight] * (len(q_ids) - 1))[:len(q_ids)]
        ids, weights = ids + q_ids + a_ids, weights + q_w + [1.0] * len(a_ids)
    return ids, weights


PACK_LOOKAHEAD = 32  # documents we look ahead to fill a row's tail (first fit): less padding


# drills stay at their fewest facts for this share of the curriculum (the circuit forms there)
CURRICULUM_HOLD = 0.5


def drill_facts(step: int, cfg: TrainConfig) -> int:
    """The most facts a curriculum drill may have at `step`: held at the first number of
    `curriculum_facts` for the first CURRICULUM_HOLD of the curriculum, then growing linearly."""
    lo, hi = cfg.curriculum_facts
    progress = step / max(1, cfg.curriculum_steps)
    return round(lo + (hi - lo) * min(1.0, max(0.0, (progress - CURRICULUM_HOLD)
                                               / (1 - CURRICULUM_HOLD))))


def fit(tok: Tokenizer, ex: tasks.Example, follow_ups: list, cfg: TrainConfig, T: int):
    """Encode a recall document with as many of its follow-ups as fit in T tokens
    (None if none fits)."""
    while True:
        doc = encode_example(tok, ex, cfg.prompt_loss_weight, follow_ups=follow_ups)
        if len(doc[0]) <= T:
            return doc
        if not follow_ups:
            return None
        follow_ups = follow_ups[:-1]


def recall_documents(tok: Tokenizer, ex: tasks.Example, rng: random.Random, cfg: TrainConfig,
                     step: int, T: int):
    """What one recall example of the task stream becomes: during the curriculum, short drills of
    about the same total length (many answered questions each); after it, the document itself with
    `recall_questions - 1` follow-ups (or the old `recall_drills`)."""
    if step >= cfg.curriculum_steps:
        if cfg.recall_drills and cfg.recall_questions <= 1:
            drills = recall_drills(ex, rng, cfg.recall_drills)
            doc = encode_example(tok, ex, cfg.prompt_loss_weight, drills)
            while len(doc[0]) > T and drills:  # too long with all drills: drop some
                drills = drills[:-1]
                doc = encode_example(tok, ex, cfg.prompt_loss_weight, drills)
            return [doc] if len(doc[0]) <= T else []
        doc = fit(tok, ex, tasks.follow_up_questions(ex, rng, cfg.recall_questions - 1), cfg, T)
        return [doc] if doc else []
    docs, chars = [], 0
    while chars < len(ex.text) * cfg.drill_multiplier:
        drill = tasks.lookup_drill(rng, rng.randint(2, max(2, drill_facts(step, cfg))))
        again = rng.random() < cfg.repeat_share
        repeat = tasks.repeated_run if cfg.repeat_in_order else tasks.repeated_facts
        follow_ups = (repeat(drill, rng) if again
                      else tasks.follow_up_questions(drill, rng, cfg.drill_questions - 1))
        doc = fit(tok, drill, follow_ups, cfg, T)
        chars += len(drill.text) + 1
        if doc:
            docs.append(doc)
    return docs


def documents(tok: Tokenizer, cfg: TrainConfig, seed: int, clock: list[int]):
    """Yield encoded training documents (ids, weights); `clock[0]` is the current step, which the
    curriculum and the row length `context_at(step)` follow."""
    rng = random.Random(seed)
    for ex in tasks.training_examples(seed=seed, mix=cfg.mix):
        if ex.task == "recall":
            for ids, weights in recall_documents(tok, ex, rng, cfg, clock[0],
                                                 context_at(clock[0], cfg)):
                yield ids, weights, copy_pointers(tok, ids, weights)
        else:
            if ex.task == "arith" and rng.random() < cfg.arith_unequal_share:
                ex = tasks.unequal_arith(rng)
            ids, weights = encode_example(tok, ex, cfg.prompt_loss_weight)
            copies = cfg.pointer_words and ex.task in WORD_COPY_TASKS
            yield ids, weights, word_pointers(tok, ids, weights) if copies else [-1] * len(ids)


# answers that copy words of the prompt ("called Kofi" -> "Kofi")
WORD_COPY_TASKS = ("json", "refuse")


def word_pointers(tok: Tokenizer, ids: list[int], weights: list[float]) -> list[int]:
    """For each position that predicts a supervised token whose text (without spaces) occurs exactly
    once in the prompt, that occurrence (-1 elsewhere): the attention target of `pointer_loss` for
    copied words, as `copy_pointers` is for recall digits.

        Make JSON: aged 55, called Kofi.\nJSON: {"age": 55, "name": "Kofi"}
                                   ^^^^^                          ^^^^ pointers[t - 1] = source

    A word that occurs twice in the prompt (or not at all) gets no pointer: we would not know
    which."""
    text = [tok.id_to_token(i) for i in ids]
    clean = [tok.decode([i]).strip() for i in ids]
    answer_start = next((t for t, w in enumerate(weights) if w > 0), len(ids))
    seen: dict[str, list[int]] = {}
    for s in range(1, answer_start):  # position 0 is BOS
        if clean[s] and clean[s][0].isalnum():
            seen.setdefault(clean[s], []).append(s)
    pointers = [-1] * len(ids)
    for t in range(answer_start, len(ids)):
        sources = seen.get(clean[t], [])
        if weights[t] > 0 and len(sources) == 1 and text[t] != EOS:
            pointers[t - 1] = sources[0]
    return pointers


def copy_pointers(tok: Tokenizer, ids: list[int], weights: list[float]) -> list[int]:
    """For each position that predicts a supervised answer digit, where that digit sits in the facts
    (-1 elsewhere): the attention target of `pointer_loss`.

        Facts: zor=417; bim=82; Question: zor? Answer: 417
                   ^^^                              ^^^ position t predicts this digit:
                                                        pointers[t - 1] = source

    We read the token strings: a key is what stands between a boundary (`:` or `;`) and `=` or `?`;
    its first `=` defines where its value's digits are, later `=` or `?` ask for them."""
    toks = [tok.id_to_token(i) for i in ids]
    where: dict[tuple, list[int]] = {}
    pointers, key, current, digit, defining = [-1] * len(ids), (), [], 0, False
    for t, s in enumerate(toks):
        if s.isdigit() and key:
            if defining:
                where[key].append(t)
            elif key in where and digit < len(where[key]) and weights[t] > 0:
                pointers[t - 1] = where[key][digit]
            digit += 1
        elif s in ("=", "?"):
            key, current, digit = tuple(current), [], 0
            defining = s == "=" and key not in where
            if defining:
                where[key] = []
        elif s in (";", ":"):
            current, defining = [], False
            key = () if s == ";" else key
        else:
            current.append(s)
    return pointers


def context_at(step: int, cfg: TrainConfig) -> int:
    """Row length at `step`: the first stage of `context_stages` not yet over,
    else `context_tokens`."""
    for until_step, T in cfg.context_stages:
        if step < until_step:
            return T
    return cfg.context_tokens


def pack_row(pending: list, source, T: int, pad: int) -> tuple[list[int], list[float], list[int]]:
    """One row of exactly T tokens: whole documents, first fit from the oldest pending one, padded.
    Documents longer than T (possible while rows are short) are dropped."""
    while len(pending) < PACK_LOOKAHEAD:
        pending.append(next(source))
    ids: list[int] = []
    weights: list[float] = []
    pointers: list[int] = []
    keep = []
    for doc in pending:
        doc_ids, doc_w, doc_p = doc
        if len(doc_ids) > T:
            continue
        if len(ids) + len(doc_ids) <= T:
            # row positions, not document ones
            pointers += [p + len(ids) if p >= 0 else -1 for p in doc_p]
            ids, weights = ids + doc_ids, weights + doc_w
        else:
            keep.append(doc)
    pending[:] = keep
    n_pad = T - len(ids)
    return ids + [pad] * n_pad, weights + [0.0] * n_pad, pointers + [-1] * n_pad


def batches(tok: Tokenizer, cfg: TrainConfig, seed: int, start_step: int = 0):
    """Yield (input_ids [B, T], weights [B, T], pointers [B, T]) tensors forever (see
    `copy_pointers`); B * T = batch_rows * context_tokens."""
    clock = [start_step]
    source, pending, pad = documents(tok, cfg, seed, clock), [], tok.token_to_id(PAD)
    while True:
        T = context_at(clock[0], cfg)
        chunk = [pack_row(pending, source, T, pad)
                 for _ in range(cfg.batch_rows * cfg.context_tokens // T)]
        yield tuple(torch.tensor([c[i] for c in chunk]) for i in range(3))
        clock[0] += 1


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step - cfg.first_step < cfg.warmup_steps:
        return cfg.lr * (step - cfg.first_step + 1) / cfg.warmup_steps
    if cfg.decay_steps:  # warm-up, stable, decay: a run can be extended before its decay starts
        left = (cfg.steps - step) / cfg.decay_steps
        return cfg.lr * (cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * min(1.0, max(0.0, left)))
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * cosine)


def weighted_loss(model: LlamaModel, ids: torch.Tensor, weights: torch.Tensor,
                  backend: NoCacheAttention | None = None) -> torch.Tensor:
    """Next-token cross-entropy;
    position t predicts token t+1 and counts with token t+1's weight."""
    logits = model(ids[:, :-1], backend=backend)  # [B, T-1, V]
    nll = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    w = weights[:, 1:].flatten()
    return (nll * w).sum() / w.sum().clamp(min=1.0)


def distill_loss(model: LlamaModel, teacher: LlamaModel, ids: torch.Tensor, weights: torch.Tensor,
                 backend: NoCacheAttention | None = None) -> torch.Tensor:
    """Cross-entropy against the *teacher's* greedy choice at each weighted position.

    A draft for greedy speculative decoding is good when its argmax is the target's argmax, right
    or wrong, so that is what we teach it (hard-label distillation): where the corpus draws a
    story's object at random ("a golden cup", "a heavy bell", ...), the target has a favourite,
    and the favourite is what a verify step accepts. Matching the teacher's whole distribution
    instead (KL, Hinton et al. 2015) spreads the draft over the same near-ties and picks the
    favourite less often (the tinylab-draft card has the comparison). Position t predicts token t+1
    and counts with token t+1's weight, as in `weighted_loss`."""
    logits = model(ids[:, :-1], backend=backend)  # [B, T-1, V]
    with torch.no_grad():
        choice = teacher(ids[:, :-1]).argmax(-1)  # [B, T-1]: what the teacher would write next
    w = weights[:, 1:]  # [B, T-1]
    keep = w > 0
    nll = F.cross_entropy(logits[keep].float(), choice[keep], reduction="none")  # [N]
    return (nll * w[keep]).sum() / w[keep].sum().clamp(min=1.0)


def load_teacher(cfg: TrainConfig, tok: Tokenizer) -> LlamaModel:
    """The frozen target of `distill_loss`; it must read our token ids as we do."""
    from engine.loading.loader import load_model, resolve_model_path

    teacher, _ = load_model(cfg.distill_from)
    theirs = Tokenizer.from_file(str(resolve_model_path(cfg.distill_from) / "tokenizer.json"))
    if theirs.to_str() != tok.to_str():
        raise ValueError(f"distill_from={cfg.distill_from!r} has another tokenizer than the one "
                         f"we train with (tokenizer_path={cfg.tokenizer_path!r}); pass the "
                         "teacher's own tokenizer.json as tokenizer_path")
    return teacher.eval().requires_grad_(False)


class KeepOneHead(NoCacheAttention):
    """Causal attention as usual,
    but keep one head's q and k (after RoPE) of one layer for `pointer_loss`."""

    def __init__(self, layer: int, head: int):
        super().__init__(None)
        self.layer, self.head, self.q, self.k = layer, head, None, None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta=None) -> torch.Tensor:
        if layer == self.layer:  # q [B, T, H, D], k [B, T, Hkv, D]
            self.q, self.k = (q[:, :, self.head],
                              k[:, :, self.head // (q.shape[2] // k.shape[2])])  # [B, T, D]
        return super().forward(layer, q, k, v, meta)


def pointer_loss(kept: KeepOneHead, pointers: torch.Tensor) -> torch.Tensor:
    """-log (attention of the kept head from each answer position to the fact digit it must copy).

    Content lookup forms late and suddenly when only the answer is supervised: attention has to find
    the fact before the answer loss can say anything about it. Telling one head where to look gives
    that search a gradient from the first step (supervised attention); the model stays a plain
    Llama."""
    # the N positions that predict an answer digit
    b, t = (pointers[:, :-1] >= 0).nonzero(as_tuple=True)
    if b.numel() == 0:
        return torch.zeros(())
    q, k = kept.q[b, t], kept.k[b]  # [N, D], [N, T, D]
    scores = (k @ q[:, :, None]).squeeze(-1) / math.sqrt(q.shape[-1])  # [N, T]
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > t[:, None],
                                float("-inf"))  # causal
    return -scores.float().log_softmax(-1)[torch.arange(b.numel()), pointers[b, t]].mean()


def start_model(cfg: TrainConfig, resume_from: Path | None) -> tuple[LlamaModel, Tokenizer]:
    """A fresh model and tokenizer, or the ones saved in `resume_from`
    (a folder this script wrote)."""
    if resume_from is not None:
        # the saved folder is a Hugging Face-format model
        from engine.loading.loader import load_model

        model, _ = load_model(resume_from)
        return model.train(), Tokenizer.from_file(str(Path(resume_from) / "tokenizer.json"))
    if cfg.tokenizer_path:
        tok = Tokenizer.from_file(cfg.tokenizer_path)
    else:
        docs = [ex.text for ex, _ in zip(tasks.training_examples(seed=cfg.seed + 1, mix=cfg.mix),
                                         range(TOKENIZER_TRAINING_DOCS), strict=False)]
        tok = train_tokenizer(docs, cfg.vocab_size)
    model = LlamaModel(cfg.model_config(tok))
    init_weights(model)
    return model, tok


def train(cfg: TrainConfig, out_dir: Path, progress: bool = True, resume_from: Path | None = None,
          start_step: int = 0) -> dict:
    """Train tinylab and save it to `out_dir`; returns the training log.

    `resume_from` + `start_step` continue an interrupted run from a saved folder: the weights are
    reloaded, the learning-rate schedule continues at `start_step`, AdamW's moments are reloaded
    when the folder has them (OPTIMIZER_FILE, else they restart), and the data stream uses a new
    seed."""
    torch.manual_seed(cfg.seed + start_step)
    model, tok = start_model(cfg, resume_from)
    opt = make_optimizer(model, cfg, resume_from)
    log = {"config": asdict(cfg), "steps": [], "loss": [], "tokens_per_s": [],
           "resumed_from_step": start_step}
    # wall, and CPU seconds of all threads
    start, cpu_start = time.perf_counter(), time.process_time()
    previous = Path(resume_from or "", "training_log.json")
    # keep the earlier parts' logs (the curve spans them)
    if resume_from is not None and previous.exists():
        log["previous"] = json.loads(previous.read_text())
    probe_set = probe_examples(cfg.probe_n) if cfg.probe_every else {}
    teacher = load_teacher(cfg, tok) if cfg.distill_from else None
    # a draft's probe also measures its agreement with the teacher
    runs = (target_runs(teacher, tok, cfg.probe_n, PROBE_SEED)
            if teacher is not None and probe_set else {})
    log["probe"] = []
    bar = progress_bar(zip(range(start_step, cfg.steps),
                           batches(tok, cfg, cfg.seed + start_step, start_step), strict=False),
                       initial=start_step, total=cfg.steps, disable=not progress,
                       desc="training tinylab")
    kept = KeepOneHead(cfg.pointer_layer % model.config.num_hidden_layers, cfg.pointer_head)
    log["pointer_loss"] = []
    for step, (ids, weights, pointers) in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            loss = (distill_loss(model, teacher, ids, weights, kept)
                    if teacher is not None and step >= cfg.distill_from_step
                    else weighted_loss(model, ids, weights, kept))
            aux = pointer_loss(kept, pointers) if cfg.pointer_loss_weight else torch.zeros(())
        opt.zero_grad(set_to_none=True)
        (loss + cfg.pointer_loss_weight * aux).backward()
        log["pointer_loss"].append(round(aux.item(), 4))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        elapsed = time.perf_counter() - start
        log["steps"].append(step)
        log["loss"].append(round(loss.item(), 4))
        log["tokens_per_s"].append(round((step + 1 - start_step) * ids.numel() / elapsed))
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=log["tokens_per_s"][-1])
        if probe_set and ((step + 1) % cfg.probe_every == 0 or step + 1 == cfg.steps):
            log["probe"].append(dict(step=step + 1, seconds=round(time.perf_counter() - start, 1),
                                     **probe(model, tok, probe_set),
                                     **{f"agree_{task}": a["agreement"]
                                        for task, a in greedy_agreement(model, runs).items()}))
            print("probe", json.dumps(log["probe"][-1]), flush=True)
        if (step + 1) % cfg.checkpoint_every_steps == 0:
            save_hf_folder(model, tok, out_dir,
                           dict(log, train_seconds=round(elapsed, 1),
                                cpu_seconds=round(time.process_time() - cpu_start, 1)))
            torch.save(opt.state_dict(), out_dir / OPTIMIZER_FILE)
        if ((cfg.max_minutes and elapsed > 60 * cfg.max_minutes)
                or (cfg.stop_step and step + 1 >= cfg.stop_step)):
            break
    log["train_seconds"] = round(time.perf_counter() - start, 1)
    # a shared machine: wall time overstates
    log["cpu_seconds"] = round(time.process_time() - cpu_start, 1)
    log["threads"] = torch.get_num_threads()
    if teacher is not None and cfg.agreement_n:  # the draft's acceptance rate (after the clock)
        log["agreement"] = greedy_agreement(model, target_runs(teacher, tok, cfg.agreement_n))
    save_hf_folder(model, tok, out_dir, log)
    torch.save(opt.state_dict(), out_dir / OPTIMIZER_FILE)
    return log


# AdamW's state, next to a checkpoint (not part of the published model)
OPTIMIZER_FILE = "optimizer.pt"


def make_optimizer(model: LlamaModel, cfg: TrainConfig,
                   resume_from: Path | None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only;
    its state is reloaded from `resume_from` if saved there."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    if resume_from is not None and (Path(resume_from) / OPTIMIZER_FILE).exists():
        opt.load_state_dict(torch.load(Path(resume_from) / OPTIMIZER_FILE))
    return opt


PROBE_SEED = tasks.EVAL_SEED_BASE + 11  # eval-side documents, but not the ones `eval` scores
PROBE_TASKS = ("recall", "arith", "json")
LONG_RECALL_TOKENS = 256  # the probe also reports recall on prompts at least this long
SHORT_PROBE_FACTS = 6  # ... and on short prompts of this many facts, where the lookup shows first


def probe_examples(n: int) -> dict[str, list[tasks.Example]]:
    """The fixed probe: `n` held-out examples of each task in PROBE_TASKS."""
    probe_set = {task: tasks.eval_examples(task, n, seed=PROBE_SEED) for task in PROBE_TASKS}
    probe_set[f"recall_{SHORT_PROBE_FACTS}facts"] = tasks.eval_examples(
        "recall", n, seed=PROBE_SEED, n_facts=SHORT_PROBE_FACTS)
    return probe_set


@torch.no_grad()
def teacher_forced_exact(model: LlamaModel, tok: Tokenizer,
                         examples: list[tasks.Example]) -> list[bool]:
    """For each example: does the argmax at every position of `target + EOS` pick the right token?
    That is what greedy decoding would write (one forward per batch instead of a loop per token)."""
    eos, hits = tok.token_to_id(EOS), []
    for i in range(0, len(examples), tasks.EVAL_BATCH_SIZE):
        docs = [(tok.encode(ex.prompt).ids,
                 tok.encode(ex.target, add_special_tokens=False).ids + [eos])
                for ex in examples[i:i + tasks.EVAL_BATCH_SIZE]]
        T = max(len(p) + len(t) for p, t in docs)
        ids = torch.tensor([p + t + [eos] * (T - len(p) - len(t)) for p, t in docs])  # [B, T]
        pred = model(ids[:, :-1]).argmax(-1)  # [B, T-1]: position t predicts token t+1
        for b, (p, t) in enumerate(docs):
            hits.append(pred[b, len(p) - 1:len(p) - 1 + len(t)].tolist() == t)
    return hits


def probe(model: LlamaModel, tok: Tokenizer,
          probe_set: dict[str, list[tasks.Example]]) -> dict[str, float]:
    """Exact-answer rate per probe task, and recall on the long prompts alone ("recall_long")."""
    model.eval()
    out = {}
    for task, examples in probe_set.items():
        hits = teacher_forced_exact(model, tok, examples)
        out[task] = round(sum(hits) / len(hits), 3)
        if task == "recall":  # the length-mixed probe
            long = [h for h, ex in zip(hits, examples, strict=True)
                    if ex.meta["context_tokens"] >= LONG_RECALL_TOKENS]
            out["recall_long"] = round(sum(long) / max(1, len(long)), 3)
    model.train()
    return out


# held-out documents for a draft's agreement with its target: neither `eval`'s nor the probe's
AGREEMENT_SEED = tasks.EVAL_SEED_BASE + 12
AGREEMENT_TASKS = ("recall", "json", "arith", "story", "refuse")
STORY_NEW_TOKENS = 64  # a story has no answer to stop at; its targets are 20-50 tokens


@torch.no_grad()
def target_runs(target: LlamaModel, tok: Tokenizer, n: int,
                seed: int = AGREEMENT_SEED) -> dict[str, list[tuple[list[int], list[int]]]]:
    """For each task of AGREEMENT_TASKS: `n` held-out prompts (token ids) and the tokens `target`
    writes after each one greedily (EOS included), the text a draft will be asked to guess."""
    from engine.companions.kv_cache import generate_cached
    from engine.sampling import SamplingParams

    target.eval()
    runs = {}
    for task in AGREEMENT_TASKS:
        params = SamplingParams(temperature=0.0,
                                max_tokens=tasks.MAX_NEW_TOKENS.get(task, STORY_NEW_TOKENS))
        prompts = [tok.encode(ex.prompt).ids for ex in tasks.eval_examples(task, n, seed=seed)]
        runs[task] = [(p, generate_cached(target, None, p, params).token_ids) for p in prompts]
    return runs


SPECULATIVE_KS = (2, 4, 8)  # guesses per step for which we replay greedy speculation
POSITIONS_REPORTED = 4  # agreement of a reply's 1st, 2nd, ... guess, this many


@torch.no_grad()
def guess_hits(draft: LlamaModel, pairs: list[tuple[list[int], list[int]]]) -> list[list[bool]]:
    """For each (prompt, reply) of `target_runs`: does the draft's argmax, given the target's
    text so far, guess reply[1], reply[2], ...? The first token of a reply is not guessed: the
    target's prefill writes it, a draft only ever guesses the tokens after it.

        prompt ........ | t0  t1  t2  EOS      the target's greedy reply
        draft argmax at:  t0' t1' t2'           (the position before each)
        hits:                 t1  t2  EOS       t1' == t1, t2' == t2, ..."""
    hits = []
    for i in range(0, len(pairs), tasks.EVAL_BATCH_SIZE):
        chunk = pairs[i:i + tasks.EVAL_BATCH_SIZE]
        T = max(len(p) + len(c) for p, c in chunk)
        ids = torch.tensor([p + c + [0] * (T - len(p) - len(c)) for p, c in chunk])  # [B, T]
        pred = draft(ids[:, :-1]).argmax(-1)  # [B, T-1]: position t guesses token t+1
        for b, (p, c) in enumerate(chunk):
            guessed = pred[b, len(p):len(p) + len(c) - 1].tolist()  # guesses of c[1:]
            hits.append([g == t for g, t in zip(guessed, c[1:], strict=True)])
    return hits


def speculative_steps(hits: list[bool], k: int) -> int:
    """Target steps to write a reply after its first token with greedy speculation, k guesses a
    step, replayed from `guess_hits`: while the guesses are right the draft saw the true text, so
    its guesses ARE the teacher-forced ones. A step keeps the run of right guesses (at most k) and
    adds the target's own next token; plain decoding takes len(hits) steps."""
    pos = steps = 0
    while pos < len(hits):
        run = 0
        while run < k and pos + run < len(hits) and hits[pos + run]:
            run += 1
        pos, steps = pos + run + 1, steps + 1
    return steps


def greedy_agreement(draft: LlamaModel,
                     runs: dict[str, list[tuple[list[int], list[int]]]]) -> dict[str, dict]:
    """Per task of `target_runs`: the share of the target's tokens that the draft's argmax
    guesses (`guess_hits`), the acceptance rate alpha of greedy speculative decoding; that share
    for a reply's 1st, 2nd, ... guess; and the tokens per target step that greedy speculation
    with k guesses would write (`speculative_steps`; 1.0 is plain decoding)."""
    was_training = draft.training
    draft.eval()
    out = {}
    for task, pairs in runs.items():
        hits = guess_hits(draft, pairs)
        flat = [h for reply in hits for h in reply]
        at = [[reply[j] for reply in hits if len(reply) > j] for j in range(POSITIONS_REPORTED)]
        out[task] = {
            "agreement": round(sum(flat) / max(1, len(flat)), 3), "guesses": len(flat),
            "prompts": len(pairs),
            "by_position": [round(sum(a) / max(1, len(a)), 3) for a in at],
            "tokens_per_step": {k: round(len(flat) / max(1, sum(speculative_steps(r, k)
                                                                  for r in hits)), 2)
                                for k in SPECULATIVE_KS}}
    draft.train(was_training)
    return out


def init_weights(model: LlamaModel, std: float = 0.02) -> None:
    """GPT-2 style: normal(0, 0.02), residual output projections scaled down by sqrt(2 L)."""
    L = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            scale = (1 / math.sqrt(2 * L) if name.endswith(("o_proj.weight", "down_proj.weight"))
                     else 1.0)
            torch.nn.init.normal_(p, std=std * scale)


def hf_config_dict(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "torch_dtype": "float32",
    }


def save_hf_folder(model: LlamaModel, tok: Tokenizer, out_dir: Path, log: dict) -> None:
    """Write config.json, model.safetensors, tokenizer files, generation_config.json,
    training_log.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    params = dict(model.named_parameters())
    tensors = {theirs: params[ours].detach().float().contiguous()
               for ours, theirs in hf_weight_names(cfg).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
         "model_max_length": cfg.max_position_embeddings,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
         "pad_token_id": cfg.pad_token_id, "do_sample": False}, indent=2) + "\n")
    (out_dir / "training_log.json").write_text(json.dumps(log) + "\n")

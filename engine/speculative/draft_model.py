"""A draft model proposes: a smaller model (or the target's own first layers) guesses k tokens.

The draft runs the same kind of forward as the target (engine/runner.py's packed batch, its own
paged KV cache, its own block manager), only cheaper: fewer layers, fewer bytes per weight. Each
step it is shown every decoding request's true tokens and guesses the next k, one token at a time:

    true tokens        p0 p1 p2 o0 o1 o2          the last one, o2, is what the target feeds next
    draft holds        p0 p1 p2 o0 o1 g2 g3        K/V of its own last guesses, maybe wrong
    common prefix      p0 p1 p2 o0 o1 |            with true tokens[:-1]: K/V it can keep
    roll back          g2 g3 taken back            (BlockManager.rollback frees their slots)
    catch up           feed o2 -> guess 1          one packed forward for every request
    guess on           feed guess 1 -> guess 2 ... k - 1 one-token forwards (all requests packed)

The draft never trusts that its guesses were kept: the true tokens decide what it keeps, so it is
exact however the verify step went (kept all, some, none; a preemption, a fork). When every guess
was kept, the catch-up is two tokens (the last guess, never fed, and the target's bonus token);
after a rejection it is one; a new request's is its whole text.

Where the draft comes from (`SpeculativeConfig`):

    method="draft_model", model=<bundled name | folder>   another checkpoint with the same tokenizer
    method="draft_model", model="self"                    a copy of the target, usually quantized
                                                          (quantization="int8" | "int4")
    method="layer_skip", num_draft_layers=n               the target's embeddings, first n layers,
                                                          final norm and lm_head, SHARED (no copy)

Greedy requests take the draft's argmax (after the request's penalties and processors); sampled
requests draw from the draft's own distribution q with the proposer's own generator, and hand q
over with the guesses, which the rejection rule needs (engine/speculative/rejection.py).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.config import EngineConfig, SpeculativeConfig
from engine.kv.block_manager import BlockManager
from engine.kv.kv_pool import PagedKVPool, plan_num_blocks
from engine.loading.loader import load_model
from engine.loading.quantization import quantize_model
from engine.model import LlamaModel
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampling import SamplingState, make_generator, processed_logits, sampling_probs
from engine.scheduler import ScheduledWork
from engine.speculative.proposer import DraftRequest, Proposal
from engine.speed import accelerate
from engine.surgery import replaced
from engine.tokenizer import eos_ids

SELF = "self"  # speculative_config.model: a copy of the target itself
# speculative_config.quantization -> engine/loading/quantization.py's weight-only scheme. int4 in
# groups of 32 inputs: GGUF's Q4 block size, and 32 divides every width of tinylab and SmolLM2
# (groups of 128 would not divide tinylab's 704 or SmolLM2's 576).
DRAFT_SCHEMES = {"int8": "int8", "int4": "int4-g32"}
# A seeded request's draft draws from seed + this: the target's verify step draws from the seed
# itself, and a guess drawn with the same random numbers as the acceptance test that judges it
# would no longer be an independent draw (the rejection rule's exactness needs one).
DRAFT_SEED_OFFSET = 0x5EED
SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes a 64-bit seed


# ---- where the draft's weights come from ---------------------------------------------------------


def draft_proposer(config: SpeculativeConfig, target: LlamaModel, tokenizer=None,
                   engine_config: EngineConfig | None = None,
                   num_threads: int = 1) -> DraftModelProposer:
    """The proposer of a "draft_model" or "layer_skip" config, for `target` (called by
    engine/speculative/registry.py). engine_config: the target engine's, for the draft's speed,
    block size and pool size (None: the reference speed and the default cache)."""
    model = draft_model(config, target, engine_config.speed if engine_config else "reference")
    return DraftModelProposer(model, config.num_speculative_tokens,
                              (engine_config or EngineConfig()).cache.block_size,
                              model.config.max_position_embeddings, engine_config, num_threads,
                              name=config.method, eos_token_ids=eos_ids(target, tokenizer))


# the quantized draft's matmul kernel per engine speed: the reference dequantizes in PyTorch (slow,
# readable); the fast engine runs our C kernel (kernels/quant_matmul), which its C layers call
QUANT_BACKEND = {"reference": "torch", "fast": "native"}


def draft_model(config: SpeculativeConfig, target: LlamaModel,
                speed: str = "reference") -> LlamaModel:
    """The draft `config` names, in the target's dtype and on its device, its quantized matmuls
    (if any) on `speed`'s kernel."""
    if config.method == "layer_skip":
        return layer_skip_model(target, config.num_draft_layers)
    if config.method != "draft_model":
        raise ValueError(f"speculative_config.method={config.method!r} has no draft model; "
                         "use 'draft_model' or 'layer_skip'")
    weight = target.embed_tokens.weight
    if config.model == SELF:
        model = copy.deepcopy(target)
    else:
        model = load_model(config.model, dtype=weight.dtype)[0].to(weight.device)
    draft_v, target_v = model.config.vocab_size, target.config.vocab_size
    if draft_v != target_v:
        raise ValueError(f"speculative_config.model={config.model!r} has vocab_size={draft_v}, "
                         f"the target has vocab_size={target_v}: a draft must share the target's "
                         "tokenizer; pick a draft trained with it")
    if config.quantization is not None:
        quantize_model(model, DRAFT_SCHEMES[config.quantization], backend=QUANT_BACKEND[speed])
    return model.eval()


def layer_skip_model(target: LlamaModel, num_layers: int) -> LlamaModel:
    """The target cut after `num_layers` decoder layers: a LlamaModel whose embeddings, layers,
    norm and lm_head ARE the target's modules (engine/surgery.py shares every tensor not replaced),
    so the draft brings no weights of its own (at speed="fast" the fast wing packs a copy of the
    layers it runs, as it does of the target's).

        target   embed ─ layer 0 ─ layer 1 ─ ... ─ layer L-1 ─ norm ─ lm_head
        draft    embed ─ layer 0 ─ ... ─ layer n-1 ─────────── norm ─ lm_head   (the same objects)
    """
    total = target.config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) \
            or not 1 <= num_layers < total:
        raise ValueError(f"speculative_config.num_draft_layers={num_layers!r} must be an integer "
                         f"in [1, {total - 1}]: below the target's num_hidden_layers={total} "
                         "(all of them would be the target itself)")
    first = nn.ModuleList(target.layers[:num_layers])
    shell = replaced(target, lambda name, module: first if name == "layers" else None)
    shell.config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
    return shell


def plan_draft_blocks(model_config, engine_config: EngineConfig, k_max: int, block_size: int,
                      dtype: torch.dtype) -> int:
    """The draft pool's blocks: the target engine's cache rule applied to the draft's shape (the
    same `num_blocks`, or the same bytes), plus room for every sequence's k guesses (the draft
    holds a request's tokens AND its guesses, and shares no prefix)."""
    cache = dataclasses.replace(engine_config.cache, block_size=block_size)
    seqs = engine_config.scheduler.max_num_seqs
    return plan_num_blocks(model_config, cache, seqs, dtype) + seqs * -(-k_max // block_size)


# ---- the proposer -------------------------------------------------------------------------------


@dataclass
class _DraftSequence:
    """One request as the draft holds it: `request.prompt_token_ids` are exactly the tokens whose
    K/V its cache holds (a Request so the runner can feed it like any other), and the random
    stream its sampled guesses are drawn from."""

    request: Request
    generator: torch.Generator

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def seq_id(self) -> int:
        return self.request.seq_id


class DraftModelProposer:
    """Guesses with a draft model that keeps its own paged KV cache, caught up from the true
    tokens at every step (see the module docstring).

    model: the draft (a LlamaModel of the target's vocabulary); k_max: at most this many guesses
    per request; block_size / num_blocks: the draft pool's layout (num_blocks None: planned from
    engine_config, `plan_draft_blocks`); max_tokens_per_seq: the draft's context, past which it
    guesses less; engine_config: the speed the draft runs at (None: reference); eos_token_ids:
    what min_tokens keeps out of a guess, as it does for the target.
    """

    def __init__(self, model: LlamaModel, k_max: int, block_size: int, max_tokens_per_seq: int,
                 engine_config: EngineConfig | None = None, num_threads: int = 1, *,
                 num_blocks: int | None = None, name: str = "draft_model",
                 eos_token_ids: Sequence[int] = ()):
        engine_config = engine_config or EngineConfig(speed="reference")
        self.name, self.k_max, self.max_tokens_per_seq = name, k_max, max_tokens_per_seq
        self.eos_token_ids = list(eos_token_ids)
        weight = model.embed_tokens.weight
        self.device = weight.device
        if num_blocks is None:
            num_blocks = plan_draft_blocks(model.config, engine_config, k_max, block_size,
                                           weight.dtype)
        # no prefix caching: every block is this proposer's, freed by rollback and forget
        self.block_manager = BlockManager(num_blocks, block_size)
        pool = PagedKVPool.for_model(model.config, num_blocks, block_size, weight.dtype,
                                     self.device)
        self.runner = ModelRunner(accelerate(model.eval(), pool, engine_config,
                                             model.config.sliding_window, num_threads))
        self._seqs: dict[str, _DraftSequence] = {}
        self._seq_ids = itertools.count()

    def held(self, request_id: str) -> list[int]:
        """The tokens whose K/V the draft holds for a request ([] when it holds none)."""
        seq = self._seqs.get(request_id)
        return list(seq.tokens) if seq else []

    def forget(self, request_id: str) -> None:
        """Free the request's draft blocks (a no-op for a request it never saw)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq.seq_id)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Up to `num_draft_tokens` guesses per request: one catch-up forward for all of them, then
        one one-token forward per further guess. A request the draft has no room for (blocks,
        context) gets fewer guesses, or none."""
        wanted = [self._room(r) for r in requests]
        asked = [i for i, k in enumerate(wanted) if k > 0]
        for i in asked:  # every rollback first: the slots they free serve this step's catch-ups
            self._roll_back(requests[i])
        work = {i: w for i in asked if (w := self._catch_up(requests[i])) is not None}
        guesses: dict[int, list[int]] = {i: [] for i in work}
        probs: dict[int, list[Tensor]] = {i: [] for i in work}
        while work:
            logits = self._forward(list(work.values()))  # [len(work), V], in work's order
            for i, row in zip(work, logits, strict=True):
                token, q = self._choose(row, requests[i], guesses[i])
                guesses[i].append(token)
                if q is not None:
                    probs[i].append(q)
            work = {i: w for i in work if len(guesses[i]) < wanted[i]
                    and (w := self._feed(requests[i].request_id, guesses[i][-1])) is not None}
        return [Proposal(guesses.get(i, []),
                         torch.stack(probs[i]) if probs.get(i) else None)
                for i in range(len(requests))]

    # ---- the catch-up --------------------------------------------------------------------------
    def _room(self, r: DraftRequest) -> int:
        """Guesses to make for r: what it asks, at most k_max, and no fed position past the draft's
        context (it feeds the last true token at len - 1 and guesses 1..k-1 after it)."""
        return min(r.num_draft_tokens, self.k_max, self.max_tokens_per_seq - len(r.token_ids) + 1)

    def _sequence(self, r: DraftRequest) -> _DraftSequence:
        """The request's draft state, made empty on first sight."""
        seq = self._seqs.get(r.request_id)
        if seq is None:
            shadow = Request(r.request_id, next(self._seq_ids), None, [], r.params, 0.0)
            self.block_manager.allocate(shadow.seq_id, 0)
            seed = r.params.seed
            generator = make_generator(None if seed is None
                                       else (seed + DRAFT_SEED_OFFSET) % SEED_MODULUS, self.device)
            seq = self._seqs[r.request_id] = _DraftSequence(shadow, generator)
        return seq

    def _roll_back(self, r: DraftRequest) -> None:
        """Keep only the longest common prefix of what the draft holds and the true tokens but the
        last (which is fed again below, for its logits)."""
        seq = self._sequence(r)
        keep = common_prefix_length(seq.tokens, r.token_ids[:-1])
        self.block_manager.rollback(seq.seq_id, len(seq.tokens) - keep)
        del seq.tokens[keep:]

    def _catch_up(self, r: DraftRequest) -> ScheduledWork | None:
        """Work feeding the true tokens the draft lacks, scoring the last; None (nothing changed)
        when its blocks do not fit."""
        seq = self._seqs[r.request_id]
        start = len(seq.tokens)
        missing = r.token_ids[start:]  # at least the last true token
        if not self.block_manager.can_append_slots(seq.seq_id, len(missing)):
            return None
        slots = self.block_manager.append_slots(seq.seq_id, len(missing)).slots
        seq.tokens.extend(missing)
        # one token reads like a decode (the fast wing's decode step covers it); more, a chunk
        phase = "decode" if len(missing) == 1 else "prefill"
        return ScheduledWork(seq.request, start, len(seq.tokens), phase, slots, scored=1)

    def _feed(self, request_id: str, guess: int) -> ScheduledWork | None:
        """Work feeding one guess to get the next; None when no block is left for it."""
        seq = self._seqs[request_id]
        if not self.block_manager.can_append_slots(seq.seq_id, 1):
            return None
        slots = self.block_manager.append_slots(seq.seq_id, 1).slots
        seq.tokens.append(guess)
        return ScheduledWork(seq.request, len(seq.tokens) - 1, len(seq.tokens), "decode", slots,
                             scored=1)

    def _forward(self, work: list[ScheduledWork]) -> Tensor:
        """One packed forward of the draft: logits [len(work), V] of each work's last row."""
        _, logits = self.runner.execute(self.block_manager.take_moves(), work, self.block_manager)
        return logits

    def _choose(self, row: Tensor, r: DraftRequest,
                guesses: list[int]) -> tuple[int, Tensor | None]:
        """The next guess from the draft's logits row [V], and q [V] when it was drawn.

        The history the request's penalties and processors see: its true tokens (we are not told
        where its prompt ends, so all of them as the prompt) and the guesses so far as the output.
        A guess's history only shapes how good it is, never what the target emits."""
        seq = self._seqs[r.request_id]
        split = len(r.token_ids) if r.num_prompt_tokens is None else r.num_prompt_tokens
        state = SamplingState(r.params, seq.generator, list(r.token_ids[:split]),
                              list(r.token_ids[split:]) + list(guesses))
        processed = processed_logits(row, state, self.eos_token_ids)
        if r.params.greedy:
            return int(torch.argmax(processed)), None
        q = sampling_probs(processed, r.params).float().to(seq.generator.device)  # [V]
        return int(torch.multinomial(q, 1, generator=seq.generator)), q


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared at C speed: the draft holds a prefix of the truth
        return n
    return next(i for i in range(n) if a[i] != b[i])

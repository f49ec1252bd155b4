"""Chapter 12: the draft-model proposer (engine/speculative/draft_model.py).

The claims:
- greedy outputs with every kind of draft (a copy of the target, a quantized copy, the target's first layers, an
  unrelated model of the same vocabulary) equal the plain engine's token for token, at both speeds, with requests
  joining and leaving the batch; every draft block is free once every request is done;
- a draft with the target's own weights gets every guess kept;
- the catch-up is exact: a proposer that lived through rejections guesses what the draft model itself guesses from
  the true tokens with no cache at all (and what a fresh proposer guesses);
- sampled guesses come with the rows q they were drawn from, and a seeded request's guesses repeat;
- a draft out of blocks guesses less, never raises; bad drafts are refused by name.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.companions.metrics import spec_decode_stats
from engine.config import SpeculativeConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine.speculative.draft_model import DraftModelProposer, draft_proposer
from engine.speculative.proposer import DraftRequest
from engine_fixtures import VOCAB, random_model

SPEEDS = ["reference", "fast"]
K = 3  # guesses per step: enough to be rejected at every position, few enough to keep the tests quick
TARGET = random_model(seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 1 to 40 tokens, some repeating themselves (so the guesses of a good draft are kept)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 20))]
        out.append(body * 2 if i % 2 else body)
    return out


def run(model, prompt_ids, speed: str, spec: dict | None = None, proposer=None, params=GREEDY):
    """Every prompt through one engine of max_num_seqs=2 (so requests queue, join and leave)."""
    engine = LLMEngine(model, None, engine_config("random", speed=speed, max_num_seqs=2, block_size=4,
                                                  speculative_config=spec), proposer=proposer)
    ids = [engine.add_request(p, params) for p in prompt_ids]
    while engine.has_unfinished_requests():
        engine.step()
    return engine, [engine.get_request(i).output_token_ids for i in ids]


DRAFTS = {  # name -> (speculative_config, or a proposer maker)
    "self": {"method": "draft_model", "model": "self", "num_speculative_tokens": K},
    "self int4": {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": K},
    "layer_skip": {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": K},
    "other model": lambda speed: DraftModelProposer(random_model(seed=7), K, 4, 96,
                                                    engine_config("random", speed=speed)),
}


@pytest.mark.parametrize("speed", SPEEDS)
@pytest.mark.parametrize("draft", list(DRAFTS))
def test_greedy_outputs_with_each_draft_equal_the_plain_engine(speed, draft):
    work = prompts(5)
    _, plain = run(TARGET, work, speed)
    spec = DRAFTS[draft]
    proposer = None if isinstance(spec, dict) else spec(speed)
    engine, outs = run(TARGET, work, speed, spec if isinstance(spec, dict) else None, proposer)
    assert outs == plain
    stats = spec_decode_stats(engine.trace)
    assert stats.num_draft_tokens > 0  # guesses were made and verified
    assert engine.proposer.block_manager.usage().used_blocks == 0  # every request forgotten, every block free
    assert not [e for s in engine.trace.steps for e in s.events if e["type"] == "speculation_error"]


@pytest.mark.parametrize("speed", SPEEDS)
def test_tinylabs_greedy_output_with_a_layer_skip_draft_equals_the_plain_llm(speed):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    texts = ["Q: 347+85=", "Once upon a time", "k1=4 k2=9 k3=1. k2?"]
    plain = LLM("tinylab", speed=speed, max_num_seqs=2).generate(texts, params, use_tqdm=False)
    llm = LLM("tinylab", speed=speed, max_num_seqs=2,
              speculative_config={"method": "layer_skip", "num_draft_layers": 3, "num_speculative_tokens": K})
    spec = llm.generate(texts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.proposer.name == "layer_skip"
    assert spec_decode_stats(llm.engine.trace).num_accepted_tokens > 0


@pytest.mark.parametrize("speed", SPEEDS)
def test_a_draft_with_the_targets_own_weights_gets_every_guess_kept(speed):
    engine, _ = run(TARGET, prompts(4, seed=1), speed, DRAFTS["self"])
    stats = spec_decode_stats(engine.trace)
    assert stats.num_draft_tokens > 10
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_layer_skip_draft_shares_the_targets_modules():
    proposer = draft_proposer(SpeculativeConfig(method="layer_skip", num_draft_layers=1), TARGET)
    draft = proposer.runner.model
    assert draft.embed_tokens is TARGET.embed_tokens and draft.lm_head is TARGET.lm_head
    assert draft.norm is TARGET.norm and list(draft.layers) == [TARGET.layers[0]]
    assert draft.config.num_hidden_layers == 1 and TARGET.config.num_hidden_layers == 2  # the target is intact
    assert proposer.runner.kv_pool.num_layers == 1  # its own cache: one layer deep


# ---- the catch-up is exact ---------------------------------------------------------------------------------------


def no_cache_greedy(model, tokens: list[int], k: int) -> list[int]:
    """The oracle: the draft's greedy continuation of the true tokens, each step a full forward with no cache."""
    out = list(tokens)
    with torch.inference_mode():
        for _ in range(k):
            out.append(int(model(torch.tensor([out]), last_only=True)[0].argmax()))
    return out[len(tokens):]


def asks(truths: dict[str, list[int]], k: int = K) -> list[DraftRequest]:
    return [DraftRequest(rid, list(tokens), GREEDY, k) for rid, tokens in truths.items()]


@pytest.mark.parametrize("speed", SPEEDS)
def test_a_proposer_that_lived_through_rejections_guesses_what_the_draft_guesses_afresh(speed):
    draft = random_model(seed=3)
    config = engine_config("random", speed=speed)
    lived = DraftModelProposer(draft, K, 4, 96, config)
    rng = random.Random(0)
    truths = {f"r{i}": [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 9))] for i in range(3)}
    outcomes = set()
    for _ in range(12):
        # some requests sit a step out (their catch-up is longer next time); all are asked in one packed call
        now = {rid: t for rid, t in truths.items() if rng.random() < 0.8} or truths
        got = lived.propose(asks(now))
        fresh = DraftModelProposer(draft, K, 4, 96, config).propose(asks(now))
        for (rid, tokens), proposal, again in zip(now.items(), got, fresh, strict=True):
            assert proposal.token_ids == no_cache_greedy(draft, tokens, K) == again.token_ids, rid
            assert proposal.probs is None  # greedy: chosen, not drawn
            # the "target" keeps a random prefix of the guesses, then says something else (or the bonus token)
            kept = rng.randint(0, K)
            outcomes.add(kept)
            own = rng.choice([t for t in range(2, VOCAB) if kept == K or t != proposal.token_ids[kept]])
            truths[rid] = tokens + proposal.token_ids[:kept] + [own]
    assert outcomes == set(range(K + 1))  # rejected at every position, and all kept


def test_forget_frees_every_draft_block():
    proposer = DraftModelProposer(random_model(seed=3), K, 4, 96)
    truths = {f"r{i}": list(range(2, 2 + 5 * (i + 1))) for i in range(3)}
    proposals = proposer.propose(asks(truths))
    bm = proposer.block_manager
    # it holds each request's tokens and the guesses it fed (all but the last)
    assert proposer.held("r2") == truths["r2"] + proposals[2].token_ids[:K - 1]
    assert bm.usage().used_blocks > 0
    for rid in truths:
        proposer.forget(rid)
    proposer.forget("never seen")  # nothing to drop, no error
    assert bm.usage().used_blocks == 0 and bm.seq_ids() == [] and proposer.held("r0") == []


def test_a_draft_out_of_blocks_guesses_less_and_never_raises():
    proposer = DraftModelProposer(random_model(seed=3), K, 4, 96, num_blocks=3)  # 12 slots in all
    short, long = list(range(2, 8)), list(range(2, 30))  # 6 tokens fit (+ 2 guesses fed = 8); 28 never do
    first, second = proposer.propose(asks({"short": short, "long": long}))
    assert second.token_ids == []
    assert first.token_ids == no_cache_greedy(proposer.runner.model, short, K)
    more = [40, 41, 42]
    crowded = proposer.propose(asks({"short": short, "more": more}))
    # "short" keeps its 2 blocks, "more" gets the last one: its 3 tokens and 1 fed guess fill it, and the guesses
    # stop there
    assert crowded[0].token_ids == first.token_ids
    assert crowded[1].token_ids == no_cache_greedy(proposer.runner.model, more, K)[:2]


# ---- sampling ----------------------------------------------------------------------------------------------------


def test_sampled_guesses_carry_the_rows_they_were_drawn_from_and_repeat_with_a_seed():
    draft = random_model(seed=3)
    sampled = SamplingParams(temperature=1.5, top_k=20, seed=11, max_tokens=20)
    requests = [DraftRequest("s", [5, 6, 7, 8], sampled, K), DraftRequest("g", [9, 10], GREEDY, K)]
    first = DraftModelProposer(draft, K, 4, 96).propose(requests)
    again = DraftModelProposer(draft, K, 4, 96).propose(requests)
    q = first[0].probs
    assert q.shape == (K, VOCAB) and q.dtype == torch.float32
    assert torch.allclose(q.sum(dim=-1), torch.ones(K))
    assert all(q[i, g] > 0 for i, g in enumerate(first[0].token_ids))
    assert ((q > 0).sum(dim=-1) <= sampled.top_k).all()  # drawn from the request's own filters
    assert first[1].probs is None  # the greedy request in the same batch: chosen, not drawn
    assert first[0].token_ids == again[0].token_ids and torch.equal(q, again[0].probs)


@pytest.mark.parametrize("speed", SPEEDS)
def test_sampled_requests_run_with_a_draft_to_the_end(speed):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=16, n=2, ignore_eos=True)
    engine, outs = run(TARGET, prompts(3, seed=2), speed, DRAFTS["self"], params=params)
    assert all(len(o) == 16 for o in outs)
    stats = spec_decode_stats(engine.trace)
    assert stats.num_accepted_tokens > 0  # the same model: most draws are kept
    assert not [e for s in engine.trace.steps for e in s.events if e["type"] == "speculation_error"]
    assert engine.proposer.block_manager.usage().used_blocks == 0


# ---- bad drafts ---------------------------------------------------------------------------------------------------


def test_a_draft_of_another_vocabulary_is_refused_naming_both_sizes():
    config = SpeculativeConfig(method="draft_model", model="tinylab")  # 1024 tokens; the target has 101
    with pytest.raises(ValueError, match=r"vocab_size=1024.*vocab_size=101"):
        draft_proposer(config, TARGET)


@pytest.mark.parametrize("layers", [2, 5])
def test_a_layer_skip_draft_as_deep_as_the_target_is_refused(layers):
    config = SpeculativeConfig(method="layer_skip", num_draft_layers=layers)
    with pytest.raises(ValueError, match=rf"num_draft_layers={layers}.*num_hidden_layers=2"):
        draft_proposer(config, TARGET)

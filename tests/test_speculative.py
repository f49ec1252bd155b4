"""Chapter 12: speculative decoding is lossless.

Greedy: with any proposer, however wrong its guesses, every output equals the naive loop's token for token,
under the engine fuzz's configurations (arrivals, aborts, failing steps, tiny pools, both preemption modes,
prefix caching with a host tier, sliding windows, n > 1), with the block manager's invariants checked after
every step. Sampling: the rejection rule draws from exactly the target's distribution (a chi-square test over
10,000 seeded requests), and a planted wrong rule fails the same test.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from engine import llm_engine, runner
from engine.companions.metrics import spec_decode_stats
from engine.config import SpeculativeConfig
from engine.kv.prefix_cache import block_hashes
from engine.llm_engine import LLMEngine, engine_config
from engine.request import RUNNING
from engine.sampling import SamplingParams, SamplingState, processed_logits, sampling_probs
from engine.speculative import rejection
from engine.speculative.ngram import NgramProposer, ngram_guess
from engine.speculative.proposer import DraftRequest, Proposal
from engine_fixtures import VOCAB
from test_engine_fuzz import MODEL, FailSwitch, Trial, check_invariants, naive_tokens

NUM_SPEC_TRIALS = 24
K = 3  # guesses per step in the fuzz: enough to reject at every position, small enough to cross blocks often
CORRUPT = 0.25  # the oracle proposer's chance of a wrong guess at each position


# ---- prompt lookup ---------------------------------------------------------------------------------


def test_ngram_copies_what_followed_the_latest_earlier_match():
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]
    assert ngram_guess(tokens, k=2, min_n=1, max_n=2) == [8, 2]  # "5 6" last seen before at 4 -> 8 2
    assert ngram_guess(tokens, k=5, min_n=2, max_n=2) == [8, 2, 9, 5, 6]


def test_ngram_prefers_the_longest_suffix_that_matches():
    tokens = [3, 4, 9, 1, 4, 7, 0, 3, 4]
    # the 1-gram "4" last occurred at 4 (-> 7), but the 2-gram "3 4" at 0 (-> 9) wins
    assert ngram_guess(tokens, k=1, min_n=1, max_n=3) == [9]
    assert ngram_guess(tokens, k=1, min_n=1, max_n=1) == [7]


def test_ngram_guesses_nothing_without_a_match_or_room():
    assert ngram_guess([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []
    assert ngram_guess([1, 2, 1, 2], k=0, min_n=1, max_n=3) == []
    assert ngram_guess([7], k=3, min_n=1, max_n=3) == []


# ---- the config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, named", [
    ({"method": "eagle"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "model": "tinylab"}, "model"),
    ({"method": "draft_model"}, "model"),
    ({"method": "layer_skip"}, "num_draft_layers"),
    ({"method": "ngram", "typo_tokens": 4}, "typo_tokens"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_a_bad_speculative_config_is_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.from_dict(options)


def test_the_llm_takes_vllms_dict_and_refuses_a_bad_one():
    config = engine_config("random", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        engine_config("random", speculative_config="ngram")


# ---- greedy: the fuzz ------------------------------------------------------------------------------


class OracleProposer:
    """Guesses the naive loop's own continuation, corrupted at random positions and cut at random lengths:
    every kind of outcome (all kept, none kept, a rejection at each position) comes up often."""

    name = "oracle"

    def __init__(self, trial: SpecTrial, rng: random.Random):
        self.trial, self.rng, self.forgotten = trial, rng, set()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self.guess(r)) for r in requests]

    def guess(self, r: DraftRequest) -> list[int]:
        prompt, max_tokens = self.trial.expected[r.request_id]
        truth = naive_tokens(prompt, max_tokens, self.trial.config["sliding_window"])
        done = len(r.token_ids) - len(prompt)
        assert r.token_ids[len(prompt):] == truth[:done], "the proposer must see the true tokens"
        upcoming = truth[done:] + [self.rng.randrange(2, VOCAB) for _ in range(K)]
        guesses = [t if self.rng.random() > CORRUPT else self.rng.randrange(2, VOCAB) for t in upcoming]
        return guesses[:self.rng.randint(0, r.num_draft_tokens)]

    def forget(self, request_id: str) -> None:
        self.forgotten.add(request_id)


class SpecTrial(Trial):
    """The engine fuzz's trial with guesses: the oracle proposer in most trials, prompt lookup and a
    layer-skipping draft model in some."""

    def __init__(self, seed: int, switches: dict, speed: str):
        super().__init__(seed, switches, speed)
        spec = {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": None, "max_verify_rows": None}
        proposer = NgramProposer(1, 2) if seed % 4 == 0 else OracleProposer(self, random.Random(seed))
        if seed % 4 == 1:  # the target's own first layer as the draft, with its own paged cache
            spec, proposer = {**spec, "method": "layer_skip", "num_draft_layers": 1}, None
        self.engine = LLMEngine(MODEL, None, engine_config(model="random", speed=speed, **self.config,
                                                           speculative_config=spec), proposer=proposer)


def check_hashes_of_computed_blocks(engine: LLMEngine) -> None:
    """No stale hash: every full block of a running sequence's computed tokens that carries a hash carries
    the hash of exactly those tokens (a rolled-back guess must never stay hashed as if it were real)."""
    bm = engine.block_manager
    cache = bm.prefix_cache
    if cache is None:
        return
    for req in engine.scheduler.running:
        if req.seq_id not in bm:
            continue
        full = min(req.num_computed_tokens, req.num_tokens) // bm.block_size
        expected = block_hashes(req.all_token_ids[:full * bm.block_size], bm.block_size, req.cache_key)
        for block, h in zip(bm.block_table(req.seq_id)[:full], expected, strict=True):
            got = cache.hash_of(block) if block >= 0 else None
            assert got in (None, h), f"block {block} of {req.request_id} has a stale hash"


@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_greedy_with_wrong_guesses_equals_the_naive_loop_under_the_fuzz(monkeypatch, speed):
    modules = {"run_model": runner, "sample": llm_engine}
    switches = {name: FailSwitch(getattr(module, name)) for name, module in modules.items()}
    for name, switch in switches.items():
        monkeypatch.setattr(modules[name], name, switch)
    seen, stats = Counter(), []
    original_step = LLMEngine.step

    def checked_step(engine):
        report = original_step(engine)
        check_hashes_of_computed_blocks(engine)
        assert all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running
                   if r.status == RUNNING and r.output_token_ids and r.seq_id in engine.block_manager
                   and r.num_computed_tokens >= len(r.prompt_token_ids))
        return report

    monkeypatch.setattr(LLMEngine, "step", checked_step)
    for seed in range(NUM_SPEC_TRIALS):
        trial = SpecTrial(seed, switches, speed)
        try:
            trial.run()
            trial.check_outcome()
            check_invariants(trial.engine)
        except AssertionError as e:
            raise AssertionError(f"trial seed={seed} speed={speed} config={trial.config}: {e}") from e
        stats.append(spec_decode_stats(trial.engine.trace))
        for report in trial.engine.trace.steps:
            seen.update(e.get("mode", e["type"]) for e in report.events)
            for s in report.scheduled:
                if s.draft_token_ids:
                    seen["all kept" if s.num_accepted == len(s.draft_token_ids) else
                         "none kept" if s.num_accepted == 0 else "some kept"] += 1
                    seen["several tokens out"] += s.tokens_out > 1
    # the fuzz went where it should: every verify outcome, rollbacks next to preemption, forks, failures
    for kind in ("all kept", "none kept", "some kept", "several tokens out", "swap", "recompute", "forked",
                 "aborted", "window_freed", "prefix_hit", "drafts_cut"):
        assert seen[kind] > 0, (kind, seen)
    assert sum(s.num_accepted_tokens for s in stats) > 0


def test_a_failing_proposer_costs_its_guesses_not_the_request():
    class Broken:
        name = "broken"

        def propose(self, requests):
            raise RuntimeError("proposer bug")

        def forget(self, request_id):
            pass

    engine = LLMEngine(MODEL, None, engine_config("random", num_blocks=64, block_size=4), proposer=Broken())
    prompt, params = [5, 9, 12, 40], SamplingParams(temperature=0, max_tokens=6)
    rid = engine.add_request(prompt, params)
    with pytest.warns(UserWarning, match="proposer failed"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.get_request(rid).output_token_ids == naive_tokens(tuple(prompt), 6)
    assert any(e["type"] == "speculation_error" for r in engine.trace.steps for e in r.events)


@pytest.mark.parametrize("bad, why", [([VOCAB + 3], "vocabulary"), ([2, 3, 4, 5, 6, 7, 8, 9], "at most")])
def test_guesses_outside_the_vocabulary_or_too_many_are_refused(bad, why):
    class Wrong:
        name = "wrong"

        def propose(self, requests):
            return [Proposal(list(bad)) for _ in requests]

        def forget(self, request_id):
            pass

    engine = LLMEngine(MODEL, None, engine_config("random", num_blocks=64, block_size=4), proposer=Wrong())
    rid = engine.add_request([5, 9, 12], SamplingParams(temperature=0, max_tokens=5))
    with pytest.warns(UserWarning, match=why):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.get_request(rid).output_token_ids == naive_tokens((5, 9, 12), 5)


def test_a_busy_step_runs_without_guesses_and_says_why():
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2}
    engine = LLMEngine(MODEL, None, engine_config("random", num_blocks=64, block_size=4, speculative_config=spec))
    for prompt in ([4, 5, 4, 5, 4], [7, 8, 7, 8, 7]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    off = [r for r in engine.trace.steps if any(e["type"] == "speculation_off" for e in r.events)]
    assert off and all(not s.draft_token_ids for r in off for s in r.scheduled)
    assert "disable_by_batch_size=2" in next(e for e in off[0].events if e["type"] == "speculation_off")["reason"]


# ---- verification, one position at a time -----------------------------------------------------------


def test_greedy_verification_keeps_the_agreeing_prefix_and_adds_the_targets_token():
    rows = torch.full((4, 6), -5.0)
    for i, t in enumerate([3, 1, 4, 2]):  # the target's argmax after each fed token
        rows[i, t] = 5.0
    state = SamplingState(SamplingParams(temperature=0))
    assert [t for t, _ in rejection.verify(rows, [3, 1, 5], state, [])] == [3, 1, 4]  # 5 rejected, 4 instead
    assert [t for t, _ in rejection.verify(rows, [3, 1, 4], state, [])] == [3, 1, 4, 2]  # all kept + bonus
    assert [t for t, _ in rejection.verify(rows, [0, 1, 4], state, [])] == [3]


def test_verification_applies_penalties_with_the_kept_guesses_in_the_history():
    """A repetition penalty at position i must see the guesses kept before it, as plain decoding would."""
    rows = torch.tensor([[0.0, 3.0, 2.9, 0.0], [0.0, 3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    state = SamplingState(params, prompt_ids=[0], output_ids=[3])
    # position 0: token 1 wins (3.0 vs 2.9); position 1: 1 was just kept, so it is penalized and 2 wins
    assert [t for t, _ in rejection.verify(rows, [1], state, [])] == [1, 2]


# ---- sampling: distribution-exact ---------------------------------------------------------------------

SMALL_VOCAB = 12
NUM_SAMPLES = 10_000
PROMPT = [3, 7, 5]
P_VALUE = 0.01


def small_model():
    from engine.config import ModelConfig
    from engine.model import LlamaModel

    cfg = ModelConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, eos_token_id=0)
    torch.manual_seed(11)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else p.fill_(1.0)
    return model.eval()


class FixedQProposer:
    """Draws each guess from one fixed distribution q, far from the target's, and says so."""

    name = "fixed-q"

    def __init__(self, q: torch.Tensor):
        self.q, self.gen = q, torch.Generator().manual_seed(5)

    def propose(self, requests):
        out = []
        for r in requests:
            guesses = torch.multinomial(self.q, r.num_draft_tokens, replacement=True, generator=self.gen)
            out.append(Proposal(guesses.tolist(), self.q.expand(r.num_draft_tokens, -1).clone()))
        return out

    def forget(self, request_id):
        pass


def target_marginals(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact P(2nd token) and P(3rd token) of sampling 3 tokens after PROMPT, enumerated over the vocab
    with full no-cache forwards."""
    def probs(ids):  # [N, T] -> the sampler's distribution after each sequence [N, V]
        with torch.no_grad():
            logits = model(torch.tensor(ids))[:, -1].float()
        return torch.stack([sampling_probs(processed_logits(row, SamplingState(params, prompt_ids=list(s)), [0]),
                                           params) for row, s in zip(logits, ids, strict=True)])

    V = SMALL_VOCAB
    p1 = probs([PROMPT])[0]  # [V]
    p2 = probs([PROMPT + [a] for a in range(V)])  # [V, V]: p(b | a)
    p3 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)  # p(c | a, b)
    joint2 = p1[:, None] * p2  # [V, V]
    return joint2.sum(0), (joint2[..., None] * p3).sum((0, 1))


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (cells expected < 5 pooled)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def speculative_counts(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sample 3 tokens after PROMPT NUM_SAMPLES times (each request its own seed) with k = 1 guess drawn from a
    q unlike the target's; returns the counts of the 2nd and 3rd tokens and how many guesses were kept."""
    q = torch.softmax(torch.linspace(2.0, -2.0, SMALL_VOCAB), dim=0)
    spec = {"method": "ngram", "num_speculative_tokens": 1, "disable_by_batch_size": None, "max_verify_rows": None}
    engine = LLMEngine(model, None, engine_config("small", speed="reference", max_num_seqs=64, block_size=4,
                                                  num_blocks=256, enable_prefix_caching=False,
                                                  speculative_config=spec), proposer=FixedQProposer(q))
    ids = [engine.add_request(PROMPT, SamplingParams(**{**vars(params), "seed": i, "max_tokens": 3,
                                                        "ignore_eos": True, "logits_processors": []}))
           for i in range(NUM_SAMPLES)]
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.get_request(i).output_token_ids for i in ids]
    second = torch.bincount(torch.tensor([o[1] for o in outs]), minlength=SMALL_VOCAB)
    third = torch.bincount(torch.tensor([o[2] for o in outs]), minlength=SMALL_VOCAB)
    return second, third, spec_decode_stats(engine.trace).num_accepted_tokens


@pytest.fixture(scope="module")
def model_and_marginals():
    model = small_model()
    params = SamplingParams(temperature=0.9, top_p=0.95)
    return model, params, target_marginals(model, SamplingParams(temperature=0.9, top_p=0.95, ignore_eos=True))


def test_speculative_sampling_draws_from_exactly_the_target_distribution(model_and_marginals):
    model, params, (p2, p3) = model_and_marginals
    second, third, kept = speculative_counts(model, params)
    assert 0 < kept < NUM_SAMPLES  # guesses were both kept and rejected
    assert chi_square_p_value(second, p2) > P_VALUE
    assert chi_square_p_value(third, p3) > P_VALUE  # the bonus token, and plain decoding after a rejection


def test_the_same_test_rejects_a_planted_wrong_rule(model_and_marginals, monkeypatch):
    """"Keep the guess when the target likes it at least as much as the proposer" is a classic mistake:
    deterministic, it over-keeps what both like and never draws the residual where it should."""
    model, params, (p2, _) = model_and_marginals
    monkeypatch.setattr(rejection, "accepts", lambda p, q, u: p >= q)
    second, _, _ = speculative_counts(model, params)
    assert chi_square_p_value(second, p2) < P_VALUE


# ---- the rest of the engine: int8 KV, stop strings, logprobs, seeds ------------------------------------

TINY_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None, "max_verify_rows": None}
# copying prompts: prompt lookup's guesses are often right, so verify steps keep several tokens
COPYING = ["Make JSON: the name is Ada, city Oslo, 41 years old, job is baker.\nJSON:",
           "Finn lived in a small house near the school. Finn lived in a small house near the",
           "k1=5; k2=7; k3=9; k4=2; Question: k3? Answer:"]


@pytest.fixture(scope="module")
def tinylab():
    from engine.loading.loader import load_model

    return load_model("tinylab")


def run_llm(tinylab, params, **options):
    from engine.llm import LLM

    llm = LLM(*tinylab, max_num_seqs=4, **options)
    return llm, llm.generate(COPYING, params, use_tqdm=False)


@pytest.mark.parametrize("speed", ["reference", "fast"])
def test_int8_kv_and_stop_strings_give_the_same_text_with_guesses(tinylab, speed):
    params = SamplingParams(temperature=0, max_tokens=32, stop=['"job"', " golden"])
    _, plain = run_llm(tinylab, params, speed=speed, kv_cache_dtype="int8")
    llm, spec = run_llm(tinylab, params, speed=speed, kv_cache_dtype="int8", speculative_config=TINY_SPEC)
    for a, b in zip(plain, spec, strict=True):
        assert (b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason) == \
            (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason)
    assert any(r.outputs[0].finish_reason == "stop" for r in spec)  # a stop string fired inside a verify step
    assert spec_decode_stats(llm.engine.trace).num_accepted_tokens > 0


def test_logprobs_of_verified_tokens_equal_plain_decodings(tinylab):
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3)
    _, plain = run_llm(tinylab, params)
    llm, spec = run_llm(tinylab, params, speculative_config=TINY_SPEC)
    assert spec_decode_stats(llm.engine.trace).num_accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert y.token_id == x.token_id and list(y.top) == list(x.top)
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def test_seeded_speculative_sampling_repeats_run_to_run(tinylab):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=24)
    first = [o.token_ids for r in run_llm(tinylab, params, speculative_config=TINY_SPEC)[1] for o in r.outputs]
    again = [o.token_ids for r in run_llm(tinylab, params, speculative_config=TINY_SPEC)[1] for o in r.outputs]
    assert first == again

"""Chapter 12's experiments (engine/lab/speculative.py): they drive the engine's own speculation and count
honestly; the simulated verify steps keep p, the planted mistake does not, and the chi-square agrees with a
table."""

import gc

import pytest
import torch

from engine.lab.speculative import (
    UNLIKELY_TOKEN,
    FixedGuesses,
    chi_square,
    choose_if_p_at_least_q,
    decode_speed,
    expected_tokens_per_step,
    next_token_logits,
    serve_side_by_side,
    speculative_steps,
    step_clock,
    verify_step_costs,
    workload_prompts,
)
from engine.lab.tasks import eval_examples
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.sampling import SamplingParams
from engine.trace import ScheduledRequest, StepReport, TimeSplit

P_VALUE = 0.001  # a correct sampler fails these tests once in a thousand seeds; ours are fixed
CHI2_1DOF_P05 = 3.841  # the chi-square table: P(X > 3.841) = 0.05 for 1 degree of freedom


@pytest.fixture(scope="module")
def tinylab():
    return load_model("tinylab")


def _counts(steps, vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([t for s in steps for t in s]), minlength=vocab)


@pytest.mark.parametrize("alpha, k", [(0.0, 3), (0.3, 1), (0.6, 4), (0.9, 8), (1.0, 5)])
def test_expected_tokens_per_step_sums_the_chance_of_reaching_each_position(alpha, k):
    assert expected_tokens_per_step(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))


@pytest.mark.parametrize("alpha, k", [(-0.1, 2), (1.1, 2), (0.5, -1)])
def test_expected_tokens_per_step_refuses_what_is_not_a_chance_or_a_count(alpha, k):
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(alpha, k)


def test_the_chi_square_agrees_with_the_table():
    stat, dof, p_value = chi_square(torch.tensor([60, 40]), torch.tensor([0.5, 0.5]))
    assert (stat, dof) == (pytest.approx(4.0), 1)  # (60-50)^2/50 + (40-50)^2/50
    assert p_value < 0.05  # 4.0 > 3.841
    stat, _, p_value = chi_square(torch.tensor([53, 47]), torch.tensor([0.5, 0.5]))
    assert stat < CHI2_1DOF_P05 and p_value > 0.05
    assert chi_square(torch.tensor([30, 70]), torch.tensor([0.3, 0.7]))[2] == pytest.approx(1.0)


def test_the_chi_square_pools_tokens_expected_too_rarely():
    probs = torch.tensor([0.49, 0.49, 0.01, 0.01])  # 100 samples: the last two expect 1 each
    _, dof, _ = chi_square(torch.tensor([50, 48, 1, 1]), probs)
    assert dof == 1  # two bins left (the rare pool, expecting 2, joins the smaller one)
    _, dof, _ = chi_square(torch.tensor([500, 480, 10, 10]), probs)
    assert dof == 3  # 1,000 samples: every token expects 10


SMALL_P_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0]).log_softmax(-1)
SMALL_Q = torch.tensor([0.05, 0.30, 0.30, 0.05, 0.25, 0.05])  # over-rates tokens 1, 2 and 4


def test_simulated_verify_steps_emit_tokens_distributed_as_the_target():
    p = torch.softmax(SMALL_P_LOGITS, -1)
    steps = speculative_steps(SMALL_P_LOGITS, SMALL_Q, k=3, num_tokens=6000, seed=1)
    assert chi_square(_counts(steps, 6), p)[2] > P_VALUE
    assert all(1 <= len(s) <= 4 for s in steps)


def test_simulated_steps_are_as_long_as_the_formula_says():
    p = torch.softmax(SMALL_P_LOGITS, -1)
    alpha = float(torch.minimum(p, SMALL_Q).sum())
    for k in (1, 4):
        steps = speculative_steps(SMALL_P_LOGITS, SMALL_Q, k=k, num_tokens=8000, seed=k)
        mean = sum(map(len, steps)) / len(steps)
        assert mean == pytest.approx(expected_tokens_per_step(alpha, k), abs=0.06)


def test_the_p_at_least_q_mistake_is_caught_by_the_same_test():
    """p = (0.4, 0.6), q = (0.6, 0.4): a guess of token 0 is always rejected by the mistake, and the residual
    max(0, p - q) = (0, 0.2) never gives 0 back, so token 0 never comes out."""
    logits, q = torch.tensor([0.4, 0.6]).log(), torch.tensor([0.6, 0.4])
    wrong = speculative_steps(logits, q, k=2, num_tokens=2000, choose_fn=choose_if_p_at_least_q)
    right = speculative_steps(logits, q, k=2, num_tokens=2000)
    p = torch.tensor([0.4, 0.6])
    assert chi_square(_counts(wrong, 2), p)[2] < P_VALUE
    assert chi_square(_counts(right, 2), p)[2] > P_VALUE


def test_simulated_steps_refuse_a_q_that_is_not_a_distribution():
    with pytest.raises(ValueError, match="q must be a distribution"):
        speculative_steps(SMALL_P_LOGITS, SMALL_Q * 2, k=2, num_tokens=10)


def test_workload_prompts_put_worked_examples_of_other_documents_before_the_prompt():
    plain = workload_prompts("json", 3)
    shown = workload_prompts("json", 3, examples_before=2)
    assert plain == [ex.prompt for ex in eval_examples("json", 3)]
    for prompt, own, ex in zip(shown, plain, eval_examples("json", 3), strict=True):
        assert prompt.endswith(own) and prompt.count("Make JSON:") == 3
        assert ex.target not in prompt  # the worked examples never give this prompt's answer away
    with pytest.raises(ValueError, match="task="):
        workload_prompts("poems", 1)


def test_fixed_guesses_make_every_decode_a_verify_of_k_plus_one_tokens_that_keeps_none(tinylab):
    model, tok = tinylab
    engine = LLMEngine(model, tok, engine_config(speculative_config={"num_speculative_tokens": 3}),
                       proposer=FixedGuesses(3))
    engine.add_request("Q: 12+30=", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    decodes = [s for step in engine.trace.steps for s in step.scheduled if s.phase == "decode"]
    full = [s for s in decodes if len(s.draft_token_ids) == 3]  # near max_tokens there is room for fewer
    assert len(full) >= 5 and full == decodes[:len(full)]
    assert all(s.tokens_in == 4 and s.num_accepted == 0 and set(s.draft_token_ids) == {UNLIKELY_TOKEN}
               for s in full)
    assert not [e for step in engine.trace.steps for e in step.events if e["type"] == "speculation_error"]


def test_verify_step_costs_time_each_k_over_the_steps_asked_for(tinylab):
    model, tok = tinylab
    rows = verify_step_costs(model, tok, tok.encode("Q: 12+30="), ks=[0, 2], steps=4, warmup=1)
    assert [(r["k"], r["tokens_fed"], r["steps"]) for r in rows] == [(0, 1, 4), (2, 3, 4)]
    assert all(r["step_s"] > 0 and r["clock"] == "thread CPU time" for r in rows)  # conftest: one thread


def test_the_step_clock_is_the_threads_cpu_time_only_with_one_torch_thread():
    before = torch.get_num_threads()
    try:
        assert step_clock()[0] == "thread CPU time"
        torch.set_num_threads(2)
        assert step_clock()[0] == "wall time"
    finally:
        torch.set_num_threads(before)


def test_serving_side_by_side_gives_plain_tokens_and_counts_decode_tokens_and_guesses(tinylab):
    model, tok = tinylab
    prompts = workload_prompts("json", 2, examples_before=1)
    served = serve_side_by_side(model, tok, prompts, {"plain": None, "ngram": {"method": "ngram",
                                                                              "num_speculative_tokens": 3}},
                                max_tokens=24)
    plain, spec = served["plain"], served["ngram"]
    assert gc.isenabled()  # off while stepping (as timeit does), back on after
    assert spec.outputs == plain.outputs and all(plain.outputs)
    assert plain.stats.num_drafts == 0 and spec.stats.num_drafts > 0
    for s in (plain, spec):  # batch 1: each request's first token comes from its prefill step
        assert s.decode_tokens == sum(map(len, s.outputs)) - len(prompts)
        assert s.decode_steps == sum(len(o) - 1 for o in s.outputs) - s.stats.num_accepted_tokens
        assert s.decode_s > 0 and s.decode_step_s == pytest.approx(s.decode_s / s.decode_steps)


def test_next_token_logits_are_the_models_last_row(tinylab):
    model, tok = tinylab
    ids = tok.encode("Make JSON: age 31, called Ana.\nJSON:")
    with torch.inference_mode():
        full = model(torch.tensor([ids]))[0, -1]
    assert torch.allclose(next_token_logits(model, ids), full, atol=1e-5)  # one row vs all rows: rounding


def _step(i, seconds, width=1, tokens=1, phase="decode"):
    return StepReport(i, 0.0, seconds, time_s=TimeSplit(decode=seconds),
                      scheduled=[ScheduledRequest("r", phase, 10, 10 + width, tokens)])


def test_decode_speed_counts_the_decode_steps_only_by_the_clock_given():
    steps = [_step(0, 0.5, width=8, phase="prefill"), _step(1, 0.01), _step(2, 0.02, width=5, tokens=3)]
    tokens, seconds, n = decode_speed(steps)
    assert (tokens, n) == (1 + 3, 2) and seconds == pytest.approx(0.03)  # the reports' own (wall) times
    assert decode_speed(steps, {0: 9.0, 1: 0.004, 2: 0.006}) == (4, pytest.approx(0.01), 2)

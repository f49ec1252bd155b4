"""Chapter 12's experiments: speculative decoding measured, one function per question.

    verify_step_costs        what a verify step of k + 1 tokens costs next to a plain decode step,
                             through the engine itself (one request, k fixed guesses per step)
    workload_prompts         the workloads: tinylab's recall, json and story prompts
                             (engine/lab/tasks.py), alone or after worked examples of their task
    serve_side_by_side       the same greedy prompts through several engines (plain, and each
                             speculative config), step by step in turn; decode speed and
                             acceptance of each; its tokens must equal plain decoding's
    step_clock               what we time a step with: the thread's CPU time with one torch
                             thread (a shared machine's other processes do not count), else wall
    next_token_logits        a model's logits for the token after some text: p for the target,
                             q for a draft (engine/speculative/draft_model.py's layer skip)
    speculative_steps        verify steps simulated on ONE distribution pair: k guesses drawn
                             from q, each judged by rejection.py's `choose` against p
    chi_square               does a histogram of samples follow p? (statistic, dof, p-value)
    expected_tokens_per_step (1 - alpha^(k + 1)) / (1 - alpha), the mean tokens of a verify step

Nothing here is on a request's path: the engine, the proposers and the verification are the
engine's own (engine/speculative/); we only drive them and count.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.companions.metrics import SpecDecodeStats, spec_decode_stats
from engine.lab.tasks import EVAL_SEED_BASE, TASKS, eval_examples
from engine.llm_engine import LLMEngine, engine_config
from engine.model import LlamaModel
from engine.sampling import SamplingParams, SamplingState, sampling_probs
from engine.speculative.proposer import DraftRequest, Proposal
from engine.speculative.rejection import choose, residual
from engine.trace import StepReport, Trace

BLOCK_SIZE = 16  # CacheConfig's default block size; the pools below are sized in these
# a guess no sensible model predicts after our prompts: token 3 is the first id after the
# tokenizer's specials (<pad> <bos> <eos>) in tinylab's vocabulary
UNLIKELY_TOKEN = 3
# separate the worked examples placed before a prompt (as in engine/lab/tasks.py's documents)
EXAMPLE_SEPARATOR = "\n"
# the worked examples come from another seed range than the prompts they precede, so a
# workload never shows the model its own answer
EXAMPLES_SEED_OFFSET = 7_000_000
# chi_square merges the smallest bins until each expects at least this many samples (the usual
# rule for the chi-square approximation to hold)
MIN_EXPECTED_COUNT = 5


# ---- why it works: the cost of a verify step -----------------------------------------------------


class FixedGuesses:
    """A proposer that always guesses the same token, k times: every step becomes a verify step of
    k + 1 tokens, and (the guess being absurd) keeps none, so the context stays put and every
    step measures the same thing."""

    name = "fixed"

    def __init__(self, k: int, token_id: int = UNLIKELY_TOKEN):
        self.k, self.token_id = k, token_id

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal([self.token_id] * min(self.k, r.num_draft_tokens)) for r in requests]

    def forget(self, request_id: str) -> None:
        """Nothing to drop."""


def is_decode_step(report: StepReport) -> bool:
    """Every request of the step decodes (no prefill chunk shares its time)."""
    return bool(report.scheduled) and all(x.phase == "decode" for x in report.scheduled)


def step_clock() -> tuple[str, Callable[[], float]]:
    """(name, clock) we time a step with. With one torch thread every operation of a step runs in
    the calling thread, so its CPU time (time.thread_time) is the step's work, without the moments
    another process had the core: on a shared machine two identical engines then agree within a
    few percent, where their wall times can differ by half. With more threads the work is spread
    over them, and only the wall clock counts it all."""
    if torch.get_num_threads() == 1:
        return "thread CPU time", time.thread_time
    return "wall time", time.perf_counter


def step_in_turn(engines: Mapping[str, LLMEngine]) -> dict[str, dict[int, float]]:
    """Step every engine in turn until all are done, so that a busy moment of the machine hits
    each alike; {label: {trace index: seconds of that step by step_clock}}.

    Python's garbage collector is off meanwhile, as `timeit` does: a full collection over the
    traces a notebook keeps costs tens of milliseconds, and would be charged to whichever step
    happened to trigger it."""
    _, clock = step_clock()
    seconds: dict[str, dict[int, float]] = {label: {} for label in engines}
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        while any(e.has_unfinished_requests() for e in engines.values()):
            for label, engine in engines.items():
                if engine.has_unfinished_requests():
                    before, start = len(engine.trace.steps), clock()
                    engine.step()
                    if len(engine.trace.steps) > before:  # a step with a report: its index
                        seconds[label][before] = clock() - start
    finally:
        if collecting:
            gc.enable()
    return seconds


def verify_step_costs(model: LlamaModel, tokenizer, prompt_ids: Sequence[int],
                      ks: Sequence[int], steps: int, warmup: int = 3,
                      model_name: str = "tinylab") -> list[dict]:
    """Median seconds of a decode step that feeds k + 1 tokens of one request, for each k
    (k = 0: plain decoding), measured in the engine (default speed) by `step_clock`.

    One engine per k, each serving the same prompt, stepped in turn. Rows: {"k", "tokens_fed",
    "step_s" (the whole step: proposer, schedule, forward, verification), "steps", "clock"}.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    ks = list(ks)
    if not ks or min(ks) < 0:
        raise ValueError(f"ks={ks} must be non-empty, each k >= 0 (0: plain decoding)")
    new_tokens = warmup + steps + 1
    blocks = -(-(len(prompt_ids) + new_tokens + max(ks) + 1) // BLOCK_SIZE) + 1  # one request
    engines = {}
    for k in ks:
        spec = ({"num_speculative_tokens": k, "disable_by_batch_size": None,
                 "max_verify_rows": None} if k else None)
        engine = LLMEngine(model, tokenizer, engine_config(model_name, num_blocks=blocks,
                                                           speculative_config=spec),
                           proposer=FixedGuesses(k) if k else None)
        engine.add_request(list(prompt_ids), SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                            ignore_eos=True), request_id="r")
        engines[k] = engine
    seconds, rows = step_in_turn(engines), []
    for k, engine in engines.items():
        timed = [seconds[k][i] for i, s in enumerate(engine.trace.steps) if is_decode_step(s)]
        timed = timed[warmup:]
        rows.append({"k": k, "tokens_fed": k + 1, "steps": len(timed), "clock": step_clock()[0],
                     "step_s": statistics.median(timed)})
    return rows


# ---- workloads, and serving them side by side ----------------------------------------------------


def workload_prompts(task: str, n: int, examples_before: int = 0,
                     seed: int = EVAL_SEED_BASE) -> list[str]:
    """n held-out prompts of a task from engine/lab/tasks.py, each preceded by `examples_before`
    worked examples of the same task (prompt + answer, one per line), as a prompt with examples
    would be:

        examples_before = 2:   Make JSON: ... JSON: {"name": "Jun", ...}⏎
                               Make JSON: ... JSON: {"age": 37, ...}⏎
                               Make JSON: city Kyiv, 25 years old.⏎JSON:      <- the prompt
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} must be one of {TASKS}")
    if n < 1 or examples_before < 0:
        raise ValueError(f"n={n} must be >= 1 and examples_before={examples_before} >= 0")
    prompts = eval_examples(task, n, seed=seed)
    shown = eval_examples(task, n * examples_before, seed=seed + EXAMPLES_SEED_OFFSET)
    return ["".join(ex.text + EXAMPLE_SEPARATOR
                    for ex in shown[i * examples_before:(i + 1) * examples_before]) + p.prompt
            for i, p in enumerate(prompts)]


@dataclass
class Served:
    """One engine's run of a workload."""

    label: str
    outputs: list[list[int]]  # each prompt's output token ids, in prompt order
    stats: SpecDecodeStats  # drafts, guesses, kept (all zero for plain decoding)
    decode_tokens: int  # tokens emitted by pure decode steps
    decode_s: float  # their seconds by step_clock (the whole step: proposer and verification)
    decode_steps: int  # how many there were
    trace: Trace  # the engine's, for engine/viz/speculative.py's verify-step picture

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else math.nan

    @property
    def decode_step_s(self) -> float:
        """Mean seconds of a pure decode step."""
        return self.decode_s / self.decode_steps if self.decode_steps else math.nan


def decode_speed(reports: Sequence[StepReport],
                 seconds: Mapping[int, float] | None = None) -> tuple[int, float, int]:
    """(tokens, seconds, steps) of a run's pure decode steps: the tokens they emitted, their time
    (each step's from `seconds`, {index in reports: seconds}, or else its report's wall time) and
    their number."""
    tokens, total, steps = 0, 0.0, 0
    for i, s in enumerate(reports):
        if is_decode_step(s):
            tokens += sum(x.tokens_out for x in s.scheduled)
            total += s.time_s.total if seconds is None else seconds[i]
            steps += 1
    return tokens, total, steps


def serve_side_by_side(model: LlamaModel, tokenizer, prompts: Sequence[str | Sequence[int]],
                       configs: Mapping[str, dict | None], max_tokens: int, batch_size: int = 1,
                       model_name: str = "tinylab") -> dict[str, Served]:
    """Serve the same greedy prompts with each config ({label: speculative_config, None for plain
    decoding}), at most `batch_size` requests at a time (max_num_seqs), all engines stepped in
    turn and each step timed by `step_clock`.

    Greedy speculation must give plain decoding's tokens exactly: when a config has a plain one
    beside it and they differ, we raise (a wrong engine would make every number here
    meaningless)."""
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    ids = [f"r{i}" for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engines = {}
    for label, spec in configs.items():
        engine = LLMEngine(model, tokenizer, engine_config(model_name, max_num_seqs=batch_size,
                                                           speculative_config=spec))
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(prompt if isinstance(prompt, str) else list(prompt), params,
                               request_id=rid)
        engines[label] = engine
    seconds = step_in_turn(engines)
    served = {label: Served(label, [e.get_request(i).output_token_ids for i in ids],
                            spec_decode_stats(e.trace.steps),
                            *decode_speed(e.trace.steps, seconds[label]), e.trace)
              for label, e in engines.items()}
    plain = [s for label, s in served.items() if configs[label] is None]
    for s in served.values():
        if plain and s.outputs != plain[0].outputs:
            raise AssertionError(f"{s.label!r} emitted other tokens than plain decoding: "
                                 "greedy speculation must be exact")
    return served


# ---- the acceptance rule, on real distributions ----------------------------------------------


@torch.inference_mode()
def next_token_logits(model: LlamaModel, token_ids: Sequence[int]) -> Tensor:
    """The logits [V] a model gives the token after `token_ids` (one forward, no cache)."""
    ids = torch.tensor([list(token_ids)], device=model.embed_tokens.weight.device)  # [1, T]
    return model(ids, last_only=True)[0].float().cpu()  # [V]


def choose_if_p_at_least_q(processed: Tensor, state: SamplingState, guess: int | None,
                           q: Tensor | None) -> tuple[int, bool]:
    """THE CLASSIC MISTAKE, for the chapter to test: `choose` with its random acceptance replaced
    by "keep the guess when p(guess) >= q(guess)" (the residual draw unchanged). A guess the
    target likes a little less than the draft is now always rejected, so tokens the draft
    over-rates come out too rarely: the output is no longer distributed as p."""
    p = sampling_probs(processed, state.params)  # [V]
    if guess is None:
        return int(torch.multinomial(p, 1, generator=state.generator)), False
    if p[guess] >= q[guess]:
        return guess, True
    return int(torch.multinomial(residual(p, q), 1, generator=state.generator)), False


def speculative_steps(target_logits: Tensor, q: Tensor, k: int, num_tokens: int,
                      temperature: float = 1.0, seed: int = 0,
                      choose_fn: Callable = choose) -> list[list[int]]:
    """Verify steps simulated on one pair of distributions, until `num_tokens` are emitted.

    Every position has the same target row (p = the sampler's distribution for target_logits
    at `temperature`) and the same draft distribution q [V]: a step draws up to k guesses from
    q, judges them in order with `choose_fn` (rejection.py's `choose`: the engine's own rule),
    stops at the first rejection (whose token is the residual's draw), and adds the bonus token
    when all k were kept. Returns each step's emitted tokens. Every emitted token should be
    distributed as p; a step's mean length as expected_tokens_per_step(sum(min(p, q)), k).
    """
    if k < 1 or num_tokens < 1:
        raise ValueError(f"k={k} and num_tokens={num_tokens} must be >= 1")
    if q.shape != target_logits.shape or not math.isclose(float(q.sum()), 1.0, abs_tol=1e-4):
        raise ValueError(f"q must be a distribution of the target row's shape "
                         f"{tuple(target_logits.shape)}, got {tuple(q.shape)} summing to "
                         f"{float(q.sum()):.4f}")
    state = SamplingState(SamplingParams(temperature=temperature, seed=seed))
    draft = torch.Generator().manual_seed(seed + 1)  # the guesses: a stream of their own
    steps, emitted = [], 0
    while emitted < num_tokens:
        out = []
        for _ in range(k):
            guess = int(torch.multinomial(q, 1, generator=draft))
            token, kept = choose_fn(target_logits, state, guess, q)
            out.append(token)
            if not kept:
                break
        else:  # every guess kept: the bonus token, drawn from p
            out.append(choose_fn(target_logits, state, None, None)[0])
        steps.append(out)
        emitted += len(out)
    return steps


def chi_square(counts: Tensor, probs: Tensor,
               min_expected: float = MIN_EXPECTED_COUNT) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of Pearson's test that `counts` [V] were drawn from
    `probs` [V]. Tokens expected fewer than `min_expected` times are pooled into one bin (their
    own would break the test's approximation), which joins the others when even the pool is
    that small. A p-value below 0.01: these counts are very unlikely under probs."""
    counts, probs = counts.double(), probs.double()
    n = float(counts.sum())
    if n <= 0 or counts.shape != probs.shape:
        raise ValueError(f"counts {tuple(counts.shape)} must hold samples, in probs' shape "
                         f"{tuple(probs.shape)}")
    expected = n * probs / probs.sum()
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    if float(expected[~big].sum()) >= min_expected:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    elif exp:  # a tiny pool joins the smallest big bin
        i = min(range(len(exp)), key=lambda j: float(exp[j]))
        obs[i], exp[i] = obs[i] + counts[~big].sum(), exp[i] + expected[~big].sum()
    stat = sum(float((o - e) ** 2 / e) for o, e in zip(obs, exp, strict=True))
    dof = len(exp) - 1
    if dof < 1:
        raise ValueError("fewer than two bins expect enough samples: draw more samples")
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                            torch.tensor(stat / 2.0, dtype=torch.float64)))
    return stat, dof, p_value


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Mean tokens a verify step of k guesses emits when each guess is kept with probability alpha,
    independently: 1 + alpha + alpha^2 + ... + alpha^k = (1 - alpha^(k + 1)) / (1 - alpha)
    (the target's own token always, the i-th guess when the first i were all kept)."""
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"alpha={alpha} must be in [0, 1] and k={k} >= 0")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)

"""Request lengths that look like real traffic: lognormal prompts and answers, seeded,
clipped to a context.

Serving experiments live or die by the lengths of the requests. Real chat traffic is *skewed*: most
prompts are a few hundred tokens, a few are very long, and answers are shorter and less spread out.
A lognormal distribution has that shape (its logarithm is a normal distribution), and two numbers
describe it: the **median** m (half the requests are shorter) and the spread **sigma** of the log.

    length = round(exp(N(ln m, sigma^2)))        mean = m * exp(sigma^2 / 2)

    sigma = 1.0, m = 256:  mean ~422, 1 request in 10 above ~920, 1 in 100 above ~2620
    sigma = 0.8, m = 128:  mean ~176, 1 in 10 above ~357

Every sampled request then satisfies ``1 <= prompt_len``, ``1 <= output_len`` and
``prompt_len + output_len <= max_context``: the prompt is cut to leave room for at least one
answer token, and the answer is cut to what the context has left (a model cannot write past its
context window). Cutting changes the distribution's far tail, which is exactly what a real server
with a context limit sees.

We draw with Python's ``random.Random(seed)``: the same seed gives the same requests on every
machine and every Python version, with no global random state touched. Chapters 04 and 05 and the
benchmarks share these functions so that they all talk about the same traffic.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.companions.metrics import nearest_rank
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.trace import StepReport, Trace

# tokens: a common context window, and what a contiguous cache reserves for every sequence
DEFAULT_MAX_CONTEXT = 2048


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal prompt and output lengths, each given by its median (tokens)
    and log-spread sigma."""

    prompt_median: float = 256.0
    prompt_sigma: float = 1.0
    output_median: float = 128.0
    output_sigma: float = 0.8

    def __post_init__(self) -> None:
        for name in ("prompt_median", "output_median"):
            value = getattr(self, name)
            if not value >= 1:
                raise ValueError(f"LengthDistribution.{name} must be >= 1 token, got {value!r}")
        for name in ("prompt_sigma", "output_sigma"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"LengthDistribution.{name} must be >= 0 "
                                 f"(0 makes every length the median), got {value!r}")


# Roughly the shape of chat traffic: a long tail of prompts (mean ~420 tokens),
# shorter answers (mean ~175).
CHAT = LengthDistribution()


@dataclass(frozen=True)
class RequestLengths:
    """One request: prompt tokens, then the answer's tokens
    (``total`` is what its KV cache holds)."""

    prompt_len: int
    output_len: int

    @property
    def total(self) -> int:
        return self.prompt_len + self.output_len


def _lognormal_int(rng: random.Random, median: float, sigma: float) -> int:
    """One lognormal draw, rounded, at least 1 token."""
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


def sample_request_lengths(n: int, seed: int, max_context: int = DEFAULT_MAX_CONTEXT,
                           distribution: LengthDistribution = CHAT) -> list[RequestLengths]:
    """``n`` requests drawn from ``distribution``, each fitting in ``max_context`` tokens.

    For each request we draw the prompt, then the output (in that order, from one generator),
    so request i is the same whatever ``n`` is: asking for more requests only appends.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0 (the number of requests), got {n!r}")
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
        raise ValueError("max_context must be an int >= 2 (one prompt token and one answer "
                         f"token), got {max_context!r}")
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = _lognormal_int(rng, distribution.prompt_median, distribution.prompt_sigma)
        prompt = min(prompt, max_context - 1)  # leave room for one answer token
        output = _lognormal_int(rng, distribution.output_median, distribution.output_sigma)
        output = min(output, max_context - prompt)  # the answer stops where the context ends
        requests.append(RequestLengths(prompt, output))
    return requests


def total_lengths(requests: list[RequestLengths]) -> list[int]:
    """Each request's final length (prompt + output): the most KV slots it ever holds."""
    return [r.total for r in requests]


def length_summary(lengths: list[int]) -> dict[str, float]:
    """count, mean, median, p90, p99 and max of a list of lengths (nearest-rank percentiles)."""
    if not lengths:
        raise ValueError("lengths is empty: need at least one length to summarise")
    ordered = sorted(lengths)
    median, p90, p99 = (nearest_rank(ordered, q) for q in (50, 90, 99))
    return {"count": len(ordered), "mean": sum(ordered) / len(ordered), "median": median,
            "p90": p90, "p99": p99, "max": ordered[-1]}


# ---- arrivals: requests that come in over time ---------------------------------------------------


@dataclass
class Arrival:
    """A request due at engine step `step` (added just before that step runs)."""

    step: int
    prompt: str | list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    request_id: str | None = None
    priority: int = 0
    tenant: str | None = None
    label: str = ""  # what the live view calls it (e.g. the task)


def run_arrivals(engine: LLMEngine, arrivals: Sequence[Arrival], max_steps: int | None = None,
                 on_step: Callable[[StepReport, LLMEngine], None] | None = None) -> Trace:
    """Step `engine` until every arrival is added and finished (or `max_steps` steps ran).

    Before step k we add every arrival with `step <= k`. When the engine is idle and the next
    arrival is later, the step runs empty (the timeline then shows the gap). Returns `engine.trace`.
    """
    pending = sorted(arrivals, key=lambda a: a.step)
    nxt, first_step = 0, len(engine.trace)
    while nxt < len(pending) or engine.has_unfinished_requests():
        done = len(engine.trace) - first_step
        if max_steps is not None and done >= max_steps:
            break
        while nxt < len(pending) and pending[nxt].step <= done:
            a = pending[nxt]
            engine.add_request(a.prompt, a.params, a.request_id, a.priority, a.tenant)
            nxt += 1
        report = engine.step()
        if on_step is not None:
            on_step(report, engine)
    return engine.trace

"""Planted incidents (chapter 10): reproducible engine runs in which something goes wrong halfway,
each leaving a `Trace` for `engine.serving.diagnose` (and a student) to explain.

Every scenario is the same steady workload (requests of two tenants arriving at a fixed pace, step
by step, with seeded random prompts and fixed output lengths), healthy in its first half; halfway,
one thing changes:

    healthy              nothing changes (the control: the diagnosis must call it healthy)
    long_prompts         the traffic mix shifts: new prompts are several times longer
    kv_pool_too_small    the KV pool was sized too small: running requests keep preempting each
                         other
    slow_detokenizer     a detokenizer upgrade costs milliseconds per token (a delay in a wrapper)
    tenant_flood         one tenant starts sending several requests per step
    prefix_cache_collapse  a new chat template puts a per-request line BEFORE the shared system
                         prompt, so no two prompts share a prefix any more (the deploy recorded the
                         change)
    pruned_model         a deploy swaps in the model cut to its first half of layers: every step is
                         faster, and the answers are wrong (the deploy recorded the change)

The last one is invisible to steps (1)-(5) of the troubleshooting order, which look for slowness.
Its requests are probes with known answers (held-out `arith` examples of engine/lab/tasks.py); after
the run we score the answers of each half and store them in `trace.config["quality"]` as {version:
rows of engine/lab/eval.py}, the quality record that step (6) of `engine.serving.diagnose` compares.

Arrivals are tied to engine steps, not to the wall clock, and every answer has exactly its drawn
length (greedy, EOS ignored): the queues, blocks, preemptions and cache hits are the same on every
machine; only the seconds differ.

`overload_burst` is no incident but the same kind of run: requests arriving faster than the seats
turn over, to compare what a `Degradation` policy (engine/serving/admission.py) keeps of the SLO.

    python -m engine.lab.incidents --out runs/incidents     # one TRACE.json per scenario
    python -m engine diagnose runs/incidents/tenant_flood.json

A deploy tool writes what it changed into the trace as an event of the step at which it happened:

    {"type": "config_changed", "what": "chat_template", "old": "v1", "new": "v2"}
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.lab import tasks
from engine.llm_engine import LLMEngine, engine_config
from engine.model import LlamaModel
from engine.sampling import SamplingParams
from engine.serving.admission import Degradation, Rejected
from engine.trace import Trace

MODEL = "tinylab"
# 16 before the incident, 16 after: enough for medians, a few seconds per scenario
NUM_REQUESTS = 32
# steady load: about half a seat-turnover per step with ~16-token answers
STEPS_BETWEEN_ARRIVALS = 2
PROMPT_TOKENS = (24, 40)  # uniform range of a normal prompt
LONG_PROMPT_TOKENS = (160, 240)  # after the mix shift: about 6x longer
OUTPUT_TOKENS = (8, 14)
MAX_NUM_SEQS = 8
SMALL_POOL_BLOCKS = 8  # block_size 16: room for ~3 requests of ~45 tokens, while 8 seats are open
FLOOD_PER_STEP = 2  # the flooding tenant's requests per step (the normal pace is one per 2 steps)
# A real flood arrives at a rate in seconds; ours is tied to steps, and the flood's steps are
# slower (fuller batches), so in seconds the flood would look milder than it is, and on a busy
# machine too mild for `diagnose` to call it one. Pacing every step to at least this long (above a
# full tinylab step) makes the step the clock: arrivals per second = arrivals per step / floor.
FLOOD_STEP_FLOOR_S = 0.012
DETOKENIZER_DELAY_S = 0.003  # per token: ~10x what detokenizing one token costs, ~1 tinylab forward
SYSTEM_PROMPT_TOKENS = 96  # the shared system prompt (6 blocks of 16) in the prefix-cache scenario
USER_TOKENS = 8
# of tinylab's 6: half the forward's work, and its arithmetic gone (exact match ~0.8 -> 0)
PRUNED_LAYERS_KEPT = 3
# the overload burst: 4 seats at BURST_MAX_TOKENS finish a request every 8 steps; one arrives every
# 3 steps, so the queue grows by ~5 requests per 24 steps for as long as the burst lasts
BURST_REQUESTS = 48
BURST_SEATS = 4
BURST_STEPS_BETWEEN_ARRIVALS = 3
BURST_MAX_TOKENS = 32
BURST_LONG_MAX_TOKENS = 256  # every BURST_LONG_EVERY-th request asks for a long answer
BURST_LONG_EVERY = 6
# one request in BURST_INTERACTIVE_EVERY is interactive (tenant "chat", priority 0): alone they come
# at 1 per 9 steps, less than the seats finish; the others are batch jobs (tenant "batch"): they may
# wait
BURST_INTERACTIVE_EVERY = 3
LOW_PRIORITY = 1


@dataclass
class Arrival:
    step: int  # added just before this engine step
    prompt: list[int] | str
    max_tokens: int
    tenant: str
    template_version: str | None = None
    # a probe with a known answer: scored after the run (quality record)
    example: tasks.Example | None = None
    priority: int = 0  # vLLM's: lower is served first


@dataclass
class Scenario:
    name: str
    description: str
    arrivals: list[Arrival]
    options: dict = field(default_factory=dict)  # engine_config options
    at_half: Callable[[LLMEngine], None] | None = None  # what happens at the middle step
    # the quality record's names for the halves
    versions: tuple[str, str] = ("first half", "second half")
    # each step lasts at least this long (0: as long as it takes); see FLOOD_STEP_FLOOR_S
    step_floor_s: float = 0.0


# ---- workloads -----------------------------------------------------------------------------------


def _prompt(rng: random.Random, lo_hi: tuple[int, int], vocab: list[int]) -> list[int]:
    return [rng.choice(vocab) for _ in range(rng.randint(*lo_hi))]


def steady(rng: random.Random, vocab: list[int], n: int = NUM_REQUESTS, first_step: int = 0,
           prompt_tokens: Callable[[int], tuple[int, int]] = lambda i: PROMPT_TOKENS
           ) -> list[Arrival]:
    """n requests, one every STEPS_BETWEEN_ARRIVALS steps, tenants "a" and "b" taking turns."""
    return [Arrival(first_step + i * STEPS_BETWEEN_ARRIVALS, _prompt(rng, prompt_tokens(i), vocab),
                    rng.randint(*OUTPUT_TOKENS), "ab"[i % 2]) for i in range(n)]


def _half_step() -> int:
    return NUM_REQUESTS // 2 * STEPS_BETWEEN_ARRIVALS


def scenarios(vocab: list[int], seed: int = 0) -> dict[str, Scenario]:
    rng = random.Random(seed)
    half = NUM_REQUESTS // 2
    out = [
        Scenario("healthy", "a steady load of two tenants; nothing changes", steady(rng, vocab)),
        Scenario("long_prompts", "halfway, the traffic mix shifts to prompts about 6x longer",
                 steady(rng, vocab,
                        prompt_tokens=lambda i: PROMPT_TOKENS if i < half else LONG_PROMPT_TOKENS)),
        Scenario("kv_pool_too_small",
                 f"the KV pool has {SMALL_POOL_BLOCKS} blocks for {MAX_NUM_SEQS} seats",
                 steady(rng, vocab), {"num_blocks": SMALL_POOL_BLOCKS}),
        Scenario("slow_detokenizer",
                 f"halfway, detokenizing costs {DETOKENIZER_DELAY_S * 1e3:g} ms per token",
                 steady(rng, vocab), at_half=_slow_down_detokenizer),
        _tenant_flood(rng, vocab),
        _prefix_cache_collapse(rng, vocab),
        _pruned_model(rng, vocab, seed),
    ]
    return {s.name: s for s in out}


def overload_burst(vocab: list[int], seed: int = 0, n: int = BURST_REQUESTS) -> Scenario:
    """n requests, one every BURST_STEPS_BETWEEN_ARRIVALS steps, on BURST_SEATS seats: more than
    twice what the seats finish. One in BURST_INTERACTIVE_EVERY is tenant "chat" (priority 0), the
    others tenant "batch" (LOW_PRIORITY); every BURST_LONG_EVERY-th (a batch job) asks for
    BURST_LONG_MAX_TOKENS tokens, the rest for BURST_MAX_TOKENS."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(n):
        chat = i % BURST_INTERACTIVE_EVERY == 0
        long = i % BURST_LONG_EVERY == BURST_LONG_EVERY - 1
        arrivals.append(Arrival(i * BURST_STEPS_BETWEEN_ARRIVALS,
                                _prompt(rng, PROMPT_TOKENS, vocab),
                                BURST_LONG_MAX_TOKENS if long else BURST_MAX_TOKENS,
                                "chat" if chat else "batch", priority=0 if chat else LOW_PRIORITY))
    return Scenario("overload_burst",
                    f"{n} requests, one every {BURST_STEPS_BETWEEN_ARRIVALS} steps, "
                    f"on {BURST_SEATS} seats", arrivals, {"max_num_seqs": BURST_SEATS})


def _tenant_flood(rng: random.Random, vocab: list[int]) -> Scenario:
    arrivals = steady(rng, vocab)
    last = arrivals[-1].step  # the flood lasts from halfway to the last steady arrival
    flood = [Arrival(_half_step() + i // FLOOD_PER_STEP, _prompt(rng, PROMPT_TOKENS, vocab),
                     rng.randint(*OUTPUT_TOKENS), "flood")
             for i in range((last - _half_step() + 1) * FLOOD_PER_STEP)]
    return Scenario("tenant_flood",
                    f"halfway, tenant 'flood' sends {FLOOD_PER_STEP} requests per step",
                    sorted(arrivals + flood, key=lambda a: a.step),
                    step_floor_s=FLOOD_STEP_FLOOR_S)


def _prefix_cache_collapse(rng: random.Random, vocab: list[int]) -> Scenario:
    """Template v1: system prompt, then the user's line (a shared prefix); v2 puts the user's
    line first."""
    system = _prompt(rng, (SYSTEM_PROMPT_TOKENS, SYSTEM_PROMPT_TOKENS), vocab)
    arrivals = []
    for i, a in enumerate(steady(rng, vocab)):
        user = _prompt(rng, (USER_TOKENS, USER_TOKENS), vocab)
        v2 = i >= NUM_REQUESTS // 2
        arrivals.append(Arrival(a.step, user + system if v2 else system + user, a.max_tokens,
                                a.tenant, "v2" if v2 else "v1"))
    return Scenario("prefix_cache_collapse",
                    "halfway, a new chat template puts the user's line before the "
                    "shared system prompt", arrivals, {"enable_prefix_caching": True},
                    at_half=_record_template)


def _pruned_model(rng: random.Random, vocab: list[int], seed: int) -> Scenario:
    """The steady pace and lengths, but every prompt an arith probe (its answer known), so the
    halves can be scored; halfway the model is swapped for its first PRUNED_LAYERS_KEPT layers."""
    probes = tasks.eval_examples("arith", NUM_REQUESTS, seed=tasks.EVAL_SEED_BASE + seed)
    arrivals = [Arrival(a.step, ex.prompt, a.max_tokens, a.tenant, example=ex)
                for a, ex in zip(steady(rng, vocab), probes, strict=True)]
    return Scenario("pruned_model",
                    f"halfway, a deploy swaps in the model cut to its first {PRUNED_LAYERS_KEPT} "
                    "layers: faster steps, wrong answers", arrivals, at_half=_swap_in_pruned_model,
                    versions=(MODEL, _pruned_name()))


# ---- what happens halfway ------------------------------------------------------------------------


class SlowDetokenizer:
    """Wraps an incremental detokenizer: the same text, `delay_s` later per token."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def push(self, token: int):
        time.sleep(self.delay_s)
        return self.inner.push(token)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SlowTokenizer:
    """The engine's tokenizer with a slow detokenizer; everything else delegated."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def detokenizer(self):
        return SlowDetokenizer(self.inner.detokenizer(), self.delay_s)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _slow_down_detokenizer(engine: LLMEngine) -> None:
    # requests added from now on
    engine.tokenizer = SlowTokenizer(engine.tokenizer, DETOKENIZER_DELAY_S)


def pruned(model: LlamaModel, keep: int) -> LlamaModel:
    """A new model made of `model`'s embeddings, first `keep` decoder layers, final norm and head
    (the same weights for what it keeps; `model` is untouched). Layer i keeps its index, so it reads
    and writes the same KV-cache layer as before: a request in flight goes on with the cache it
    has."""
    small = LlamaModel(dataclasses.replace(model.config, num_hidden_layers=keep))
    small.load_state_dict({name: w for name, w in model.state_dict().items()
                           if not name.startswith("layers.") or int(name.split(".")[1]) < keep})
    return small.to(next(model.parameters()).dtype).eval()


def _pruned_name() -> str:
    return f"{MODEL}-{PRUNED_LAYERS_KEPT}-layers"


def _swap_in_pruned_model(engine: LLMEngine) -> None:
    """The deploy: the engine and its runner (engine/runner.py, which runs the forward) get the
    pruned model; the next step runs on it."""
    engine.use_model(pruned(engine.model, PRUNED_LAYERS_KEPT))  # new weights: a new model_id too
    record_change(engine, "model", MODEL, _pruned_name())


def _record_template(engine: LLMEngine) -> None:
    record_change(engine, "chat_template", "v1", "v2")


def record_change(engine: LLMEngine, what: str, old, new) -> None:
    """Write a `config_changed` event into the last step of the engine's trace
    (what a deploy tool does)."""
    engine.trace.steps[-1].events.append({"type": "config_changed", "what": what, "old": old,
                                          "new": new, "time": engine.clock()})


# ---- running one ---------------------------------------------------------------------------------


def usable_vocab(tokenizer) -> list[int]:
    special = {i for i in (tokenizer.bos_token_id, tokenizer.pad_token_id, *tokenizer.eos_token_ids)
               if i is not None}
    special |= set(tokenizer.tk.get_added_tokens_decoder())
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def run_scenario(scenario: Scenario, model, tokenizer,
                 degradation: Degradation | None = None) -> Trace:
    """Replay the scenario's arrivals step by step until every request is finished;
    returns the trace. With `degradation`, each arrival goes through `Degradation.apply` first
    (the waiting queue as it stands): what it did is counted in `trace.config["degradation"]`."""
    engine = LLMEngine(model, tokenizer,
                       engine_config(MODEL, **{"max_num_seqs": MAX_NUM_SEQS, **scenario.options}))
    engine.trace.config["scenario"] = scenario.name
    pending, step = sorted(scenario.arrivals, key=lambda a: a.step), 0
    probes: list[tuple[Arrival, str]] = []  # (arrival with a known answer, its request id)
    counts = {"shed": 0, "degraded": 0, "capped": 0}
    while pending or engine.has_unfinished_requests():
        if step == _half_step() and scenario.at_half is not None and engine.trace.steps:
            scenario.at_half(engine)
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            rid = _add_arrival(engine, a, degradation, counts)
            if a.example is not None and rid is not None:
                probes.append((a, rid))
        started = time.perf_counter()
        engine.step()  # with nobody there, an empty step: the trace's steps stay the arrival clock
        step += 1
        time.sleep(max(0.0, scenario.step_floor_s - (time.perf_counter() - started)))
    if probes:
        engine.trace.config["quality"] = quality_record(engine, probes, scenario.versions)
    if degradation is not None:
        engine.trace.config["degradation"] = {**dataclasses.asdict(degradation), **counts}
    return engine.trace


def _add_arrival(engine: LLMEngine, a: Arrival, degradation: Degradation | None,
                 counts: dict[str, int]) -> str | None:
    """Add one arrival (through `degradation`, if any); its request id, or None if it was shed."""
    max_tokens = a.max_tokens
    if degradation is not None:
        try:
            served = degradation.apply(a.max_tokens, a.priority, len(engine.scheduler.waiting))
        except Rejected:
            counts["shed"] += 1
            return None
        max_tokens = served.max_tokens
        counts["capped"] += served.capped
        counts["degraded"] += served.degraded
    return engine.add_request(a.prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       ignore_eos=True),
                              priority=a.priority, tenant=a.tenant,
                              template_version=a.template_version)


def quality_record(engine: LLMEngine, probes: list[tuple[Arrival, str]],
                   versions: tuple[str, str]) -> dict:
    """The probes' answers scored by the half they arrived in: {version: rows of engine/lab/eval.py}
    ({"task", "metric", "value", "n"}; the metrics of `tasks.score` that are single numbers)."""
    record = {}
    for version, early in zip(versions, (True, False), strict=True):
        by_task: dict[str, tuple[list, list]] = {}
        for a, rid in probes:
            if (a.step < _half_step()) == early:
                examples, answers = by_task.setdefault(a.example.task, ([], []))
                examples.append(a.example)
                answers.append(engine.get_request(rid).text)
        record[version] = [{"task": task, "metric": metric, "value": value, "n": len(examples)}
                           for task, (examples, answers) in by_task.items()
                           for metric, value in tasks.score(task, examples, answers).items()
                           if not isinstance(value, dict)]
    return record


def run_incident(name: str, seed: int = 0, model=None, tokenizer=None) -> Trace:
    """The trace of one scenario by name (see the module docstring);
    loads tinylab unless given a model."""
    if model is None:
        from engine.loading.loader import load_model

        model, tokenizer = load_model(MODEL)
    table = scenarios(usable_vocab(tokenizer), seed)
    if name not in table:
        raise ValueError(f"unknown incident {name!r}; choose one of {', '.join(table)}")
    return run_scenario(table[name], model, tokenizer)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.lab.incidents",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/incidents",
                   help="folder for one <scenario>.json trace each")
    p.add_argument("--only", default=None, help="comma-separated scenario names (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from engine.loading.loader import load_model

    model, tok = load_model(MODEL)
    table = scenarios(usable_vocab(tok), args.seed)
    names = args.only.split(",") if args.only else list(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        trace = run_scenario(table[name], model, tok)
        trace.save(out / f"{name}.json")
        print(f"{name}: {len(trace)} steps -> {out / name}.json")


if __name__ == "__main__":
    main()

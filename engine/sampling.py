"""Sampling: from one row of logits to the next token.

The model scores every vocabulary entry (a logit each); sampling turns those V numbers into one
token id. We do it in a fixed order, and every stage is a small pure function that chapter 01
calls on its own to plot the distribution after each step:

    logits [V]
      |  penalties      repetition (prompt + output), presence/frequency (output only)
      |  logit bias     OpenAI's logit_bias: a number added to chosen tokens' logits
      |  processors     the request's own logits processors, in order, then its grammar's mask
      |  min_tokens     EOS and the stop ids banned while the output is shorter
      +-----------> greedy? (temperature 0) --> argmax: no randomness at all
      |  temperature    logits / t             t < 1 sharpens, t > 1 flattens
      |  top-k          keep the k largest logits
      |  top-p          keep the smallest head of the sorted distribution whose mass reaches p
      |  min-p          drop tokens less likely than min_p * (the top token's probability)
      v
    softmax --> one draw with the request's own torch.Generator --> token id

The filters run in the order of vLLM's first sampler (V0): top-k, top-p, then min-p. vLLM's V1
sampler applies min-p first, right after temperature. Against top-k the order does not matter (both
keep a set defined by rank or by the ratio to the top token, and their intersection is the same);
against top-p it can: top-p measures mass over what is left, and min-p first removes the tail, so
with both set the two orders may keep different tokens. We keep V0's order so that each stage in
chapter 01's figures narrows the distribution the one before it left.

A dropped token gets the logit -inf, so softmax gives it probability exactly 0 and the survivors
are renormalized for free. Each request (one row of the batch) brings its own SamplingParams, its
own generator (seeded from params.seed, so its tokens never depend on who shares the batch) and
its own token history (for the penalties). We loop over rows because it reads well; vLLM does the
same arithmetic with batched tensor ops.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.config import is_int

# torch.Generator.manual_seed takes a signed or unsigned 64-bit integer
SEED_RANGE = (-(2**63), 2**64 - 1)
# vLLM's _SAMPLING_EPS: a temperature below this is treated as greedy (t -> 0)
GREEDY_EPSILON = 1e-5
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's documented range for presence and frequency penalties
TOP_K_OFF = (0, -1)  # vLLM accepts both spellings of "no top-k"
STAGES = ("temperature", "top_k", "top_p", "min_p")  # the filter stages, in the order we apply them
# A logits processor (vLLM's V0 signature): (the tokens generated so far, one row of logits [V]) ->
# a row of logits [V], new or changed in place. It sees the logits after the penalties, before
# temperature.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's documented range for one token's bias
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (chapter 13; vLLM's `structured_outputs`): set exactly ONE of
    json (a JSON schema, as a dict or its JSON text), regex, choice (a list of strings), grammar (a
    Lark/EBNF grammar) or json_object=True (any JSON object). engine/structured/ compiles it into a
    per-sequence mask over the vocabulary."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}; got {given or 'none'}")
        checks = {"json": (dict, str), "regex": (str,), "grammar": (str,), "json_object": (bool,),
                  "choice": (list, tuple)}
        kind = given[0]
        value = getattr(self, kind)
        if not isinstance(value, checks[kind]) or (kind == "choice" and (
                not value or not all(isinstance(c, str) and c for c in value))):
            raise ValueError(f"structured_outputs.{kind}={value!r:.80} is not allowed: {kind} must "
                             "be "
                             + {"json": "a JSON schema (a dict, or its JSON text)",
                                "regex": "a regular expression (str)",
                                "grammar": "a Lark/EBNF grammar (str)", "json_object": "True",
                                "choice": "a non-empty list of non-empty strings"}[kind])
        if kind == "choice":
            self.choice = list(value)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """One string per distinct constraint (the grammar cache's key)."""
        import json as json_module

        return json_module.dumps([self.kind, getattr(self, self.kind)], sort_keys=True)


INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
OPTIONAL_FIELDS = ("logprobs", "prompt_logprobs")  # None: not asked for
REAL_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty")


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is not allowed: "
                         f"{name} must be {allowed}")


@dataclass
class SamplingParams:
    """How one request wants its tokens chosen (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalized to a list in __post_init__
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top logprobs to return with each token
    # how many top logprobs to return at each PROMPT position (vLLM's name; what evaluation
    # harnesses score loglikelihood with); such a request computes its whole prompt (no cache hit)
    prompt_logprobs: int | None = None
    # applied in order, every path
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's)
    structured_outputs: StructuredOutputsParams | None = None  # chapter 13: a grammar's mask

    def __post_init__(self) -> None:
        self._check_types()
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.logits_processors = list(self.logits_processors or [])
        _require(all(callable(f) for f in self.logits_processors), "logits_processors",
                 self.logits_processors,
                 "a list of callables (output_ids, logits [V]) -> logits [V]")
        self.stop_token_ids = list(self.stop_token_ids or [])
        lo, hi = PENALTY_RANGE
        _require(self.n >= 1, "n", self.n, ">= 1")
        _require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
                 self.temperature, "a finite number >= 0 (0 means greedy)")
        _require(self.seed is None or (type(self.seed) is int
                                       and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
                 "seed", self.seed, f"None or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] "
                 "(what torch.Generator.manual_seed takes)")
        _require(self.top_k >= -1, "top_k", self.top_k, ">= 1, or 0 / -1 to switch top-k off")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _require(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                 "repetition_penalty", self.repetition_penalty,
                 "a finite number > 0 (1 means no penalty)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(lo <= value <= hi, name, value, f"in [{lo}, {hi}]")
        _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                 f"in [0, max_tokens={self.max_tokens}]")
        _require(all(self.stop), "stop", self.stop, "a list of non-empty strings")
        _require(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
                 "None or >= 0")
        _require(self.prompt_logprobs is None or (type(self.prompt_logprobs) is int
                                                  and self.prompt_logprobs >= 0),
                 "prompt_logprobs", self.prompt_logprobs, "None or an integer >= 0")
        self._check_logit_bias()
        _require(self.structured_outputs is None
                 or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", self.structured_outputs,
                 "None or a StructuredOutputsParams")

    def _check_types(self) -> None:
        """Each field of the right kind before any range check, so that `max_tokens=5.5`,
        `temperature="0.5"` or `stop=5` is refused by name (a bool is not a number here). numpy
        scalars are taken and stored as Python numbers, what the trace and the rest of the engine
        expect. Token ids (stop_token_ids) are checked against the model's vocabulary when the
        request is added."""
        for name in INT_FIELDS + REAL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                as_python = int if isinstance(value, numbers.Integral) else float
                setattr(self, name, as_python(value))  # np.int64(5) -> 5
        for name in INT_FIELDS:
            value = getattr(self, name)
            _require((name in OPTIONAL_FIELDS and value is None) or is_int(value), name, value,
                     "an integer" + (" or None" if name in OPTIONAL_FIELDS else ""))
        for name in REAL_FIELDS:
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool), name, value,
                     "a number")
        stop = self.stop
        _require(stop is None or isinstance(stop, str)
                 or (isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop)),
                 "stop", stop, "a string, a list of strings, or None")
        _require(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
                 "stop_token_ids", self.stop_token_ids, "a list of token ids")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "True or False")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        lo, hi = LOGIT_BIAS_RANGE
        _require(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
                 "a dict of token id -> bias")
        for token, bias in self.logit_bias.items():
            _require(type(token) is int and token >= 0, "logit_bias", token,
                     "keyed by token ids (ints >= 0)")
            _require(isinstance(bias, (int, float)) and not isinstance(bias, bool)
                     and lo <= bias <= hi, "logit_bias", {token: bias}, f"biases in [{lo}, {hi}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


# ---- the stages, as pure functions on logits [..., V] (one row or a batch) -----------------------


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide the logits by t. Greedy (t = 0) is the sampler's job, so here t must be > 0."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 here; "
                         "temperature 0 means greedy (argmax)")
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the logits >= the k-th largest of their row (ties at the boundary all survive)."""
    if k in TOP_K_OFF or k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose total probability reaches p.

    Sorted probabilities 0.4 0.3 0.2 0.1 with p = 0.75:
        mass before each token:  0.0  0.4  0.7  0.9
        kept (mass before < p):  yes  yes  yes  no    <- 0.2 crosses 0.75, so it is KEPT
    Tokens tied with the boundary token are kept too, so the result never depends on sort order.
    """
    if p >= 1.0:  # skip the arithmetic: rounding could otherwise drop tokens of tiny probability
        return logits.clone()
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [..., V]
    probs = torch.softmax(sorted_logits, dim=-1, dtype=torch.float32)
    mass_before = F.pad(torch.cumsum(probs, dim=-1)[..., :-1], (1, 0))  # [..., V], starts at 0
    n_keep = (mass_before < p).sum(dim=-1, keepdim=True)  # [..., 1], at least 1
    boundary = sorted_logits.gather(-1, n_keep - 1)  # [..., 1] logit of the token that crosses p
    return logits.masked_fill(logits < boundary, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p times the most likely token's."""
    if min_p <= 0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # [..., 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _as_ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0) -> torch.Tensor:
    """Discourage repeats, on one row [V]; returns a new tensor.

    repetition (HF/vLLM): for every token seen in prompt or output, a positive logit is divided
        by the penalty and a negative one multiplied, so both move towards "less likely";
    presence / frequency (OpenAI/vLLM): output tokens only,
        logit -= presence * (count > 0) + frequency * count.
    """
    logits = logits.clone()
    V, device = logits.shape[-1], logits.device
    if repetition_penalty != 1.0:
        seen = torch.zeros(V, dtype=torch.bool, device=device)
        seen[_as_ids([*prompt_ids, *output_ids], device)] = True
        penalized = torch.where(logits > 0, logits / repetition_penalty,
                                logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if presence_penalty or frequency_penalty:
        counts = torch.bincount(_as_ids(output_ids, device), minlength=V).to(logits.dtype)  # [V]
        logits -= frequency_penalty * counts + presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter_stages(logits: torch.Tensor,
                   params: SamplingParams) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (stage name, logits after that stage) for temperature -> top-k -> top-p -> min-p."""
    logits = apply_temperature(logits, params.temperature)
    yield "temperature", logits
    logits = top_k_filter(logits, params.top_k)
    yield "top_k", logits
    logits = top_p_filter(logits, params.top_p)
    yield "top_p", logits
    yield "min_p", min_p_filter(logits, params.min_p)


def probs_after_each_stage(logits: torch.Tensor, params: SamplingParams) -> dict[str, torch.Tensor]:
    """The distribution [V] before filtering ("raw") and after each stage, for the visualizer.

    With greedy params every stage shows the one-hot argmax: that is what greedy samples from.
    """
    stages = {"raw": torch.softmax(logits, dim=-1, dtype=torch.float32)}
    if params.greedy:
        one_hot = F.one_hot(torch.argmax(logits), logits.shape[-1]).to(torch.float32)
        return stages | {name: one_hot for name in STAGES}
    for name, staged in _filter_stages(logits, params):
        stages[name] = torch.softmax(staged, dim=-1, dtype=torch.float32)
    return stages


# ---- the sampler: one batch, one SamplingState per row -------------------------------------------


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's own random stream: seeded when the request gives a seed, fresh entropy
    otherwise."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass
class SamplingState:
    """What the sampler needs to know about one request. The caller appends each sampled token."""

    params: SamplingParams
    generator: torch.Generator | None = None  # None: made from params.seed
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    # params.structured_outputs compiled for THIS sequence (engine/structured/): a stateful logits
    # processor, applied after every other stage; the engine installs it when the request arrives
    grammar: LogitsProcessor | None = None

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = make_generator(self.params.seed)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float  # of the chosen token
    top: dict[int, float]  # the params.logprobs most likely token ids -> logprob, most likely first


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask (params.logprobs is None)


def _mask_stop_tokens(logits: torch.Tensor, params: SamplingParams, n_output: int,
                      eos_token_ids: Sequence[int]) -> torch.Tensor:
    """min_tokens: while too few tokens exist, every EOS id and the stop token ids cannot be
    chosen."""
    if n_output >= params.min_tokens:
        return logits
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned += list(eos_token_ids)
    logits = logits.clone()
    logits[banned] = float("-inf")
    return logits


def apply_logits_processors(logits: torch.Tensor, processors: Sequence[LogitsProcessor],
                            output_ids: Sequence[int]) -> torch.Tensor:
    """Run the request's processors on one row [V], in order; each must return a row of the same
    shape."""
    for fn in processors:
        out = fn(list(output_ids), logits)
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"logits processor {fn!r} must return a tensor of shape "
                             f"{tuple(logits.shape)}, got {got}")
        logits = out
    return logits


def top_logprobs(logits: torch.Tensor, token: int, k: int | None) -> TokenLogprobs | None:
    if k is None:
        return None
    logprobs = torch.log_softmax(logits, dim=-1)  # [V]
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    ranked = {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)}
    return TokenLogprobs(token, float(logprobs[token]), ranked)


def processed_logits(logits: torch.Tensor, state: SamplingState,
                     eos_token_ids: Sequence[int]) -> torch.Tensor:
    """One row [V] after everything that depends on the request's history: penalties, the EOS ban
    before min_tokens, the logits processors. Greedy takes its argmax; logprobs describe it."""
    params = state.params
    logits = apply_penalties(logits.float(), state.prompt_ids, state.output_ids,
                             params.repetition_penalty, params.presence_penalty,
                             params.frequency_penalty)
    logits = apply_logit_bias(logits, params.logit_bias)
    logits = apply_logits_processors(logits, params.logits_processors, state.output_ids)
    if state.grammar is not None:  # the grammar has its say on what may come next
        logits = apply_logits_processors(logits, [state.grammar], state.output_ids)
    banned = _mask_stop_tokens(logits, params, len(state.output_ids), eos_token_ids)
    # min_tokens bans EOS, unless nothing else is left: a grammar that is complete allows only EOS,
    # and the output it describes is finished, however short
    return banned if bool(torch.isfinite(banned).any()) else logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    """OpenAI's logit_bias on one row [V]: each listed token's logit + its bias (a new tensor).
    -100 all but bans a token; +100 all but forces it."""
    if not bias:
        return logits
    logits = logits.clone()
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def sampling_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution [V] a sampled (temperature > 0) token is drawn from: `processed_logits`
    through temperature, top-k, top-p and min-p, then softmax. Speculative sampling
    (engine/speculative/rejection.py) must keep exactly this distribution."""
    filtered = dict(_filter_stages(processed, params))["min_p"]  # the last stage
    return torch.softmax(filtered, dim=-1)


def _sample_row(logits: torch.Tensor, state: SamplingState,
                eos_token_ids: Sequence[int]) -> tuple[int, TokenLogprobs | None]:
    params = state.params
    logits = processed_logits(logits, state, eos_token_ids)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        probs = sampling_probs(logits, params).to(state.generator.device)
        token = int(torch.multinomial(probs, 1, generator=state.generator))
    # Like vLLM, logprobs describe the model after penalties but before temperature and filters.
    return token, top_logprobs(logits, token, params.logprobs)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[P, V] -> [P]: the greedy token of each row (the first of equal maxima)."""
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, rows: Sequence[SamplingState],
           eos_token_ids: int | Sequence[int] | None = (),
           argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_rows) -> SamplerOutput:
    """Pick one token per row of logits [B, V]; row i follows rows[i]. The states are not changed.
    eos_token_ids: the model's end-of-sequence ids (one int is fine), kept out until min_tokens.
    argmax: how plain greedy rows find their maxima, all at once (the fast wing brings a C one)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [B, V] with B = len(rows) = {len(rows)}, "
                         f"got {tuple(logits.shape)}")
    eos = ([] if eos_token_ids is None
           else [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
    for state in rows:
        if state.params.structured_outputs is not None and state.grammar is None:
            raise ValueError("SamplingParams.structured_outputs needs its grammar compiled for the "
                             "sequence (SamplingState.grammar; the engine does it when a request "
                             "arrives): sample() alone cannot enforce it")
    plain = [i for i, state in enumerate(rows) if is_plain_greedy(state)]
    # Every plain greedy row in ONE argmax over [P, V]: the same tokens as row by row (argmax keeps
    # the first of equal maxima either way), without a copy and a call per row (which a
    # 64-sequence decode step pays 64 times over).
    picked: list = [None] * len(rows)
    if plain:
        greedy_rows = logits if len(plain) == len(rows) else logits[plain]  # [P, V]
        for i, token in zip(plain, argmax(greedy_rows).tolist(), strict=True):
            picked[i] = (token, None)
    for i, (row, state) in enumerate(zip(logits, rows, strict=True)):
        if picked[i] is None:
            picked[i] = _sample_row(row, state, eos)
    token_ids = torch.tensor([token for token, _ in picked], dtype=torch.long, device=logits.device)
    return SamplerOutput(token_ids, [logprobs for _, logprobs in picked])


def is_plain_greedy(state: SamplingState) -> bool:
    """Greedy with nothing that changes the logits first (no penalty, no banned EOS before
    min_tokens, no logits processor) and no logprobs asked for: its token is simply the argmax of
    its logits row."""
    p = state.params
    return (p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and p.logprobs is None
            and len(state.output_ids) >= p.min_tokens and not p.logits_processors
            and not p.logit_bias and state.grammar is None)


class StopDecision(NamedTuple):
    """What `check_stop` decided: unpack it as (finished, reason, text)."""

    finished: bool
    # "stop" (EOS, a stop id or a stop string), "length" (max_tokens), None: go on
    reason: str | None
    text: str  # the text to show: cut before the stop string that matched, if one did


def shows_text(token: int, eos_token_ids: Sequence[int]) -> bool:
    """Does this token add to the visible text? Every EOS id is control, never text (even with
    ignore_eos, where it does not stop the sequence)."""
    return token not in eos_token_ids


def check_stop(output_ids: Sequence[int], new_token: int, text: str, params: SamplingParams,
               eos_token_ids: Sequence[int]) -> StopDecision:
    """Does the sequence stop at `new_token`? The ONE stop rule of the naive loop and the engine.

    output_ids: the tokens generated BEFORE new_token; text: the visible text including new_token's
    piece (see `shows_text`); eos_token_ids: ALL of the model's end-of-sequence ids (a chat model
    often has several, e.g. <|endoftext|> and <|im_end|>).

    The order is vLLM's: nothing stops before min_tokens tokens exist (new_token included); then any
    EOS id (unless ignore_eos) or a stop_token_id stops with "stop"; then a stop string stops with
    "stop" and the text is cut at its earliest match; then max_tokens stops with "length".
    """
    n = len(output_ids) + 1
    if n < params.min_tokens:
        return StopDecision(False, None, text)
    hit_eos = new_token in eos_token_ids and not params.ignore_eos
    if hit_eos or new_token in params.stop_token_ids:
        return StopDecision(True, "stop", text)
    cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
    if cut >= 0:
        return StopDecision(True, "stop", text[:cut])
    if n >= params.max_tokens:
        return StopDecision(True, "length", text)
    return StopDecision(False, None, text)

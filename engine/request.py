"""A request inside the engine: its tokens, where it is in its life, and when things happened.

    add_request ──► WAITING ──admitted──► RUNNING ──stop / length──► FINISHED
                      ▲                    │  │
                      └── recompute ───────┘  └── swap ──► SWAPPED ──swapped in──► RUNNING
                          (preempted)                      (preempted)
    abort_request: from any state straight to FINISHED with reason "abort".
    a step that raises: the requests it ran go straight to FINISHED with reason "error".

The one number the scheduler and the runner care about is `num_computed_tokens`: how many of
the request's tokens already have their K/V in the cache. Each step feeds positions
[num_computed_tokens, end) and, when `end` reaches the last known token, samples the next one:

    all_token_ids   p0 p1 p2 p3 p4 | o0 o1          (prompt, then outputs)
    computed        ██ ██ ██ ██ ██ ██                 num_computed_tokens = 6
    next step feeds                   o1  -> samples o2 (a decode step)

A recompute preemption sets num_computed_tokens back to 0: the prompt AND the outputs so far are
prefilled again later, which gives exactly the cache they had (the same tokens at the same
positions).

n > 1 samples of one prompt: sample 0 (the request's own id) is prefilled alone, the others
("<id>#1", ...) wait in its `pending_forks`. When sample 0 gets its first token's logits, each
waiting sample is FORKED: it shares sample 0's KV blocks (BlockManager.fork, no copy) and draws
its own first token from the same logits. The first write into a shared, partly filled block
copies that block (copy-on-write), so the prompt's full blocks stay stored once:

    sample 0   [blk 3][blk 5][blk 9]    the first to write into the shared blk 8 got a private copy
    sample 1   [blk 3][blk 5][blk 8]    then blk 8 is held by sample 1 only: no copy needed
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from engine.sampling import SamplingParams, SamplingState, check_stop, shows_text
from engine.tokenizer import IncrementalDetokenizer

WAITING, RUNNING, SWAPPED, FINISHED = "waiting", "running", "swapped", "finished"
# "error": the step that ran it raised (see `error`)
FINISH_REASONS = ("stop", "length", "abort", "error")
# an error message quotes at most this much of a bad value (a prompt can be long)
SHOWN_VALUE_CHARS = 40


def validate_token_ids(ids, vocab_size: int, where: str, allow_empty: bool = False) -> list[int]:
    """The one gate every token id list passes before the engine keeps it; returns plain ints.

    A token id is an int in [0, vocab_size): a Python int or a numpy / torch integer scalar. We
    refuse (TypeError) floats, bools, bytes, None, strings and nested lists, and (ValueError) ids
    outside the vocabulary and, unless allowed, an empty list. An id of 5000 on a 1024-token model
    would otherwise be accepted here and blow up the embedding lookup of EVERY later step, for
    everybody.
    `where` names the owner in the message, e.g. "request '7': prompt".
    """
    if (isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__len__")
            or isinstance(ids, dict | set)):
        raise TypeError(f"{where} must be a list of token ids (ints in [0, {vocab_size})), "
                        f"got {type(ids).__name__} {_short(ids)}")
    out = [_token_id(x, i, vocab_size, where) for i, x in enumerate(ids)]
    if not out and not allow_empty:
        raise ValueError(f"{where} is empty (and the tokenizer adds no BOS token); "
                         "give at least one token")
    return out


def _token_id(x, i: int, vocab_size: int, where: str) -> int:
    # numpy and torch bools too
    is_bool = isinstance(x, bool) or "bool" in str(getattr(x, "dtype", ""))
    try:
        # ndim: a 1-element array is a nested list, not an id
        if is_bool or getattr(x, "ndim", 0) != 0:
            raise TypeError
        value = operator.index(x)  # ints, numpy / torch integer scalars; floats, bytes, None refuse
    except TypeError:
        raise TypeError(f"{where}[{i}] is {type(x).__name__} {_short(x)}: token ids must be ints "
                        f"in [0, {vocab_size}) (Python, numpy or torch integers; not floats, "
                        "bools, bytes or lists)") from None
    if not 0 <= value < vocab_size:
        raise ValueError(f"{where}[{i}] = {value} is outside the model's vocabulary "
                         f"[0, {vocab_size}) (vocab_size of the model config); "
                         "check the tokenizer matches the model")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS] + "..."


@dataclass(eq=False)
class Request:
    """One sequence being generated. `seq_id` is its key in the BlockManager."""

    request_id: str
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower is served first (vLLM's convention)
    tenant: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    num_computed_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    preempted: bool = False  # waiting or swapped by a preemption (cleared when it runs again)
    # engine.sampling.TokenLogprobs per token, when asked
    logprobs: list = field(default_factory=list)
    index: int = 0  # which of the request's n samples this sequence is
    # all n samples of the request, in index order
    samples: list[Request] = field(default_factory=list)
    # on sample 0: forked at its first token
    pending_forks: list[Request] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": the exception of the step that failed it
    # the prefix cache's extra keys: (model id, template version, scope); prefix_cache.py
    cache_key: tuple = ()
    # speculative decoding (chapter 12): this step's guesses for the tokens after the last one, and
    # the distribution each was drawn from ([k, V], None: chosen deterministically); the engine
    # sets them before scheduling, the scheduler may cut them to fit
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: object = None
    # params.prompt_logprobs: one TokenLogprobs per prompt position (position 0, which nothing
    # predicts, stays None), filled by the prefill steps
    prompt_logprobs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sampling = SamplingState(self.params, prompt_ids=list(self.prompt_token_ids))

    # ---- tokens ---------------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens known but not yet in the cache: the rest of the prompt, or 1 while decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is left to feed: a one-token decode step."""
        return bool(self.output_token_ids) and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status == FINISHED

    # ---- progress -------------------------------------------------------------------------
    def append_token(self, token: int, logprobs=None) -> bool:
        """Record a sampled token; returns True when the request is now finished (see `finish`).

        The stop rule is `engine.sampling.check_stop`, the same one
        `engine.companions.naive.run_loop` uses, so outputs match the naive loop: text grows only
        with non-EOS tokens (`shows_text`).
        """
        if self.detokenizer is not None and shows_text(token, self.eos_token_ids):
            self.detokenizer.push(token)
            self.text = self.detokenizer.text
        done, why, self.text = check_stop(self.output_token_ids, token, self.text, self.params,
                                          self.eos_token_ids)
        self.output_token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if done:
            self.finish_reason = why
        return done

    def finish(self, reason: str, now: float) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r} is not one of {FINISH_REASONS}")
        self.status, self.finish_reason, self.finish_time = FINISHED, reason, now

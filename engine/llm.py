"""`LLM`: offline batched generation in one call, in vLLM's shape.

    from engine import LLM, SamplingParams
    llm = LLM("tinylab")
    outputs = llm.generate(["12+7=", "Once upon a time"],
                           SamplingParams(temperature=0, max_tokens=16))
    outputs[0].outputs[0].text, outputs[0].outputs[0].finish_reason, outputs[0].metrics.ttft_s

Every prompt goes into one `LLMEngine` at once; its scheduler batches them continuously (or
statically, if asked), and the outputs come back in the order of the prompts.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine, engine_config
from engine.model import LlamaModel
from engine.progress import progress_bar
from engine.request import Request
from engine.sampling import SamplingParams, TokenLogprobs
from engine.tokenizer import Tokenizer
from engine.trace import StepReport

DEFAULT_DTYPE = "float32"  # what a model loaded by name or folder computes in, unless told


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's name): sample `index` of SamplingParams.n."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while unfinished
    # one per token, when SamplingParams.logprobs was set
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": the exception of the step that failed it


@dataclass
class RequestMetrics:
    """When things happened to a request, on the engine's clock (seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: [None, TokenLogprobs of prompt token 1 given token 0, ...]
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @classmethod
    def from_request(cls, req: Request) -> RequestOutput:
        """The output of a request (sample 0, holding its n samples in `req.samples`)."""
        samples = req.samples or [req]
        outputs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason,
                                    list(s.logprobs) if s.params.logprobs is not None else None,
                                    s.error)
                   for s in samples]
        finished = all(s.is_finished for s in samples)
        finish_time = max(s.finish_time for s in samples) if finished else None
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 finish_time, sum(s.num_preemptions for s in samples))
        prompt_logprobs = (list(req.prompt_logprobs) if req.params.prompt_logprobs is not None
                           else None)
        return cls(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, finished,
                   metrics, prompt_logprobs)


class LLM:
    """A model plus an `LLMEngine`. `model`: a bundled name ("tinylab"), a local Hugging Face-format
    folder, or a `LlamaModel` (then pass its `tokenizer`, or None to work with token ids).
    `dtype`: the weights' (a name or folder loads them as DEFAULT_DTYPE unless told; a LlamaModel
    keeps its own, and a dtype that disagrees with it is refused).
    `speed`: "reference" (the readable path only) or "fast" (the fast wing; the default,
    DEFAULT_SPEED). `**options` go to `engine_config` (scheduler and cache fields, e.g.
    max_num_seqs=8, policy="static")."""

    def __init__(self, model: str | LlamaModel = "tinylab", tokenizer: Tokenizer | None = None,
                 dtype: str | None = None, speed: str | None = None, **options):
        if isinstance(model, LlamaModel):
            # None: the weights' own dtype (the engine refuses a dtype that disagrees with them)
            dtype = dtype or str(model.embed_tokens.weight.dtype).removeprefix("torch.")
            config = engine_config("custom", dtype, speed, **options)
            self.engine = LLMEngine(model, tokenizer, config)
        elif tokenizer is not None:  # a name or folder brings its own: never ignore one silently
            raise ValueError(f"tokenizer: pass one only with a LlamaModel; {model!r} loads its "
                             f"own (got {tokenizer!r}; dtype is the third argument, or dtype=...)")
        else:
            self.engine = LLMEngine.from_pretrained(model, dtype or DEFAULT_DTYPE, speed=speed,
                                                    **options)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict | Sequence[int]] | Sequence[int],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (one text, a list of texts, one list of token ids, or a list of
        them; vLLM's {"prompt": text} and {"prompt_token_ids": ids} dicts too) with one
        SamplingParams for all or one per prompt; outputs in the prompts' order.

        A bad prompt raises (naming prompts[i]) before anything runs, and the call changes nothing.
        A step that fails does not end the call: we warn once per failed step, its requests come
        back with finish_reason "error" (and `error`), all the others with their normal outputs."""
        prompts = as_prompt_list(prompts)
        params_list = as_params_list(params, len(prompts))
        engine, ids = self.engine, []
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                ids.append(engine.add_request(prompt, sp))
            with progress_bar(total=len(ids), disable=not use_tqdm, desc="generate",
                              unit="req") as bar:
                while engine.has_unfinished_requests():
                    bar.update(len(_step_or_warn(engine).queues.finished))
        except BaseException as exc:
            # a bad prompt, or Ctrl-C: the engine forgets this call's requests
            self._drop(ids)
            # prompts[len(ids)] failed
            if type(exc) in (ValueError, TypeError) and len(ids) < len(prompts):
                raise type(exc)(f"prompts[{len(ids)}]: {exc}") from exc
            raise
        return [RequestOutput.from_request(engine.pop_request(rid)) for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer one conversation ([{"role": "user", "content": ...}, ...]) or a list of them
        (vLLM's name).

        Each conversation goes through the model's chat template into prompt text, which we tokenize
        as it stands (add_special_tokens=False: the template writes any BOS it wants itself); the
        outputs carry that text as `prompt`, one per conversation, in order."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer (for its chat template); "
                             "this LLM has none")
        if isinstance(messages, (str, dict)):  # a str would be read letter by letter
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts (or a list "
                             f"of such lists), got a {type(messages).__name__}: {messages!r:.60}")
        if not messages:
            raise ValueError("messages is empty; pass [{'role': 'user', 'content': ...}] "
                             "or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt)
                 for c in conversations]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(ids, params, use_tqdm)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def _drop(self, ids: list[str]) -> None:
        for rid in ids:
            if any(not s.is_finished for s in self.engine.get_request(rid).samples):
                self.engine.abort_request(rid)
            self.engine.pop_request(rid)


def _step_or_warn(engine: LLMEngine) -> StepReport:
    """One engine step. A step that raised after running someone is a warning here, not the end of
    the call: the engine finished the requests it ran with reason "error" and the others go on."""
    num_steps = len(engine.trace)
    try:
        return engine.step()
    except Exception as exc:
        report = engine.trace[-1] if len(engine.trace) == num_steps + 1 else None
        failed = ([] if report is None
                  else [r for r, why in report.queues.finished.items() if why == "error"])
        if not failed:  # it failed before running anyone: going on would fail the same way forever
            raise
        warnings.warn(f"LLM.generate: a step raised {type(exc).__name__}: {exc}; "
                      f"requests {failed} finished with finish_reason='error', the others go on",
                      RuntimeWarning, stacklevel=3)
        return report


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt


def as_prompt_list(prompts) -> list:
    """The prompts of one generate call as a list of texts and token-id lists: one text, one list
    of ids, vLLM's prompt dicts ({"prompt": text} or {"prompt_token_ids": ids}), or a list of any
    of them."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if any(isinstance(t, numbers.Number) or getattr(t, "ndim", None) == 0 for t in prompts):
        return [prompts]  # one prompt given as token ids (the engine checks every one of them)
    return [_from_prompt_dict(p, i) if isinstance(p, dict) else p for i, p in enumerate(prompts)]


def _from_prompt_dict(prompt: dict, i: int):
    """vLLM's {"prompt": text} or {"prompt_token_ids": ids}; any other key is refused by name
    (a dict read as a sequence would have been its keys)."""
    others = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
    if others or len(prompt) != 1:
        raise ValueError(f"prompts[{i}]: a prompt dict holds exactly one of "
                         f"{', '.join(PROMPT_DICT_KEYS)}; got keys {sorted(prompt) or 'none'}"
                         + (f" ({', '.join(others)} not supported)" if others else ""))
    return next(iter(prompt.values()))


def as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if not isinstance(params, Sequence) or isinstance(params, str):  # a dict would give its keys
        raise TypeError(f"params must be a SamplingParams, a list of them (one per prompt) or "
                        f"None, got {type(params).__name__}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params: got {len(params)} SamplingParams for {n} prompts; "
                         "pass one, or one per prompt")
    return params

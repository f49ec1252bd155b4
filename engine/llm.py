"""`LLM`: offline batched generation in one call, in vLLM's shape.

    from engine import LLM, SamplingParams
    llm = LLM("tinylab")
    outputs = llm.generate(["12+7=", "Once upon a time"], SamplingParams(temperature=0, max_tokens=16))
    outputs[0].outputs[0].text, outputs[0].outputs[0].finish_reason, outputs[0].metrics.ttft_s

Every prompt goes into one `LLMEngine` at once; its scheduler batches them continuously (or
statically, if asked), and the outputs come back in the order of the prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from engine.llm_engine import LLMEngine, engine_config
from engine.model import LlamaModel
from engine.request import Request
from engine.sampling import SamplingParams, TokenLogprobs
from engine.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's name): sample `index` of SamplingParams.n."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or None while unfinished
    logprobs: list[TokenLogprobs] | None = None  # one per token, when SamplingParams.logprobs was set


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

    @classmethod
    def from_request(cls, req: Request) -> RequestOutput:
        """The output of a request (sample 0, holding its n samples in `req.samples`)."""
        samples = req.samples or [req]
        outputs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason,
                                    list(s.logprobs) if s.params.logprobs is not None else None)
                   for s in samples]
        finished = all(s.is_finished for s in samples)
        finish_time = max(s.finish_time for s in samples) if finished else None
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 finish_time, sum(s.num_preemptions for s in samples))
        return cls(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, finished, metrics)


class LLM:
    """A model plus an `LLMEngine`. `model`: a bundled name ("tinylab"), a local Hugging Face-format
    folder, or a `LlamaModel` (then pass its `tokenizer`, or None to work with token ids).
    `**options` go to `engine_config` (scheduler and cache fields, e.g. max_num_seqs=8, policy="static")."""

    def __init__(self, model: str | LlamaModel = "tinylab", tokenizer: Tokenizer | None = None,
                 dtype: str = "float32", attention_backend: str = "torch", **options):
        if isinstance(model, LlamaModel):
            config = engine_config("custom", dtype, attention_backend, **options)
            self.engine = LLMEngine(model, tokenizer, config)
        else:
            self.engine = LLMEngine.from_pretrained(model, dtype, attention_backend, **options)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (one text, a list of texts, one list of token ids, or a list of
        them) with one SamplingParams for all or one per prompt; outputs in the prompts' order."""
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        engine, ids = self.engine, []
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                ids.append(engine.add_request(prompt, sp))
        except Exception:  # one bad prompt: the call changes nothing, the ones already added are dropped
            for rid in ids:
                engine.abort_request(rid)
                engine.pop_request(rid)
            raise
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while engine.has_unfinished_requests():
                report = engine.step()
                bar.update(len(report.queues.finished))
        return [RequestOutput.from_request(engine.pop_request(rid)) for rid in ids]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params: got {len(params)} SamplingParams for {n} prompts; "
                         "pass one, or one per prompt")
    return params

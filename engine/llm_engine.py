"""`LLMEngine`: requests in, one scheduler step at a time, a `StepReport` out of every step.

    engine = LLMEngine(model, tokenizer, engine_config(max_num_seqs=4, num_blocks=32))
    engine.add_request("2+2=", SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        report = engine.step()          # this step's schedule, queues, blocks, events, timings
    engine.trace.save("run.json")       # every report, plus the configuration

One `step()`:  schedule ──► move blocks (swap / copy) ──► ONE packed forward ──► sample ──►
append tokens, check stops, free finished requests' blocks ──► StepReport.

Documented behaviours:
- `add_request` rejects, with a ValueError or TypeError that names the request and nothing
  allocated or registered: a prompt that is not a non-empty list of token ids in [0, vocab_size)
  (ints or numpy / torch integer scalars; see `engine.request.validate_token_ids`), text without a
  tokenizer, stop_token_ids outside the vocabulary, a prompt of max_position_embeddings tokens or
  more, a duplicate request id, a priority that is not an int, and a request that could not fit in
  the whole KV pool even alone. `max_tokens` is CLAMPED so that prompt + max_tokens
  <= max_position_embeddings (what `engine.companions.naive` does: generation stops at the context
  with finish_reason "length"). n > max_num_seqs is rejected (the samples could never run
  together).
- n > 1: the request's samples are sequences "<id>", "<id>#1", ..., forked from the prompt's
  blocks at the first token (see engine/request.py); `abort_request("<id>")` stops them all.
- `abort_request("<id>")` stops every unfinished sample, even when sample 0 has finished already;
  it warns and returns False only when nothing of the request was left to stop (unknown id, or all
  finished).
- Prefix caching (`enable_prefix_caching=True`, chapter 06): full KV blocks are shared between
  requests with the same tokens, `model_id` (computed once from the weights; `refresh_model_id()`
  after changing them in place), `template_version` and scope (tenant-private by default, or
  `cache_scope="public"`); their greedy outputs are the same as with it off.
  `reset_prefix_cache()` clears it while no request holds blocks (else returns False).
- A step that raises (a bug, out of memory in the forward) does not kill the engine: every sequence
  it ran is finished with finish_reason "error" (`Request.error` keeps the exception), its blocks
  are freed, the step is recorded with a "finished" event of reason "error", and the exception is
  raised once; the next `step()` serves everyone else as if nothing had happened.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
import warnings
from collections.abc import Callable

import torch

from engine.config import (
    CacheConfig,
    EngineConfig,
    FastOptions,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.kv.block_manager import BlockManager
from engine.kv.kv_pool import PagedKVPool, PoolShape, log_kv_cache, plan_num_blocks
from engine.kv.prefix_cache import cache_key
from engine.kv.prefix_cache import model_id as weights_id
from engine.model import LlamaModel
from engine.request import SWAPPED, Request, validate_token_ids
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample, top_logprobs
from engine.scheduler import ScheduledWork, Scheduler, SchedulerOutput
from engine.speculative.proposer import Proposer
from engine.speculative.registry import make_proposer
from engine.speculative.rejection import verify
from engine.speculative.speculator import Speculator
from engine.speed import accelerate
from engine.threads import default_num_threads, torch_threads
from engine.tokenizer import Tokenizer, encode_prompt, eos_ids
from engine.trace import (
    BlockSnapshot,
    QueueSnapshot,
    ScheduledRequest,
    StepReport,
    TimeSplit,
    Trace,
)


def engine_config(model: str = "tinylab", dtype: str = "float32", speed: str | None = None,
                  num_threads: int | None = None, **options) -> EngineConfig:
    """An EngineConfig from flat keyword options, each routed to SchedulerConfig, CacheConfig,
    ParallelConfig or FastOptions by name (e.g. `engine_config(policy="static", max_num_seqs=8,
    num_blocks=64, block_size=4)`; `attention_backend="sdpa"` is a fast-wing override). speed None:
    DEFAULT_SPEED."""
    groups = (("scheduler", SchedulerConfig), ("cache", CacheConfig), ("parallel", ParallelConfig),
              ("fast", FastOptions))
    names = {group: {f.name for f in dataclasses.fields(cls)} for group, cls in groups}
    picked: dict[str, dict] = {group: {} for group in names}
    # chapter 12, vLLM's shape: LLM(..., speculative_config={"method": "ngram", ...})
    speculative = SpeculativeConfig.from_dict(options.pop("speculative_config", None))
    for key, value in options.items():
        owner = next((group for group, fields in names.items() if key in fields), None)
        if owner is None:
            known = sorted(set().union(*names.values()) | {"speculative_config"})
            raise TypeError(f"unknown engine option {key!r}; known options: {', '.join(known)}")
        picked[owner][key] = value
    speed = {} if speed is None else {"speed": speed}
    return EngineConfig(model=model, dtype=dtype, num_threads=num_threads, **speed,
                        fast=FastOptions(**picked["fast"]), cache=CacheConfig(**picked["cache"]),
                        scheduler=SchedulerConfig(**picked["scheduler"]),
                        parallel=ParallelConfig(**picked["parallel"]), speculative=speculative)


class LLMEngine:
    """Admits requests, runs one scheduler step per `step()`, and records a `Trace`."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, clock: Callable[[], float] = time.time,
                 model_id: str | None = None, proposer: Proposer | None = None):
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer, self.clock = model.eval(), tokenizer, clock
        cfg = model.config
        # Sliding window: the model's (Mistral), or the cache option's for experiments (it wins).
        self.sliding_window = config.cache.sliding_window or cfg.sliding_window
        self.max_model_len = cfg.max_position_embeddings
        cache, weight = config.cache, model.embed_tokens.weight
        if getattr(torch, config.dtype) != weight.dtype:  # the trace records config.dtype
            weights = str(weight.dtype).removeprefix("torch.")
            raise ValueError(f"dtype: the config says {config.dtype!r} but the model's weights are "
                             f"{weights}; pass dtype={weights!r}, or convert the model first "
                             f"(model.to(torch.{config.dtype}))")
        # chapter 07: KV int8
        kv_dtype = torch.int8 if cache.kv_cache_dtype == "int8" else weight.dtype
        # sized by bytes
        num_blocks = plan_num_blocks(cfg, cache, config.scheduler.max_num_seqs, kv_dtype)
        swap_blocks = 0
        if config.scheduler.preemption_mode == "swap":
            swap_blocks = num_blocks if cache.swap_space_blocks is None else cache.swap_space_blocks
        # The block manager owns every table (device and swap), the KV pool every tensor and copy,
        # the scheduler only decides; attention reads and writes through the pool.
        host_blocks = cache.kv_offload_blocks or 0
        self.block_manager = BlockManager(num_blocks, cache.block_size, swap_blocks,
                                          cache.enable_prefix_caching,
                                          self.sliding_window, host_blocks,
                                          eviction_policy=cache.eviction_policy)
        # The prefix cache's key starts with the model's identity: its name and a hash of a sample
        # of its weights (engine/kv/prefix_cache.py), so new weights never read old weights' K/V.
        self.model_id = model_id or weights_id(config.model, cfg, model.state_dict().items())
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.num_threads = config.num_threads or default_num_threads(cfg.num_params())
        pool = PoolShape(num_blocks, cache.block_size, kv_dtype, swap_blocks, host_blocks)
        # this process's forward, or rank 0's of several
        self.runner = self._make_runner(model, pool)
        self.kv_pool, self.attention = self.runner.kv_pool, self.runner.attention  # rank 0's share
        log_kv_cache(self.kv_pool, self.max_model_len, config.cache)
        self.device = weight.device
        self.eos = eos_ids(model, tokenizer)
        # chapter 12: who guesses the tokens a step verifies (None: one token per step)
        self.speculative = config.speculative or (SpeculativeConfig() if proposer else None)
        self.proposer = proposer or (make_proposer(self.speculative, model, tokenizer, config,
                                                   self.num_threads)
                                     if self.speculative else None)
        self.speculator = (Speculator(self.speculative, self.proposer, cfg.vocab_size)
                           if self.proposer else None)
        self.requests: dict[str, Request] = {}
        self.grammars = None  # chapter 13: engine/structured/grammar.py's GrammarCache, when needed
        self._row_errors: dict[Request, str] = {}  # this step's requests whose grammar failed
        self.trace = Trace(config=self._config_dict(num_blocks, swap_blocks))
        self._events: list[dict] = []  # arrivals and aborts since the last step
        self._finished: dict[str, str] = {}  # finished since the last step's report: id -> reason
        self._num_steps = 0
        self._num_requests = 0  # for default request ids
        self._next_seq_id = 0  # the BlockManager's key of each sequence (one per sample)

    @classmethod
    def from_pretrained(cls, model: str = "tinylab", dtype: str = "float32",
                        **options) -> LLMEngine:
        """Load a local Hugging Face-format folder or a bundled model by name; options:
        `engine_config`."""
        from engine.loading.loader import load_model

        config = engine_config(model, dtype, **options)
        llama, tokenizer = load_model(model, dtype=getattr(torch, dtype))
        return cls(llama, tokenizer, config)

    def _make_runner(self, model: LlamaModel, pool: PoolShape):
        """The forward of one process (`ModelRunner`), or, with tensor/pipeline parallel, rank 0's
        side of several (`engine.parallel.ParallelExecutor`: it starts the other ranks, or joins
        torchrun's)."""
        par = self.config.parallel
        if par.world_size == 1:
            kv_pool = PagedKVPool.for_model(model.config, pool.num_blocks, pool.block_size,
                                            pool.dtype, model.embed_tokens.weight.device,
                                            pool.num_swap_blocks, pool.num_host_blocks)
            # speed="fast" may compute with a transformed COPY of the model: self.model stays as
            # given
            return ModelRunner(accelerate(model, kv_pool, self.config, self.sliding_window,
                                          self.num_threads))
        from engine.parallel.comm import launched_by_torchrun
        from engine.parallel.executor import ParallelExecutor, default_worker_threads

        if model.embed_tokens.weight.device.type != "cpu":
            raise ValueError("tensor/pipeline parallel runs on CPU ranks over gloo here; "
                             "load the model on the CPU")
        self.num_threads = default_worker_threads(self.num_threads, par.world_size)
        start = ParallelExecutor.join_torchrun if launched_by_torchrun() else ParallelExecutor.start
        return start(model, self.config, pool, self.sliding_window, self.num_threads)

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel engine (nothing to do for one process). Idempotent."""
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, tenant: str | None = None,
                    arrival_time: float | None = None, template_version: str | None = None,
                    cache_scope: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id. What is rejected: see the module
        docstring.

        Prefix caching (when enabled) shares full KV blocks only between requests of the same model
        id, `template_version` (the chat template's version, named by the caller) and scope:
        `cache_scope` None is private to `tenant` (public without one), "private" needs a tenant,
        "public" shares with every tenant that asks for "public" (e.g. a common system prompt). See
        engine/kv/prefix_cache.py."""
        params = SamplingParams() if params is None else params
        request_id = str(self._num_requests if request_id is None else request_id)
        where = f"request {request_id!r}"
        params = self._checked_options(params, priority, tenant, arrival_time, where)
        try:
            key = cache_key(self.model_id, template_version, tenant, cache_scope)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]  # one per sample
        if any(i in self.requests for i in ids):
            raise ValueError(f"request_id {request_id!r} is already in use; "
                             "pick another or leave it None")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"{where}: SamplingParams.n={params.n} samples could never run "
                             f"together with max_num_seqs={self.config.scheduler.max_num_seqs}; "
                             "lower n or raise max_num_seqs")
        prompt_ids = self._prompt_ids(prompt, where)
        params = self._clamp(params, len(prompt_ids))
        grammar = self._compiled_grammar(params, where)
        # the last token is never fed
        self._check_fits_in_pool(len(prompt_ids) + params.max_tokens - 1, where)
        arrival = self.clock() if arrival_time is None else float(arrival_time)
        priority = int(priority)  # a numpy int would not go into the JSON trace
        text = prompt if isinstance(prompt, str) else None
        samples = [Request(rid, self._next_seq_id + i, text, prompt_ids, _sample_params(params, i),
                           arrival, priority, tenant,
                           self.tokenizer.detokenizer() if self.tokenizer else None,
                           self.eos, index=i, cache_key=key) for i, rid in enumerate(ids)]
        self._install_grammar(grammar, samples)
        head = samples[0]
        head.pending_forks = samples[1:]
        for s in samples:
            s.samples = samples
        self._next_seq_id += len(samples)
        self._num_requests += 1
        self.requests.update((s.request_id, s) for s in samples)
        self.scheduler.add(head)
        self._events.append({"type": "arrived", "request_id": request_id, "arrival_time": arrival,
                             "num_prompt_tokens": len(prompt_ids), "max_tokens": params.max_tokens,
                             "priority": priority, "tenant": tenant, "n": params.n})
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (every unfinished sample, even if sample 0 is done; "<id>#i" stops sample
        i only) and free all its blocks at once. Nothing left to stop: a warning, and False."""
        req = self.requests.get(str(request_id))
        group = [] if req is None else (req.samples or [req]) if req.index == 0 else [req]
        targets = [s for s in group if not s.is_finished]
        if not targets:
            state = "unknown" if req is None else "already finished"
            warnings.warn(f"abort_request({request_id!r}): {state} request id, nothing to abort",
                          stacklevel=2)
            return False
        now, head = self.clock(), req.samples[0] if req.samples else req
        for seq in targets:
            if seq in head.pending_forks:
                head.pending_forks.remove(seq)
            self.scheduler.finish(seq)
            self._forget_guesses(seq)
            seq.finish("abort", now)
            self._events.append({"type": "aborted", "request_id": seq.request_id, "time": now})
            self._finished[seq.request_id] = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name): only while no sequence holds a KV block on the
        device; returns False (nothing changed) otherwise, True when cleared (or prefix caching is
        off)."""
        return self.block_manager.reset_prefix_cache()

    def refresh_model_id(self) -> str:
        """Recompute `model_id` from the model's weights, after changing them in place (a fine-tune
        step, a new checkpoint loaded into the same model). Requests added from now on get the new
        id in their cache key, so they never read K/V the old weights wrote; the old entries become
        unreachable and are evicted as usual. Returns the new id.

        With speed="fast" the runner may compute with a transformed COPY of the model (fused,
        packed), so this is also where that copy is made again from the new weights: after changing
        weights in place, call it before the next step."""
        self.model_id = weights_id(self.config.model, self.model.config,
                                   self.model.state_dict().items())
        if self.config.parallel.world_size == 1:
            self.use_model(self.model, refresh_id=False)
        return self.model_id

    def use_model(self, model: LlamaModel, refresh_id: bool = True) -> None:
        """Compute with `model` from the next step on (same shapes: the KV pool stays; the lab's
        incidents swap in a pruned copy). New weights get a new `model_id` unless refresh_id is
        False."""
        if self.config.parallel.world_size != 1:
            raise ValueError("use_model swaps the model of a single-process engine; "
                             "a parallel engine's ranks hold their own shards: build a new engine")
        self.model = model
        self.runner.load(accelerate(model, self.kv_pool, self.config, self.sliding_window,
                                    self.num_threads))
        if refresh_id:
            self.model_id = weights_id(self.config.model, model.config, model.state_dict().items())

    @property
    def acceleration(self):
        """What the runner computes with (engine/runner.py's Acceleration): model, attention, decode
        step, argmax, and the fast wing's choices with their reasons."""
        return self.runner.acceleration

    @property
    def weight_layout(self) -> str:
        """"packed" when the runner computes with the fast wing's fused and packed copy, else
        "linear"."""
        return self.acceleration.choices.get("weight_layout", "linear")

    def get_request(self, request_id: str) -> Request:
        return self.requests[str(request_id)]

    def pop_request(self, request_id: str) -> Request:
        """Forget a finished request and its samples (the engine keeps finished ones until
        popped)."""
        req = self.requests[str(request_id)]
        group = req.samples if req.index == 0 else [req]
        unfinished = [s.request_id for s in group if not s.is_finished]
        if unfinished:
            raise ValueError(f"request {request_id!r} still has unfinished samples {unfinished}; "
                             "abort it or step until it finishes")
        for seq in group:
            self.requests.pop(seq.request_id)
        return req

    def _clamp(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if params.max_tokens <= room:
            return params
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    def _checked_options(self, params, priority, tenant, arrival_time,
                         where: str) -> SamplingParams:
        """Check what the scheduler will sort by or look up NOW: a None priority would make every
        later step's sort raise. Returns params with its stop_token_ids as plain, checked ints."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: params must be a SamplingParams (or None), "
                            f"got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise TypeError(f"{where}: priority must be an int (lower is served first), "
                            f"got {priority!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"{where}: tenant must be a str or None, "
                            f"got {type(tenant).__name__} {tenant!r}")
        if arrival_time is not None and (isinstance(arrival_time, bool)
                                         or not isinstance(arrival_time, numbers.Real)
                                         or not math.isfinite(arrival_time)):
            raise ValueError(f"{where}: arrival_time must be a finite number of seconds on the "
                             f"engine's clock (or None for now), got {arrival_time!r}")
        stops = validate_token_ids(params.stop_token_ids, self.model.config.vocab_size,
                                   f"{where}: SamplingParams.stop_token_ids", allow_empty=True)
        if params.logit_bias:
            validate_token_ids(list(params.logit_bias), self.model.config.vocab_size,
                               f"{where}: SamplingParams.logit_bias's token ids")
        return dataclasses.replace(params, stop_token_ids=stops)

    def _compiled_grammar(self, params: SamplingParams, where: str):
        """params.structured_outputs compiled once (cached by constraint), or None (chapter 13).
        A constraint that cannot be compiled raises a ValueError naming the request, before anything
        is registered."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{where}: structured_outputs needs a tokenizer (a grammar is over "
                             "text): load the model with its tokenizer")
        if self.grammars is None:
            from engine.structured.grammar import GrammarCache

            self.grammars = GrammarCache(self.tokenizer, self.model.config.vocab_size)
        try:
            return self.grammars.get(spec)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _install_grammar(self, compiled, samples: list[Request]) -> None:
        """Each sample gets its own matcher (its own place in the grammar)."""
        if compiled is None:
            return
        from engine.structured.grammar import GrammarProcessor

        for s in samples:
            s.sampling.grammar = GrammarProcessor(compiled, self.eos)

    def _prompt_ids(self, prompt, where: str) -> list[int]:
        """The prompt's token ids, each checked by `validate_token_ids`: token ids before encoding
        (the encoder's int() would turn 5.7 into 5), a tokenizer's ids after (its vocabulary may be
        larger)."""
        vocab = self.model.config.vocab_size
        if not isinstance(prompt, str):
            prompt = validate_token_ids(prompt, vocab, f"{where}: prompt")
        try:
            ids = encode_prompt(prompt, self.tokenizer, self.max_model_len)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None
        return validate_token_ids(ids, vocab, f"{where}: prompt (tokenized)")

    def _check_fits_in_pool(self, num_tokens: int, where: str = "request") -> None:
        need, have = (self.block_manager.blocks_for(num_tokens),
                      self.block_manager.allocator.num_blocks)
        if need > have:
            raise ValueError(f"{where} needs up to {need} KV blocks ({num_tokens} tokens) "
                             f"but the pool has only num_blocks={have}: lower max_tokens, "
                             "shorten the prompt, "
                             "or raise num_blocks")

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One scheduler iteration: schedule, one packed forward, sample, update. Returns its
        report."""
        start, t0 = self.clock(), time.perf_counter()
        s = self.scheduler
        if self.speculator is not None:  # chapter 12: guesses, before the scheduler budgets them
            with torch_threads(self.num_threads):
                self.speculator.propose(self.scheduler.running, self._events)
        t_proposed = time.perf_counter()
        sched = s.schedule()
        if not sched.work and s.has_unfinished():  # a bug, not a state to wait in: fail loudly
            raise RuntimeError(f"the scheduler found nothing to run with {len(s.waiting)} waiting, "
                               f"{len(s.running)} running, {len(s.swapped)} swapped")
        time_s = TimeSplit(schedule=time.perf_counter() - t_proposed, propose=t_proposed - t0)
        at_risk = [r for w in sched.work for r in (w.request, *w.request.pending_forks)]
        try:
            # one thread for small models: see engine/threads.py
            with torch_threads(self.num_threads):
                sampled = self._forward_and_sample(sched, time_s)
            # before finished ones free blocks
            queues, blocks = self._queue_snapshot(), self._block_snapshot()
            scheduled, finish_events = self._update(sched, sampled, start)
        except BaseException as exc:
            # even Ctrl-C: the queues must stay consistent for the next step
            self._fail_step(sched, at_risk, exc, start, t0, time_s)
            raise
        return self._record(start, t0, time_s, scheduled, queues, blocks,
                            sched.events + finish_events)

    # ---- speculative decoding (chapter 12) -------------------------------------------------------
    def _forget_guesses(self, req: Request) -> None:
        """req is done (finished, aborted, failed): its proposer state can go."""
        if self.speculator is not None:
            self.speculator.forget(req)

    def _record(self, start: float, t0: float, time_s: TimeSplit,
                scheduled: list[ScheduledRequest], queues: QueueSnapshot, blocks: BlockSnapshot,
                step_events: list[dict]) -> StepReport:
        """Close the step: its report (with the arrivals and aborts made since the last one) into
        the trace."""
        queues.finished, self._finished = {**self._finished}, {}
        events, self._events = self._events + step_events, []
        report = StepReport(self._num_steps, start, self.clock(), time_s, scheduled, queues, blocks,
                            events)
        self._num_steps += 1
        time_s.other = max(0.0, time.perf_counter() - t0 - time_s.total)
        self.trace.append(report)
        return report

    def _fail_step(self, sched: SchedulerOutput, at_risk: list[Request], exc: BaseException,
                   start: float, t0: float, time_s: TimeSplit) -> None:
        """The step raised: nobody knows which of its K/V writes and tokens happened, so every
        sequence it ran (and the samples waiting to fork from them) ends with reason "error" and
        gives its blocks back.

        The step may also have swapped victims out; their copy to the CPU pool may not have
        happened, so they go back to `waiting` to be recomputed (always right, at the price of a
        prefill). Everyone else is untouched, and the next step serves them as usual. The caller
        re-raises."""
        self._row_errors = {}  # every sequence of the step fails below anyway
        queues, blocks = self._queue_snapshot(), self._block_snapshot()
        now, error, events = self.clock(), f"{type(exc).__name__}: {exc}", []
        for req in [r for r in at_risk if not r.is_finished]:
            head = req.samples[0] if req.samples else req
            if req in head.pending_forks:
                head.pending_forks.remove(req)
            self.scheduler.finish(req)
            self._forget_guesses(req)
            req.finish("error", now)
            req.error = error
            self._finished[req.request_id] = "error"
            events.append({"type": "finished", "request_id": req.request_id, "reason": "error",
                           "error": error})
        for e in sched.events:
            victim = self.requests.get(e["request_id"]) if e.get("mode") == "swap" else None
            if victim is not None and victim.status == SWAPPED:
                self.scheduler.finish(victim)  # out of `swapped`, its CPU blocks freed
                victim.num_computed_tokens = 0
                self.scheduler.add(victim)  # back to waiting, like a recompute preemption
        scheduled = [ScheduledRequest(w.request.request_id, w.phase, w.start, w.end, 0)
                     for w in sched.work]
        self._record(start, t0, time_s, scheduled, queues, blocks, sched.events + events)

    def _forward_and_sample(self, sched: SchedulerOutput,
                            time_s: TimeSplit) -> dict[Request, list[tuple]]:
        """Move blocks, run the packed forward, sample; returns request -> [(token, logprobs)]: one
        pair, or 1 to k + 1 for a decode that verified k guesses (engine/speculative/rejection.py).

        A request about to fork its samples lends its logits row to each of them (they share the
        prompt). The forward's time is shared between prefill and decode in proportion to their
        token counts (they share every matmul, so only the attention part could be told apart)."""
        t0 = time.perf_counter()
        # logits [S, V]
        moved, logits = self.runner.execute(sched.moves, sched.work, self.block_manager)
        if moved:
            sched.events.append({"type": "blocks_moved", **moved,
                                 "bytes": sum(moved.values()) * self.kv_pool.block_nbytes})
        if not sched.work:
            return {}
        t1 = time.perf_counter()
        owners, rows, verifies, end = [], [], [], 0
        for w in sched.work:  # the logits hold each work's last num_scored rows, in order
            end += w.num_scored
            if w.phase == "prefill" and w.request.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(w, logits[end - w.num_scored:end])
            if w.draft_token_ids:  # rows [end - k - 1, end): verified below
                verifies.append((w, end - w.num_scored, end))
            elif w.samples:
                # a fork samples from its parent's row
                for req in (w.request, *w.request.pending_forks):
                    owners.append(req)
                    rows.append(end - 1)
        sampled = self._sample(logits, owners, rows)
        for w, lo, hi in verifies:
            req = w.request
            q = None if req.draft_probs is None else req.draft_probs[:len(w.draft_token_ids)]
            try:
                sampled[req] = verify(logits[lo:hi], w.draft_token_ids, req.sampling, self.eos, q,
                                      argmax=self.acceleration.argmax)
            except Exception as exc:  # noqa: BLE001 - a grammar's failure is its request's alone
                if req.sampling.grammar is None:
                    raise
                self._row_errors[req] = f"{type(exc).__name__}: {exc}"
        time_s.sample = time.perf_counter() - t1
        n_prefill = sum(w.end - w.start for w in sched.work if w.phase == "prefill")
        n_all = sum(w.end - w.start for w in sched.work)
        time_s.prefill = (t1 - t0) * n_prefill / n_all
        time_s.decode = (t1 - t0) - time_s.prefill
        return sampled

    @staticmethod
    def _record_prompt_logprobs(w: ScheduledWork, rows) -> None:
        """A prefill chunk of a request that asked for prompt logprobs scored every fed position:
        row j predicts the token at w.start + j + 1. Keep those that are prompt tokens (the raw
        model's log-softmax, as vLLM reports them: no penalty, no temperature)."""
        req, k = w.request, w.request.params.prompt_logprobs
        prompt = req.prompt_token_ids
        if not req.prompt_logprobs:
            req.prompt_logprobs = [None] * len(prompt)
        for j in range(w.end - w.start):
            position = w.start + j + 1
            if position < len(prompt):  # (a recompute after preemption writes the same again)
                req.prompt_logprobs[position] = top_logprobs(rows[j].float(), prompt[position], k)

    def _sample(self, logits, owners: list[Request], rows: list[int]) -> dict[Request, list[tuple]]:
        """One token for each owner, from its row of the logits [S, V] (none: an empty call).

        A request's grammar can fail (its library gives up on a pathological schema mid-output):
        then we sample the rows one by one, and only the requests whose grammar failed end with
        "error" (`_row_errors`, handled in `_update`); everyone else's token is as before."""
        # [len(owners), V]
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        try:
            # model dtype: plain greedy rows need no copy
            out = sample(picked, [r.sampling for r in owners], self.eos,
                         argmax=self.acceleration.argmax)
        except Exception:
            if all(r.sampling.grammar is None for r in owners):
                raise
            return self._sample_one_by_one(picked, owners)
        return {req: [pair] for req, pair in zip(owners, zip(out.token_ids.tolist(), out.logprobs,
                                                             strict=True), strict=True)}

    def _sample_one_by_one(self, picked, owners: list[Request]) -> dict[Request, list[tuple]]:
        sampled = {}
        for i, req in enumerate(owners):
            try:
                out = sample(picked[i:i + 1], [req.sampling], self.eos,
                             argmax=self.acceleration.argmax)
                sampled[req] = [(int(out.token_ids[0]), out.logprobs[0])]
            except Exception as exc:  # noqa: BLE001
                if req.sampling.grammar is None:
                    raise
                self._row_errors[req] = f"{type(exc).__name__}: {exc}"
        return sampled

    def _finish_with_errors(self, now: float, events: list[dict]) -> None:
        """The requests whose grammar failed this step (and the samples waiting to fork from them)
        end with reason "error" and give their blocks back."""
        errors, self._row_errors = self._row_errors, {}
        for req, error in errors.items():
            for seq in (req, *req.pending_forks):
                if seq.is_finished:
                    continue
                self.scheduler.finish(seq)
                self._forget_guesses(seq)
                seq.finish("error", now)
                seq.error = error
                self._finished[seq.request_id] = "error"
                events.append({"type": "finished", "request_id": seq.request_id,
                               "reason": "error", "error": error})
            req.pending_forks = []

    def _update(self, sched: SchedulerOutput, sampled: dict,
                start: float) -> tuple[list[ScheduledRequest], list[dict]]:
        """Fork samples, append sampled tokens, finish requests that stopped; returns the step's
        ScheduledRequests and events (a forked sample shows as a prefill of 0 tokens that samples
        1)."""
        now, scheduled, events = self.clock(), [], []
        for w in sched.work:
            req = w.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
            if req in self._row_errors:
                scheduled.append(ScheduledRequest(req.request_id, w.phase, w.start, w.end, 0))
                continue
            emitted = sampled.get(req, [])
            if w.draft_token_ids:
                scheduled.append(self._accept(w, emitted, now, events))
                continue
            # the forward wrote K/V for positions < w.end: its full blocks can now be shared
            # (chapter 06)
            self.block_manager.cache_blocks(req.seq_id, req.all_token_ids, req.cache_key, w.end)
            new = [token for token, _ in emitted]
            scheduled.append(ScheduledRequest(req.request_id, w.phase, w.start, w.end, len(new),
                                              new))
            if not emitted:
                continue
            forks, req.pending_forks = req.pending_forks, []
            forks = [c for c in forks if c not in self._row_errors]  # (those end below)
            for child in forks:  # before req may finish and free the blocks they share
                self.scheduler.fork(req, child)
                child.first_scheduled_time = start
                events.append({"type": "forked", "request_id": child.request_id,
                               "parent": req.request_id})
                scheduled.append(ScheduledRequest(child.request_id, "prefill", w.end, w.end, 1,
                                                  [sampled[child][0]]))
            for seq in (req, *forks):
                self._append(seq, *sampled[seq][0], now, events)
        self._finish_with_errors(now, events)
        return scheduled, events

    def _accept(self, w: ScheduledWork, emitted: list[tuple], now: float,
                events: list[dict]) -> ScheduledRequest:
        """A verify step's outcome for one request: roll back the slots of the rejected guesses,
        let the prefix cache see the blocks that now hold real tokens only, append the emitted
        tokens (stopping where a stop rule fires), and say what happened.

            fed       o5 g1 g2 g3      emitted: g1 t2  (g1 kept, g2 rejected, t2 the target's)
            K/V       ok ok .. ..      the slots of g2, g3 are rolled back; t2 is fed next step
        """
        req, guesses = w.request, w.draft_token_ids
        kept = len(emitted) - 1
        rejected = len(guesses) - kept
        if rejected:
            self.block_manager.rollback(req.seq_id, rejected)
            req.num_computed_tokens -= rejected
        # positions < w.end - rejected now hold the K/V of real tokens: the old ones + kept guesses
        self.block_manager.cache_blocks(req.seq_id, req.all_token_ids + guesses[:kept],
                                        req.cache_key, w.end - rejected)
        new = []
        for token, logprobs in emitted:
            new.append(token)
            self._append(req, token, logprobs, now, events)
            if req.is_finished:  # a stop rule fired: the tokens after it are not output
                break
        return ScheduledRequest(req.request_id, w.phase, w.start, w.end, len(new), new,
                                list(guesses), kept)

    def _append(self, req: Request, token: int, logprobs, now: float, events: list[dict]) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
        if req.append_token(token, logprobs):
            req.finish(req.finish_reason, now)
            self.scheduler.finish(req)
            self._forget_guesses(req)
            self._finished[req.request_id] = req.finish_reason
            events.append({"type": "finished", "request_id": req.request_id,
                           "reason": req.finish_reason})

    # ---- reports ------------------------------------------------------------------------------
    def _queue_snapshot(self) -> QueueSnapshot:
        s = self.scheduler
        preempted = [r.request_id for r in s.waiting + s.swapped if r.preempted]
        return QueueSnapshot([r.request_id for r in s.waiting], [r.request_id for r in s.running],
                             [r.request_id for r in s.swapped], preempted)

    def _block_snapshot(self) -> BlockSnapshot:
        bm, usage, swap = (self.block_manager, self.block_manager.usage(),
                           self.block_manager.swap_usage())
        host = bm.host_usage()
        live = [r for r in self.scheduler.running if r.seq_id in bm]
        return BlockSnapshot(
            total=usage.total_blocks, used=usage.used_blocks, free=usage.free_blocks,
            cached=usage.cached_blocks,
            cached_block_ids=bm.cached_block_ids(),
            block_size=bm.block_size, wasted_slots=usage.wasted_slots,
            tables={r.request_id: bm.block_table(r.seq_id) for r in live},
            num_tokens={r.request_id: bm.num_tokens(r.seq_id) for r in live},
            swap_total=swap.total_blocks, swap_used=swap.used_blocks,
            host_total=host.total_blocks, host_used=host.used_blocks)

    def _config_dict(self, num_blocks: int, swap_blocks: int) -> dict:
        cfg = self.model.config
        return {
            "model": {"name": self.config.model, "model_id": self.model_id,
                      "vocab_size": cfg.vocab_size,
                      "hidden_size": cfg.hidden_size,
                      "num_hidden_layers": cfg.num_hidden_layers,
                      "max_position_embeddings": cfg.max_position_embeddings},
            "dtype": self.config.dtype, "speed": self.config.speed,
            "speed_choices": dict(self.acceleration.choices),
            "speed_reasons": dict(self.acceleration.reasons),
            "attention_backend": self.attention.backend, "num_threads": self.num_threads,
            "weight_layout": self.weight_layout,
            "layer_backend": "native" if getattr(self.runner, "decode_step", None) else "python",
            "cache": {"block_size": self.config.cache.block_size, "num_blocks": num_blocks,
                      "swap_space_blocks": swap_blocks, "kv_cache_bytes": self.kv_pool.nbytes,
                      "enable_prefix_caching": self.config.cache.enable_prefix_caching,
                      "sliding_window": self.sliding_window,
                      "kv_cache_dtype": self.config.cache.kv_cache_dtype,
                      "kv_offload_blocks": self.kv_pool.num_host_blocks,
                      "kv_offload_bytes": self.kv_pool.host_nbytes,
                      "swap_space_bytes": self.kv_pool.swap_nbytes},
            "scheduler": {**dataclasses.asdict(self.config.scheduler),
                          "token_budget": self.scheduler.token_budget},
        }


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample i of n draws with its own generator, seeded seed + i (so it equals an n = 1 request
    with that seed); unseeded samples each get fresh entropy."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)

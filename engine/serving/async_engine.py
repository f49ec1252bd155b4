"""`AsyncLLMEngine`: the step-through `LLMEngine` behind an asyncio front,
for the HTTP server (chapter 09).

An `LLMEngine` does nothing until somebody calls `step()`, and it is not safe to touch from two
threads at once. A server has many clients arriving whenever they like, each waiting for its own
tokens. We join the two worlds with ONE thread that owns the engine and a queue of commands into it:

    HTTP handlers (the event loop)               the engine thread (the only one touching LLMEngine)
    ──────────────────────────────               ───────────────────────────────────────────────────
    await add_request(prompt, params) ─command►  drain commands: add_request / abort_request / call
                                                 step()  ──► StepReport (one packed forward)
    async for update in stream:       ◄─queue──  publish: each request's new tokens and text delta
        send an SSE chunk                        (one asyncio.Queue per request, filled from here)
    client went away: abort_soon(id)  ─command►  abort before the next step: its blocks are free

While nothing is unfinished the engine thread sleeps on the command queue (no busy loop); while
requests run, it drains whatever commands arrived and takes the next step. So an abort (a client
that hung up) takes effect before the next step starts: its KV blocks are back in the pool
within one step.

Each step gives at most one new token per sequence, so one `RequestUpdate` per step is one token per
sample: `SampleDelta.text` is the text that token made visible. Two things can hold text back: a
multi-byte character split over several tokens (the detokenizer waits until it is whole), and stop
strings (with `stop=["\\n\\n"]` we hold back the last len(stop) - 1 characters until we know they
are not the start of a stop string, which would be cut from the answer). The text sent is therefore
always a prefix of the final text, and the deltas add up to exactly `LLM.generate`'s text.

A server runs for weeks, so we switch the engine's `Trace` to a bounded window
(`engine.trace.TraceRetention.server()`: the last reports whole, a ring of small summaries, an
optional rotated JSON-lines file) when this front is made: memory stays bounded in bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.companions.metrics import RequestTiming
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling import SamplingParams
from engine.serving.admission import Admission, Deadlines, Load, prefill_tokens_left
from engine.trace import StepReport, TraceRetention

log = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 10.0  # how long shutdown() waits for the engine thread to finish its current step


@dataclass
class SampleDelta:
    """What one step added to sample `index` of a request."""

    index: int
    text: str  # the newly visible text ("" when held back, or for an EOS token)
    token_ids: list[int]  # the new token ids (one per step; none when the sample was only finished)
    # set once, on the sample's last delta: "stop", "length", "abort", "error"
    finish_reason: str | None = None
    error: str | None = None  # with finish_reason "error": what went wrong
    # one TokenLogprobs per new token, when the request asked for logprobs (SamplingParams.logprobs)
    logprobs: list | None = None


@dataclass
class RequestUpdate:
    """One step's news for one request: a delta per sample that changed, and the running totals."""

    request_id: str
    deltas: list[SampleDelta]
    time: float  # on the engine's clock: the end of the step that produced it
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far, over all samples
    finished: bool  # every sample finished: this is the request's last update
    # on the last update of an aborted request: "queue_timeout", ...
    abort_reason: str | None = None
    # SamplingParams.prompt_logprobs: [None, TokenLogprobs, ...], once, on the first update that
    # carries tokens (the prompt is wholly scored by then)
    prompt_logprobs: list | None = None


@dataclass(eq=False)
class _Tracked:
    """The engine thread's bookkeeping for one live request (all of its n samples)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    samples: list[Request]
    holdback: int  # characters held back while a stop string could still match
    deadlines: Deadlines = field(default_factory=Deadlines)
    abort_reason: str | None = None
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    token_times: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.samples)
        self.sent_tokens, self.sent_chars, self.done = [0] * n, [0] * n, [False] * n
        self.token_times = [[] for _ in range(n)]


class RequestStream:
    """The updates of one request, in order: `async for update in stream`. It ends after the update
    with `finished=True`. Closing it before that (`await stream.aclose()`) aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, updates: asyncio.Queue,
                 prompt_tokens: int):
        self.engine, self.request_id, self.prompt_tokens = engine, request_id, prompt_tokens
        self._updates = updates
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.finished:
            raise StopAsyncIteration
        update = await self._updates.get()
        self.finished = update.finished
        return update

    async def aclose(self, reason: str = "cancelled") -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort_soon(self.request_id, reason)


class AsyncLLMEngine:
    """One thread steps `engine`; coroutines add requests and read their updates
    (see the module docstring).

    `on_step(report)` runs on the engine thread after every step, `on_finish(timing, index)` once
    per finished sequence (sample `index` of its request) with its `RequestTiming` (token times =
    the ends of the steps that sampled them, as in `engine.companions.metrics.requests_from_trace`),
    and `on_abort(request_id, reason)` once per request aborted before it finished.
    /metrics hangs on these three.

    Overload protection (chapter 10, engine/serving/admission.py): with an `admission`, each new
    request passes `Admission.check` on the engine thread (with the load of that moment) or
    `add_request` raises its `Rejected`; its tenant's buckets are charged once the engine took it.
    Each request's deadlines (`queue_timeout_s`, `request_timeout_s`) are checked before every step,
    and one past its deadline is aborted with that reason."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[StepReport], None] | None = None,
                 on_finish: Callable[[RequestTiming, int], None] | None = None,
                 trace: TraceRetention | None = None, admission: Admission | None = None,
                 on_abort: Callable[[str, str], None] | None = None):
        self.engine, self.on_step, self.on_finish = engine, on_step, on_finish
        self.admission, self.on_abort = admission or Admission(), on_abort
        # a server's window, unless the caller asks for another (TraceRetention() keeps all)
        engine.trace.retain(trace if trace is not None else TraceRetention.server())
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # request id -> bookkeeping (engine thread only)
        self._owner: dict[str, str] = {}  # sample id ("<id>#i") -> request id
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self) -> AsyncLLMEngine:
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def shutdown(self, timeout_s: float = SHUTDOWN_WAIT_S) -> None:
        """Stop the engine thread; requests still running end with an "error" update."""
        if self._thread.is_alive():
            self._commands.put((self._stop, None))
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- the API for coroutines (and, for `call`, any thread) ------------------------------------
    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two steps (a consistent view of queues,
        blocks and trace); returns a Future with its result or exception. Usable from any thread."""
        if not self.is_running:
            raise RuntimeError("the AsyncLLMEngine is not running: call start() first "
                               "(or it was shut down)")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`call(fn)`, awaited."""
        return await asyncio.wrap_future(self.call(fn))

    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None, queue_timeout_s: float | None = None,
                          request_timeout_s: float | None = None,
                          **options) -> RequestStream:
        """Add a request (options as `LLMEngine.add_request`: priority, tenant, ...); returns its
        stream. A bad request raises the engine's ValueError / TypeError here, and the engine keeps
        nothing; one the admission turns away raises `engine.serving.admission.Rejected`.
        The timeouts may only shorten the admission's own
        (`AdmissionLimits.queue_timeout_s`, `request_timeout_s`)."""
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        timeouts = (queue_timeout_s, request_timeout_s)
        rid, n_prompt = await self.run(
            lambda e: self._add(e, loop, updates, prompt, params, request_id, options, timeouts))
        return RequestStream(self, rid, updates, n_prompt)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None,
                       **options) -> AsyncIterator[RequestUpdate]:
        """Yield the request's updates until it finishes;
        leaving early (a break, a cancelled task) aborts it."""
        stream = await self.add_request(prompt, params, request_id, **options)
        try:
            async for update in stream:
                yield update
        finally:
            await stream.aclose()

    async def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        """Abort `request_id` now, on the engine thread between two steps, and say whether we did:
        False when no request of that id is in flight (never added, or finished already). When this
        returns True, its KV blocks are back in the pool and its stream has its last update
        (`abort_reason` = `reason`)."""
        return await self.run(lambda e: self._abort(request_id, reason))

    def abort_soon(self, request_id: str, reason: str = "cancelled") -> None:
        """Abort `request_id` before the next step (no-op if it already finished). Never blocks."""
        if self._thread.is_alive():
            self._commands.put((lambda e: self._abort(request_id, reason), None))

    def abort_all(self, reason: str) -> concurrent.futures.Future:
        """Abort every request in flight (a shutdown whose drain ran out of time), on the engine
        thread; the Future's result is how many were aborted. Usable from any thread."""
        return self.call(lambda e: sum(self._abort(rid, reason) for rid in list(self._tracked)))

    def num_in_flight(self) -> concurrent.futures.Future:
        """A Future of the number of requests in flight (added, not yet finished)."""
        return self.call(lambda e: len(self._tracked))

    def load(self) -> Load:
        """Requests in flight and prompt tokens still to prefill
        (engine thread: inside `call` / `run`)."""
        s = self.engine.scheduler
        return Load(len(self._tracked), prefill_tokens_left(s.waiting + s.running))

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._drain(wait=not self.engine.has_unfinished_requests())
            if not self._stopping and self.engine.has_unfinished_requests():
                self._expire()
            if not self._stopping and self.engine.has_unfinished_requests():
                self._step()
        for rid in list(self._tracked):
            self._fail(rid, "the server is shutting down")

    def _drain(self, wait: bool) -> None:
        """Run the commands that arrived; with `wait`, sleep until at least one does."""
        try:
            item = self._commands.get() if wait else self._commands.get_nowait()
            while True:
                self._execute(*item)
                item = self._commands.get_nowait()
        except queue.Empty:
            return

    def _execute(self, fn: Callable, future: concurrent.futures.Future | None) -> None:
        if future is not None and not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, the engine thread goes on
            if future is None:
                log.exception("engine command failed")
            else:
                future.set_exception(exc)
        else:
            if future is not None:
                future.set_result(result)

    def _stop(self, engine: LLMEngine) -> None:
        self._stopping = True

    def _add(self, engine: LLMEngine, loop, updates, prompt, params, request_id, options,
             timeouts) -> tuple[str, int]:
        now, tenant, n_prompt = engine.clock(), options.get("tenant"), _prompt_len(engine, prompt)
        # bad params: the engine says
        cost = n_prompt + getattr(params, "n", 1) * getattr(params, "max_tokens", 0)
        # bad timeouts: ValueError, nothing kept
        deadlines = self.admission.deadlines(now, *timeouts)
        self.admission.check(tenant, n_prompt, cost, self.load(), now)  # or Rejected: nothing kept
        # bad input: ValueError, nothing kept
        rid = engine.add_request(prompt, params, request_id, **options)
        self.admission.charge(tenant, cost, now)
        head = engine.get_request(rid)
        samples = head.samples or [head]
        holdback = max((len(s) for s in params.stop or []), default=1) - 1
        self._tracked[rid] = _Tracked(loop, updates, samples, holdback, deadlines)
        self._owner.update((s.request_id, rid) for s in samples)
        return rid, len(head.prompt_token_ids)

    def _expire(self) -> None:
        """Abort every request past one of its deadlines
        (engine/serving/admission.py's `Deadlines`)."""
        now = self.engine.clock()
        for rid, t in list(self._tracked.items()):
            started = any(s.first_scheduled_time is not None for s in t.samples)
            reason = t.deadlines.expired(now, started)
            if reason is not None:
                self._abort(rid, reason)

    def _abort(self, request_id: str, reason: str = "cancelled") -> bool:
        t = self._tracked.get(request_id)
        if t is None:  # finished (and retired) meanwhile: nothing to do
            return False
        aborted = any(not s.is_finished for s in t.samples)
        if aborted:
            # every unfinished sample: blocks back to the pool now
            self.engine.abort_request(request_id)
            t.abort_reason = reason
            self._notify(self.on_abort, request_id, reason)
        self._emit(request_id, self.engine.clock())
        if not self.engine.has_unfinished_requests():
            # an empty step, so the trace records the abort now, not at the next arrival
            self._step()
        return aborted

    def _step(self) -> None:
        trace = self.engine.trace
        recorded = trace.num_recorded
        try:
            report = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine finished the requests it ran with "error"
            log.exception("an engine step failed")
            if trace.num_recorded == recorded:  # it failed before running anyone: end every request
                for rid in list(self._tracked):
                    self._fail(rid, f"{type(exc).__name__}: {exc}")
                return
            report = trace.steps[-1]
        self._publish(report)
        self._notify(self.on_step, report)

    def _publish(self, report: StepReport) -> None:
        """Send each request that got tokens (or finished) in this step its update."""
        touched = [s.request_id for s in report.scheduled] + list(report.queues.finished)
        for rid in dict.fromkeys(self._owner[s] for s in touched if s in self._owner):
            self._emit(rid, report.end_time)

    def _emit(self, rid: str, now: float) -> None:
        t = self._tracked[rid]
        deltas, first_tokens = [], sum(t.sent_tokens) == 0
        for i, seq in enumerate(t.samples):
            new_ids = list(seq.output_token_ids[t.sent_tokens[i]:])
            finishing = seq.is_finished and not t.done[i]
            if not new_ids and not finishing:
                continue
            t.token_times[i] += [now] * len(new_ids)
            end = (len(seq.text) if seq.is_finished
                   else max(t.sent_chars[i], len(seq.text) - t.holdback))
            text = seq.text[t.sent_chars[i]:end]
            logprobs = (list(seq.logprobs[t.sent_tokens[i]:t.sent_tokens[i] + len(new_ids)])
                        if seq.params.logprobs is not None else None)
            t.sent_tokens[i] += len(new_ids)
            t.sent_chars[i] = end
            t.done[i] = seq.is_finished
            reason = seq.finish_reason if seq.is_finished else None
            deltas.append(SampleDelta(seq.index, text, new_ids, reason, seq.error, logprobs))
        finished = all(t.done)
        head = t.samples[0]
        scored = (list(head.prompt_logprobs) if first_tokens and sum(t.sent_tokens) > 0
                  and head.params.prompt_logprobs is not None else None)
        update = RequestUpdate(rid, deltas, now, len(head.prompt_token_ids),
                               sum(t.sent_tokens), finished, t.abort_reason if finished else None,
                               scored)
        if finished:
            self._retire(rid)
        self._deliver(t, update)

    def _retire(self, rid: str) -> None:
        """A finished request: report each sample's timing,
        then the engine forgets it (pop_request)."""
        t = self._tracked.pop(rid)
        for i, seq in enumerate(t.samples):
            self._owner.pop(seq.request_id, None)
            timing = RequestTiming(seq.request_id, seq.arrival_time, t.token_times[i],
                                   seq.first_scheduled_time, seq.finish_time, seq.finish_reason,
                                   len(seq.prompt_token_ids), seq.tenant, seq.priority,
                                   seq.num_preemptions)
            self._notify(self.on_finish, timing, seq.index)
        self.engine.pop_request(rid)

    def _fail(self, rid: str, error: str) -> None:
        """End a request that the engine could not serve:
        abort what is left, send an "error" update."""
        t = self._tracked[rid]
        if any(not s.is_finished for s in t.samples):
            self.engine.abort_request(rid)
        now = self.engine.clock()
        deltas = [SampleDelta(s.index, "", [], "error", error)
                  for s, done in zip(t.samples, t.done, strict=True) if not done]
        t.done = [True] * len(t.samples)
        self._retire(rid)
        self._deliver(t, RequestUpdate(rid, deltas, now, len(t.samples[0].prompt_token_ids),
                                       sum(t.sent_tokens), True))

    def _deliver(self, t: _Tracked, update: RequestUpdate) -> None:
        try:
            t.loop.call_soon_threadsafe(t.queue.put_nowait, update)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            if not update.finished:
                self._abort(update.request_id)

    @staticmethod
    def _notify(callback: Callable | None, *values) -> None:
        if callback is None:
            return
        try:
            callback(*values)
        except Exception:  # noqa: BLE001 - a metrics hook must never stop the engine
            log.exception("an AsyncLLMEngine callback failed")


def _prompt_len(engine: LLMEngine, prompt) -> int:
    """The prompt's length in tokens, for the admission
    (a malformed prompt is the engine's to refuse)."""
    if isinstance(prompt, str):
        return len(engine.tokenizer.encode(prompt)) if engine.tokenizer is not None else 0
    try:
        return len(prompt)
    except TypeError:
        return 0

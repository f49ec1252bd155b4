"""Chapter 08: replicas. N independent engines,
each in its own process with its own KV pool, behind a router.

    parent process                                     replica processes (one torch thread each)
    ──────────────                                     ─────────────────────────────────────────
    generate(prompts)                                  replica i: an LLMEngine of its own (weights,
                                                                  KV pool, prefix cache), stepping
      each prompt, when it arrives:                               continuously:
        router.pick(token ids) -> i ──inbox queue i──► take every new request, step() while any runs
      wait on every pipe and every process at once     ──► each finished request's RequestOutput
        an output ──► router.on_finish(i) ◄──pipe i────     (with the engine's own timings)
        a process that died ──► ReplicaError, at once
      outputs, in the prompts' order

Nothing is split, so nothing crosses between replicas per token: throughput grows with the number of
replicas as long as each one has cores (or a GPU) of its own, and every replica needs the whole
model's memory. The router decides what each replica's cache can reuse (engine/replicas/router.py).

`ReplicaPool(..., in_process=True)` runs the same replicas as engines in THIS process, stepped in
turn: no speedup (the replicas' busy times add up), but deterministic, inspectable
(`pool.engines[i].trace`) and quick to start, for tests and notebooks. Both kinds share
`ReplicaWorker` (one replica's engine and its bookkeeping) and the parent's loop; only the transport
differs.

A replica process that dies (killed, out of memory) is noticed as soon as it happens: the parent
waits on the processes' sentinels together with their pipes, so `generate` raises a `ReplicaError`
naming the replica within one wait, never hangs. The pool is broken from then on: `shutdown()` and
start another.

As with any multiprocessing, a SCRIPT that starts replica processes must do it under
`if __name__ == "__main__":` (each replica re-imports the script's module; notebooks need nothing).
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import connection, parent_process

import torch
import torch.multiprocessing as mp

from engine.llm import RequestOutput, as_params_list, as_prompt_list
from engine.llm_engine import LLMEngine, engine_config
from engine.replicas.router import Router, make_router
from engine.request import validate_token_ids
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer, encode_prompt
from engine.trace import TraceRetention

# A replica process imports torch and loads its model before it can serve: seconds for tinylab, a
# minute or more for a real model on a busy machine.
STARTUP_TIMEOUT_S = 180.0
POLL_S = 0.1  # the parent wakes at least this often while waiting (arrival times, timeouts)
IDLE_WAIT_S = 0.5  # an idle replica wakes this often to check that its parent is still alive
# how long stats() waits for a busy replica to answer (it answers between steps)
REPLY_TIMEOUT_S = 30.0
# how long shutdown() lets the replicas finish their current step before killing them
SHUTDOWN_WAIT_S = 10.0
# How replica processes start. Never a plain fork: the parent may hold torch's thread pools and
# locks, which a forked child inherits half-taken. "spawn" starts a fresh interpreter per replica,
# which imports torch and the engine again (seconds each, on every pool). The "forkserver" is one
# fresh interpreter that imports them ONCE and forks every replica from that clean, single-threaded
# state; later pools in the same session fork from it again, so starting one costs little more than
# loading the weights. Where there is no forkserver (Windows), spawn.
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
# Each replica keeps the last steps of its engine's Trace (about a minute at 100 steps/s); a replica
# lives as long as its pool, and an untrimmed trace would grow without end (engine/trace.py's
# TraceRetention does the trimming).
TRACE_STEPS_KEPT = 5_000


class ReplicaError(RuntimeError):
    """A replica could not start, crashed or died: the pool cannot serve any more."""


@dataclass
class ReplicaStats:
    """What one replica has done since it started (counted inside the replica)."""

    replica: int
    pid: int
    requests_served: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # prompt tokens looked up in the prefix cache (its "prefix_hit" events)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0  # of those, tokens found cached: not prefilled
    busy_s: float = 0.0  # wall time inside engine.step()
    steps: int = 0


class ReplicaWorker:
    """One replica: its engine, the requests it holds, and its stats. The same code runs inside a
    replica process and, for `in_process=True`, in the parent."""

    def __init__(self, index: int, engine: LLMEngine, max_trace_steps: int = TRACE_STEPS_KEPT):
        self.index, self.engine = index, engine
        engine.trace.retain(TraceRetention(full_steps=max_trace_steps))
        self.live: list[str] = []  # requests added and not yet handed back
        self.stats = ReplicaStats(index, os.getpid())

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
            arrival_time: float) -> None:
        self.engine.add_request(prompt, params, request_id=request_id, arrival_time=arrival_time)
        self.live.append(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (the caller gave up on it); it is handed back, finished "abort",
        by the next step."""
        if request_id in self.live and not _finished(self.engine, request_id):
            self.engine.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step (when anything runs), then hand back every request that has finished."""
        if self.engine.has_unfinished_requests():
            self._step_engine()
        done = [rid for rid in self.live if _finished(self.engine, rid)]
        outputs = []
        for rid in done:
            self.live.remove(rid)
            out = RequestOutput.from_request(self.engine.pop_request(rid))
            self.stats.requests_served += 1
            self.stats.prompt_tokens += len(out.prompt_token_ids)
            self.stats.generated_tokens += sum(len(o.token_ids) for o in out.outputs)
            outputs.append(out)
        return outputs

    def _step_engine(self) -> None:
        """engine.step(), counting its time and its prefix-cache lookups. A step that raised after
        running someone finished those requests with reason "error" (they go back as such); one that
        raised before running anyone would fail the same way forever, so it propagates."""
        trace = self.engine.trace
        recorded = trace.num_recorded
        t0 = time.perf_counter()
        try:
            self.engine.step()
        except Exception:
            if trace.num_recorded == recorded:
                raise
        finally:
            self.stats.busy_s += time.perf_counter() - t0
        if trace.num_recorded == recorded:
            return
        self.stats.steps += 1
        for e in trace.steps[-1].events:
            if e.get("type") == "prefix_hit":
                self.stats.prefix_cache_queries += e["num_query_tokens"]
                self.stats.prefix_cache_hits += e["num_tokens"]


def _finished(engine: LLMEngine, request_id: str) -> bool:
    return all(s.is_finished for s in engine.get_request(request_id).samples)


# ---- inside a replica process --------------------------------------------------------------------
def _replica_main(index: int, model: str, dtype: str, speed: str | None, options: dict,
                  inbox, outbox) -> None:
    """A replica process: load the engine, say "ready", then serve until told to stop or orphaned.
    Messages out are (kind, replica, payload): ready, failed, done, rejected, stats, crashed."""
    torch.set_num_threads(options.get("num_threads") or 1)
    try:
        engine = LLMEngine.from_pretrained(model, dtype, speed=speed, **options)
    except BaseException:  # noqa: BLE001 - whatever it was, the parent shows it
        outbox.send(("failed", index, traceback.format_exc()))
        return
    worker = ReplicaWorker(index, engine)
    outbox.send(("ready", index, os.getpid()))
    try:
        _replica_loop(worker, inbox, outbox)
    except BaseException:  # noqa: BLE001 - report, then die: the parent sees the process end too
        try:
            outbox.send(("crashed", index, traceback.format_exc()))
        finally:
            raise SystemExit(1) from None


def _replica_loop(worker: ReplicaWorker, inbox, outbox) -> None:
    """Take commands, step while anything runs; block on the inbox only when idle."""
    parent = parent_process()
    while True:
        for command, *args in _commands(inbox, wait=not worker.busy):
            if command == "stop":
                return
            if command == "add":
                try:
                    worker.add(*args)
                except (ValueError, TypeError) as e:  # a bad request: refused, nothing registered
                    outbox.send(("rejected", worker.index, (args[0], e)))
            elif command == "abort":
                worker.abort(*args)
            elif command == "stats":
                outbox.send(("stats", worker.index, worker.stats))
        if worker.busy:
            for out in worker.step():
                outbox.send(("done", worker.index, out))
        elif parent is not None and not parent.is_alive():
            return  # orphaned: nobody will ever read our outputs


def _commands(inbox, wait: bool) -> list[tuple]:
    """Every command waiting in the inbox; when `wait`,
    block up to IDLE_WAIT_S for the first one."""
    out = []
    try:
        out.append(inbox.get(timeout=IDLE_WAIT_S) if wait else inbox.get_nowait())
        while True:
            out.append(inbox.get_nowait())
    except queue.Empty:
        return out


# ---- the two transports --------------------------------------------------------------------------
class _InProcess:
    """The replicas as engines in this process, stepped in turn
    (each `collect` steps every busy one once)."""

    def __init__(self, workers: list[ReplicaWorker]):
        self.workers = workers
        self._events: list[tuple] = []

    def submit(self, replica: int, request_id: str, prompt, params: SamplingParams,
               arrival: float) -> None:
        try:
            self.workers[replica].add(request_id, prompt, params, arrival)
        except (ValueError, TypeError) as e:
            self._events.append(("rejected", replica, (request_id, e)))

    def abort(self, replica: int, request_id: str) -> None:
        self.workers[replica].abort(request_id)

    def request_stats(self) -> None:
        self._events += [("stats", w.index, dataclasses.replace(w.stats))
                         for w in self.workers]  # a snapshot

    def collect(self, timeout: float) -> list[tuple]:
        events, self._events = self._events, []
        busy = [w for w in self.workers if w.busy]
        if not busy and not events:
            time.sleep(timeout)  # nothing runs: wait for the next arrival
        for w in busy:
            events += [("done", w.index, out) for out in w.step()]
        return events

    def close(self) -> None:
        self.workers = []


class _Processes:
    """One process per replica (see START_METHOD): commands go in on a queue each,
    results come back on a pipe each."""

    def __init__(self, num_replicas: int, model: str, dtype: str, speed: str | None, options: dict,
                 startup_timeout_s: float):
        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            # torch and the engine, imported once in the server
            ctx.set_forkserver_preload([__name__])
        self.inboxes = [ctx.Queue() for _ in range(num_replicas)]
        # (parent reads, replica writes)
        pipes = [ctx.Pipe(duplex=False) for _ in range(num_replicas)]
        self.conns = [reader for reader, _ in pipes]
        self.procs = [ctx.Process(target=_replica_main, name=f"replica-{i}", daemon=True,
                                  args=(i, model, dtype, speed, options, self.inboxes[i], writer))
                      for i, (_, writer) in enumerate(pipes)]
        for p in self.procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the replica holds the only writer: when it dies, our reader sees EOF
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _wait_ready(self, timeout_s: float) -> None:
        waiting, deadline = set(range(len(self.procs))), time.monotonic() + timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas {sorted(waiting)} did not start within "
                                   f"startup_timeout_s={timeout_s}; the machine may be overloaded: "
                                   "raise it or use fewer replicas")
            for kind, replica, payload in self.collect(POLL_S):
                if kind == "ready":
                    waiting.discard(replica)
                else:  # failed or died
                    raise ReplicaError(f"replica {replica} could not start: {payload}")

    def submit(self, replica: int, request_id: str, prompt, params: SamplingParams,
               arrival: float) -> None:
        self.inboxes[replica].put(("add", request_id, prompt, params, arrival))

    def abort(self, replica: int, request_id: str) -> None:
        self.inboxes[replica].put(("abort", request_id))

    def request_stats(self) -> None:
        for inbox in self.inboxes:
            inbox.put(("stats",))

    def collect(self, timeout: float) -> list[tuple]:
        """Wait up to `timeout` for any pipe to have data or any process to end; read everything
        there is. A replica that ended is reported as ("died", replica, how), after whatever it said
        before dying."""
        connection.wait(self.conns + [p.sentinel for p in self.procs], timeout)
        events = []
        for conn in self.conns:
            try:
                while conn.poll():
                    events.append(conn.recv())
            except (EOFError, OSError):
                pass  # the replica's end is closed: it is dead, found below
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                events.append(("died", i, _how_it_ended(p)))
        return events

    def close(self) -> None:
        """Ask every replica to stop, give them SHUTDOWN_WAIT_S, then terminate, then kill."""
        for inbox in self.inboxes:
            try:
                inbox.put(("stop",))
            except (ValueError, OSError):
                pass  # already closed
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for stop in ("terminate", "kill"):
            for p in self.procs:
                if p.is_alive():
                    getattr(p, stop)()
                    p.join(1.0)
        for inbox in self.inboxes:
            inbox.cancel_join_thread()  # a dead reader must not block our exit on unread commands
            inbox.close()
        for conn in self.conns:
            conn.close()
        self.procs, self.inboxes, self.conns = [], [], []


def _how_it_ended(p) -> str:
    if p.exitcode < 0:
        return f"pid {p.pid} was killed by signal {-p.exitcode}"
    return f"pid {p.pid} exited with code {p.exitcode}"


# ---- the pool ------------------------------------------------------------------------------------
class ReplicaPool:
    """N replicas of one model behind a router;
    `generate` takes prompts and returns outputs in order.

        with ReplicaPool("tinylab", num_replicas=2, router="prefix_aware",
                         enable_prefix_caching=True) as pool:
            outs = pool.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
            pool.stats()          # per replica: requests served, prefix-cache hit tokens, busy
                                  # time, ...
            pool.last_placement   # which replica served each prompt of the last call

    `router`: a name ("round_robin", "least_outstanding", "prefix_aware") or a `Router` of
    num_replicas.
    `in_process=True`: the replicas are engines in this process, stepped in turn (see the module
    docstring); they share one copy of the weights, each has its own KV pool. `**engine_options` go
    to every replica's `engine_config` (block_size, num_blocks, max_num_seqs, enable_prefix_caching,
    ...).
    """

    def __init__(self, model: str = "tinylab", num_replicas: int = 2,
                 router: str | Router = "least_outstanding",
                 *, in_process: bool = False, dtype: str = "float32",
                 speed: str | None = None, num_threads: int = 1,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S, **engine_options):
        # engine_config checks them all
        config = engine_config(model, dtype, speed, num_threads, **engine_options)
        self.router = _as_router(router, num_replicas, config.cache.block_size)
        self.num_replicas, self.in_process = num_replicas, in_process
        self.tokenizer, self.max_model_len, self.vocab_size, engines = _load(
            model, dtype, config, num_replicas, in_process)
        if in_process:
            self._backend = _InProcess([ReplicaWorker(i, e) for i, e in enumerate(engines)])
        else:
            options = {**engine_options, "num_threads": num_threads}
            self._backend = _Processes(num_replicas, model, dtype, speed, options,
                                       startup_timeout_s)
        # at shutdown(), garbage collection or exit
        self._close = weakref.finalize(self, self._backend.close)
        self._pending: dict[str, int] = {}  # request id -> replica, for every request in flight
        # request id -> index in the current generate call's prompts
        self._wanted: dict[str, int] = {}
        self._results: dict[str, RequestOutput] = {}
        self._stats: dict[int, ReplicaStats] = {}
        self._broken: str | None = None
        self._next_id = 0
        self.last_placement: list[int] = []

    # ---- public ---------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 arrival_times_s: Sequence[float] | None = None, timeout_s: float | None = None
                 ) -> list[RequestOutput]:
        """Serve every prompt (texts or token-id lists, as `LLM.generate`);
        outputs in the prompts' order.

        Each prompt is routed and submitted when it arrives: all at once, or at `arrival_times_s[i]`
        seconds after the call starts (non-decreasing), while earlier ones are being served. A bad
        prompt raises before anything is submitted; a request a replica refuses, a dead replica, or
        `timeout_s` raise after aborting this call's other requests."""
        self._check_open()
        prompts = as_prompt_list(prompts)
        params_list = as_params_list(params, len(prompts))
        arrivals = _check_arrivals(arrival_times_s, len(prompts))
        routing_ids = [self._routing_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        ids = [str(self._next_id + i) for i in range(len(prompts))]
        self._next_id += len(prompts)
        self._wanted, self.last_placement = {rid: i for i, rid in enumerate(ids)}, []
        try:
            self._serve(ids, prompts, routing_ids, params_list, arrivals, timeout_s)
        except BaseException:
            self._abandon()
            raise
        outputs = [self._results.pop(rid) for rid in ids]
        self._wanted = {}
        return outputs

    def stats(self) -> list[ReplicaStats]:
        """Each replica's `ReplicaStats`, asked of the replicas themselves."""
        self._check_open()
        self._stats = {}
        self._backend.request_stats()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while len(self._stats) < self.num_replicas:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_replicas)) - set(self._stats))
                raise TimeoutError(f"replicas {missing} did not answer stats() within "
                                   f"{REPLY_TIMEOUT_S} s")
            self._pump(POLL_S)
        return [self._stats[i] for i in range(self.num_replicas)]

    @property
    def engines(self) -> list[LLMEngine]:
        """The replicas' engines
        (in_process=True only: a replica process's engine lives in that process)."""
        if not self.in_process:
            raise RuntimeError("the engines live in the replica processes; use stats(), or "
                               "ReplicaPool(..., in_process=True) to look inside them")
        return [w.engine for w in self._backend.workers]

    @property
    def pids(self) -> list[int]:
        """Each replica's process id (this process's, for in_process=True)."""
        return [os.getpid()] * self.num_replicas if self.in_process else self._backend.pids

    def shutdown(self) -> None:
        """Stop the replicas (idempotent); outputs not yet collected are lost."""
        self._close()

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the loop -------------------------------------------------------------------------------
    def _serve(self, ids, prompts, routing_ids, params_list, arrivals, timeout_s) -> None:
        """Submit each request when it arrives, collect outputs,
        until all of this call's are back."""
        start, submitted, n = time.monotonic(), 0, len(ids)
        while len(self._results) < n:
            now = time.monotonic() - start
            if timeout_s is not None and now > timeout_s:
                raise TimeoutError(f"generate: {n - len(self._results)} of {n} requests unfinished "
                                   f"after timeout_s={timeout_s}; they were aborted")
            while submitted < n and arrivals[submitted] <= now:
                i = submitted
                replica = self.router.pick(routing_ids[i])
                self._pending[ids[i]] = replica
                self.last_placement.append(replica)
                self._backend.submit(replica, ids[i], prompts[i], params_list[i], time.time())
                submitted += 1
            wait = POLL_S if submitted == n else min(POLL_S, max(0.0, arrivals[submitted] - now))
            self._pump(wait)

    def _pump(self, wait: float) -> None:
        """Handle every event the replicas sent (waiting up to `wait`);
        a refusal raises after all are handled."""
        refused = None
        for kind, replica, payload in self._backend.collect(wait):
            if kind == "done":
                self._finish(payload.request_id)
                if payload.request_id in self._wanted:
                    self._results[payload.request_id] = payload
            elif kind == "rejected":
                rid, error = payload
                self._finish(rid)
                refused = refused or (rid, replica, error)
            elif kind == "stats":
                self._stats[replica] = payload
            else:  # died (how, one line) or crashed (its traceback): the pool cannot serve any more
                how = payload if kind == "died" else "its traceback follows"
                self._broken = (f"replica {replica} {kind} ({how}) with "
                                f"{self.router.outstanding[replica]} request(s) in flight, which "
                                "are lost; call shutdown() and start a new ReplicaPool")
                if kind == "crashed":
                    self._broken += "\n" + payload
                raise ReplicaError(self._broken)
        if refused is not None:
            rid, replica, error = refused
            where = f"prompts[{self._wanted[rid]}]" if rid in self._wanted else f"request {rid!r}"
            raise type(error)(f"{where} (on replica {replica}): {error}")

    def _finish(self, request_id: str) -> None:
        self.router.on_finish(self._pending.pop(request_id))

    def _abandon(self) -> None:
        """The call failed: abort its requests still in flight (their outputs will be dropped)."""
        if self._broken is None:
            for rid in self._wanted:
                if rid in self._pending:
                    self._backend.abort(self._pending[rid], rid)
        for rid in self._wanted:
            self._results.pop(rid, None)
        self._wanted = {}

    def _check_open(self) -> None:
        if self._broken is not None:
            raise ReplicaError(self._broken)
        if not self._close.alive:
            raise RuntimeError("this ReplicaPool was shut down; start a new one")

    def _routing_ids(self, prompt, where: str) -> list[int]:
        """The prompt's token ids, for the router
        (and to refuse a bad prompt before anything is sent)."""
        ids = (prompt if isinstance(prompt, str)
               else validate_token_ids(prompt, self.vocab_size, where))
        try:
            return encode_prompt(ids, self.tokenizer, self.max_model_len)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None


def _as_router(router: str | Router, num_replicas: int, block_size: int) -> Router:
    if isinstance(router, Router):
        if router.num_replicas != num_replicas:
            raise ValueError(f"router has num_replicas={router.num_replicas} but the pool "
                             f"num_replicas={num_replicas}; build the router for the pool's size")
        return router
    if not isinstance(router, str):
        raise TypeError("router must be a routing policy's name or a Router, "
                        f"got {type(router).__name__}")
    return make_router(router, num_replicas, block_size)


def _load(model: str, dtype: str, config, num_replicas: int, in_process: bool):
    """(tokenizer, max_model_len, vocab_size, engines): the engines only in process (sharing one
    model); for processes, only what the parent needs to route (the tokenizer, no weights)."""
    from engine.loading.loader import load_model, read_config, resolve_model_path

    if in_process:
        llama, tokenizer = load_model(model, dtype=getattr(torch, dtype))
        engines = [LLMEngine(llama, tokenizer, config) for _ in range(num_replicas)]
        cfg = llama.config
    else:
        # a GGUF model is converted here, once, not by every replica
        path = resolve_model_path(model)
        cfg, engines = read_config(path), []
        tokenizer = Tokenizer.from_dir(path, cfg) if (path / "tokenizer.json").exists() else None
    return tokenizer, cfg.max_position_embeddings, cfg.vocab_size, engines


def _check_arrivals(arrival_times_s, n: int) -> list[float]:
    if arrival_times_s is None:
        return [0.0] * n
    times = [float(t) for t in arrival_times_s]
    if len(times) != n:
        raise ValueError(f"arrival_times_s has {len(times)} times for {n} prompts; "
                         "give one per prompt")
    if any(not math.isfinite(t) or t < 0 for t in times) or times != sorted(times):
        raise ValueError("arrival_times_s must be finite, >= 0 and non-decreasing (seconds after "
                         f"the call starts), got {times[:8]}{'...' if n > 8 else ''}")
    return times

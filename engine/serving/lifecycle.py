"""A server's life: what it says when it starts, and how it stops (what an operator of vLLM or
any uvicorn service expects).

At start (`startup_lines`, logged by `serve`), as vLLM logs it: the model, its dtype and context,
the speed path chosen and why, the KV pool in blocks, tokens and bytes, the concurrency it allows
at the model's full context, prefix caching, and what the trace keeps.

At SIGTERM:

    SIGTERM or SIGINT (1st)   stop admission: new requests get 503, /health 503 (a load balancer
                              sends traffic elsewhere); the server keeps listening, so nobody
                              gets a refused connection
                              drain: the requests in flight go on, for at most
                              `shutdown_timeout_s` seconds (python -m engine serve
                              --shutdown-timeout, default 30)
                              abort what is left: a stream gets a final error event (503,
                              code "server_shutdown"), a waiting client a 503, never a hang;
                              their KV blocks go back to the pool
                              stop uvicorn, stop the engine thread, log the blocks still held
                              (0), exit with status 0
    SIGTERM or SIGINT (2nd)   exit at once (no more waiting)

uvicorn alone drains without a deadline and then re-raises the signal, so the process ends
"killed by signal 15" however cleanly it stopped; this server does neither.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time

import uvicorn
from fastapi import FastAPI

from engine.serving.server import SHUTDOWN_ABORT, OpenAIServer

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one stream for the operator

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # vLLM's and Kubernetes' usual grace period
DRAIN_POLL_S = 0.05
ENGINE_CALL_TIMEOUT_S = 10.0  # an engine step of a small model takes far less
# after the drain: how long uvicorn lets open connections send their last bytes (the final
# events of aborted requests go out within an event-loop turn; this is a margin) before it cuts them
FLUSH_S = 1.0


class GracefulServer(uvicorn.Server):
    """uvicorn's Server with the shutdown of the module docstring. `app.state.server` (an
    `OpenAIServer`, from `build_app`) is drained; an app without one (the dashboard's replay) just
    stops."""

    def __init__(self, config: uvicorn.Config,
                 shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        if not shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s={shutdown_timeout_s!r} must be >= 0 (seconds)")
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.drained: tuple[int, int] | None = None  # (finished while draining, aborted)
        self._signalled = False

    def handle_exit(self, sig: int, frame) -> None:
        """Our signal handler, in place of uvicorn's (which records the signal to re-raise it)."""
        if self._signalled:
            log.warning("second signal: exiting now, without waiting for open requests")
            self.force_exit = self.should_exit = True
            return
        self._signalled = True
        openai = getattr(self.config.app.state, "server", None) if isinstance(
            self.config.app, FastAPI) else None
        if openai is None:
            self.should_exit = True
            return
        openai.draining = True
        log.info("shutting down: new requests get 503; draining for at most %.0f s "
                 "(a second signal exits at once)", self.shutdown_timeout_s)
        threading.Thread(target=self._drain, args=(openai,), name="servelab-drain",
                         daemon=True).start()

    def _drain(self, openai: OpenAIServer) -> None:
        front, deadline = openai.front, time.monotonic() + self.shutdown_timeout_s
        try:
            at_start = left = front.num_in_flight().result(ENGINE_CALL_TIMEOUT_S)
            while left and time.monotonic() < deadline and not self.force_exit:
                time.sleep(DRAIN_POLL_S)
                left = front.num_in_flight().result(ENGINE_CALL_TIMEOUT_S)
            aborted = front.abort_all(SHUTDOWN_ABORT).result(ENGINE_CALL_TIMEOUT_S) if left else 0
            self.drained = (at_start - left, aborted)
            log.info("drain done: %d request(s) finished, %d aborted at the deadline",
                     at_start - left, aborted)
        except Exception:  # noqa: BLE001 - whatever happened, the server must still stop
            log.exception("the drain failed; stopping anyway")
        self.should_exit = True


# glibc's mallopt parameters (malloc.h) and the value we pin both to
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
PINNED_MALLOC_THRESHOLD = 1 << 20  # 1 MiB


def pin_malloc_thresholds() -> str:
    """Keep a long-running server's native heap from creeping up; returns what was done, in words.

    glibc serves a large allocation with its own mmap, but each time such a block is freed it
    raises that threshold (up to 32 MiB) so the next one comes from the heap instead. A server
    allocates tensors of ever-changing sizes (every step's batch is another length), so after a
    while they all come from the heap, which fragments: its RSS grew ~20 MB per 1,000 requests in
    our soak. Pinning the thresholds (what MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ do)
    keeps every block over 1 MiB in its own mapping, returned to the OS when freed. Call it before
    the model is loaded. benchmarks/results/soak.md has the numbers, with and without.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "allocator: not glibc, thresholds left as they are"
    if not (libc.mallopt(M_MMAP_THRESHOLD, PINNED_MALLOC_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, PINNED_MALLOC_THRESHOLD)):
        return "allocator: glibc refused mallopt, thresholds left as they are"
    return (f"allocator: glibc mmap/trim thresholds pinned at {PINNED_MALLOC_THRESHOLD >> 20} MiB "
            "(a server's heap stays flat)")


def startup_lines(openai: OpenAIServer) -> list[str]:
    """What the server logs once its engine is built (see the module docstring)."""
    engine = openai.engine
    pool, cfg, trace = engine.kv_pool, engine.config, engine.trace.retention
    tokens = pool.num_blocks * pool.block_size
    per_request = math.ceil(engine.max_model_len / pool.block_size)
    choices = ", ".join(f"{k}={v}" for k, v in engine.acceleration.choices.items() if k != "speed")
    kept = "every step" if trace.full_steps is None else f"the last {trace.full_steps} steps whole"
    return [
        f"model {openai.model_name!r} ({cfg.model}), dtype {cfg.dtype}, "
        f"max_model_len {engine.max_model_len}",
        f"speed {cfg.speed}: {choices}",
        f"KV cache: {pool.num_blocks} blocks x {pool.block_size} tokens = {tokens} tokens, "
        f"{pool.nbytes / 2**20:.1f} MiB ({str(pool.dtype).removeprefix('torch.')})",
        f"maximum concurrency for {engine.max_model_len}-token requests: "
        f"{pool.num_blocks / per_request:.2f}x (max_num_seqs {cfg.scheduler.max_num_seqs})",
        f"prefix caching {'on' if cfg.cache.enable_prefix_caching else 'off'}, "
        f"chunked prefill {'on' if cfg.scheduler.enable_chunked_prefill else 'off'}",
        _speculation_line(engine),
        f"trace: {kept}, {trace.summary_steps} step summaries"
        + (f", every step to {trace.file} (rotated at {trace.file_max_bytes / 2**20:g} MiB)"
           if trace.file is not None else ""),
    ]


def _speculation_line(engine) -> str:
    """Chapter 12's settings, as vLLM logs its speculative config."""
    spec = engine.speculative
    if engine.proposer is None:
        return "speculative decoding off"
    return (f"speculative decoding: {engine.proposer.name}, {spec.num_speculative_tokens} guesses "
            f"per step, off from {spec.disable_by_batch_size} decoding requests, at most "
            f"{spec.max_verify_rows} rows per step")


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          shutdown_timeout_s: float | None = None) -> None:
    """Serve until SIGTERM / SIGINT, then shut down gracefully (the module docstring);
    `shutdown_timeout_s` None: DEFAULT_SHUTDOWN_TIMEOUT_S."""
    if shutdown_timeout_s is None:
        shutdown_timeout_s = DEFAULT_SHUTDOWN_TIMEOUT_S
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=FLUSH_S)  # also sets up uvicorn's logging
    openai = getattr(app.state, "server", None)
    if openai is not None:
        for line in startup_lines(openai):
            log.info("%s", line)
    GracefulServer(config, shutdown_timeout_s).run()
    if openai is not None:
        used = openai.engine.block_manager.allocator.num_used
        log.info("stopped: %d KV block(s) still held by a request", used)

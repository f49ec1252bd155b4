"""The server's Prometheus metrics (chapter 09): GET /metrics in vLLM's names, so the dashboards
and alerts written for a vLLM server read a servelab server as they are.

What /metrics exposes; every series carries the label `model_name` (the served model's name):

    histograms  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
                vllm:request_time_per_output_token_seconds, vllm:e2e_request_latency_seconds,
                vllm:request_queue_time_seconds, vllm:request_prompt_tokens,
                vllm:request_generation_tokens
    counters    vllm:prompt_tokens_total, vllm:generation_tokens_total,
                vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total,
                vllm:num_preemptions_total, vllm:request_success_total{finished_reason},
                vllm:admission_rejections_total{reason}, vllm:request_aborts_total{reason},
                vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
                vllm:spec_decode_num_accepted_tokens_total,
                vllm:spec_decode_num_accepted_tokens_per_pos_total{position} (chapter 12)
    gauges      vllm:num_requests_running, vllm:num_requests_waiting,
                vllm:num_requests_swapped, vllm:kv_cache_usage_perc

(prometheus_client adds `_total` to a counter's name, and a `_created` sample to counters and
histograms.)

Where the values come from. We measure nothing here; we turn what the engine already reports into
Prometheus samples, through four hooks:

    on_finish   once per finished sequence. AsyncLLMEngine (engine/serving/async_engine.py) builds
                its `RequestTiming`: arrival, first scheduled and finish from the sequence, and each
                token's time = the end of the engine step that delivered it (as
                `requests_from_trace` reads a trace). The histograms observe
                `request_observations(timing)` from engine/companions/metrics.py, the one place
                latencies are computed; prompt tokens and successes are counted from it too.
    on_step     after every engine step, with its `StepReport` (engine/trace.py): tokens out,
                "preempted" events, prefix-cache queries and hits (`prefix_cache_stats`), guesses
                verified and kept (`spec_decode_stats`).
    on_reject   the server, when admission turns a request away (engine/serving/admission.py);
    on_abort    AsyncLLMEngine, when a request is aborted (timeouts, disconnects, cancels).

The gauges are read at scrape time instead (`set_gauges`): the scheduler's queues and the block
pool's usage, on the engine thread between two steps, so they never see half a step.

A NEW Prometheus metric goes here and nowhere else: one definition in `ServerMetrics.__init__`
(vLLM's name when vLLM has one; a per-request quantity gets its name in `VLLM_NAMES` and its value
from `request_observations`) and one update site among the hooks above. server.py only wires the
hooks to the engine front and serves `scrape` at GET /metrics.
"""

from __future__ import annotations

from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.companions.metrics import (
    VLLM_NAMES,
    RequestTiming,
    prefix_cache_stats,
    request_observations,
    spec_decode_stats,
)
from engine.llm_engine import LLMEngine
from engine.serving.async_engine import AsyncLLMEngine
from engine.trace import StepReport, Trace

# vLLM's histogram buckets (seconds), with finer ones in front: a small model on a CPU answers in
# milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                       100000)
HISTOGRAMS = {  # RequestTiming quantity (engine/companions/metrics.py) -> (help, buckets)
    "ttft_s": ("Time to first token (arrival -> first token), seconds.", TTFT_BUCKETS),
    "itl_s": ("Inter-token latency (the gap before each token after the first), seconds.",
              TOKEN_GAP_BUCKETS),
    "tpot_s": ("Time per output token after the first, per request, seconds.", TOKEN_GAP_BUCKETS),
    "e2e_s": ("End-to-end request latency (arrival -> finish), seconds.", REQUEST_BUCKETS),
    "queue_s": ("Time spent waiting before first scheduled, seconds.", REQUEST_BUCKETS),
    "prompt_tokens": ("Prompt tokens per request.", TOKEN_COUNT_BUCKETS),
    "output_tokens": ("Generated tokens per request.", TOKEN_COUNT_BUCKETS),
}


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of its own (two servers in one process never
    mix). The hooks `on_finish`, `on_step`, `on_reject`, `on_abort` update them (see the module
    docstring for who calls which); `scrape` answers GET /metrics."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name

        def make(kind, name, doc, **kw):  # one series, labelled with the model's name
            return kind(name, doc, ["model_name"], registry=registry, **kw).labels(model_name)

        def counter_by(name, doc, label):  # a second label, whose value each update names
            return Counter(name, doc, ["model_name", label], registry=registry)

        self.histograms = {key: make(Histogram, VLLM_NAMES[key], doc, buckets=buckets)
                           for key, (doc, buckets) in HISTOGRAMS.items()}
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens",
                                  "Prompt tokens of the requests served.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.prefix_queries = make(Counter, VLLM_NAMES["prefix_cache_queries"],
                                   "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = make(Counter, VLLM_NAMES["prefix_cache_hits"],
                                "Of those, tokens found cached.")
        self.preemptions = make(Counter, VLLM_NAMES["preemptions"],
                                "Preemptions (recompute or swap).")
        self.success = counter_by("vllm:request_success", "Finished requests, by finish reason.",
                                  "finished_reason")
        self.rejections = counter_by("vllm:admission_rejections",
                                     "Requests turned away at the door, by reason "
                                     "(engine/serving/admission.py).", "reason")
        self.aborts = counter_by("vllm:request_aborts",
                                 "Requests aborted before they finished, by reason "
                                 "(queue_timeout, request_timeout, client_disconnect, cancelled).",
                                 "reason")
        self.spec_drafts = make(Counter, "vllm:spec_decode_num_drafts",
                                "Verify steps of a request with at least one guess (chapter 12).")
        self.spec_draft_tokens = make(Counter, "vllm:spec_decode_num_draft_tokens",
                                      "Guessed tokens verified.")
        self.spec_accepted = make(Counter, "vllm:spec_decode_num_accepted_tokens",
                                  "Guessed tokens the target kept.")
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Guesses kept, by position in the draft (0 first).",
                                             ["model_name", "position"], registry=registry)
        self.running = make(Gauge, "vllm:num_requests_running",
                            "Sequences holding KV blocks (running).")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Sequences waiting for a seat.")
        self.swapped = make(Gauge, "vllm:num_requests_swapped",
                            "Sequences swapped out to the CPU pool.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc",
                             "KV blocks in use, as a fraction (1 = full).")

    # ---- the update sites --------------------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        """On the engine thread, after every step: tokens out, preemptions, prefix-cache lookups."""
        self.generation_tokens.inc(sum(s.tokens_out for s in report.scheduled))
        stats = prefix_cache_stats(Trace(steps=[report]))
        self.prefix_queries.inc(stats.queries)
        self.prefix_hits.inc(stats.hits)
        self.preemptions.inc(sum(e.get("type") == "preempted" for e in report.events))
        spec = spec_decode_stats([report])
        if spec.num_drafts:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted.inc(spec.num_accepted_tokens)
            for position, n in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(n)

    def on_abort(self, request_id: str, reason: str) -> None:
        self.aborts.labels(self.model_name, reason).inc()

    def on_reject(self, reason: str) -> None:
        self.rejections.labels(self.model_name, reason).inc()

    def on_finish(self, timing: RequestTiming, sample_index: int) -> None:
        """Once per finished sequence (sample `sample_index` of its request)."""
        for key, values in request_observations(timing).items():
            if key == "prompt_tokens" and sample_index > 0:
                continue  # one prompt, n samples: counted once
            for v in values:
                self.histograms[key].observe(v)
        if sample_index == 0 and timing.output_tokens > 0:  # its prompt was prefilled
            self.prompt_tokens.inc(timing.prompt_tokens)
        self.success.labels(self.model_name, timing.finish_reason or "unknown").inc()

    def set_gauges(self, engine: LLMEngine) -> None:
        """On the engine thread, between two steps: the queues and the pool as they are now."""
        s, usage = engine.scheduler, engine.block_manager.usage()
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.swapped.set(len(s.swapped))
        self.kv_usage.set(usage.used_blocks / usage.total_blocks if usage.total_blocks else 0.0)

    # ---- the /metrics rendering ------------------------------------------------------------------
    def exposition(self) -> bytes:
        """Every metric of the registry in Prometheus' text format."""
        return generate_latest(self.registry)

    async def scrape(self, front: AsyncLLMEngine) -> Response:
        """The GET /metrics response: the gauges refreshed on the engine thread (while it runs),
        then the whole registry."""
        if front.is_running:
            await front.run(self.set_gauges)
        return Response(self.exposition(), media_type=CONTENT_TYPE_LATEST)

"""Chapters 09-10: the engine behind HTTP. Everything here is a FRONT on one `LLMEngine`,
never a copy of it.

    async_engine.py  one background loop stepping the engine; per-request output queues
    server.py        the OpenAI-compatible routes, SSE streaming, limits, cancellation
    request_body.py  the body's JSON parsed strictly; the fields we refuse by name
    lifecycle.py     what `serve` logs at start; graceful shutdown (SIGTERM drains, then aborts)
    prometheus.py    /metrics in vLLM's names
    admission.py     queue caps, rate limits, timeouts: who gets in under overload
    dashboard.py     the classroom dashboard (static/dashboard.html) and its replay
    bench_serve.py   the load generator and client-side timings
    diagnose.py      the troubleshooting order, run over a trace
"""

"""`python -m engine bench serve`: load an OpenAI-compatible server the way vLLM's `bench serve`
does, and measure it from the client's side (chapter 09).

    python -m engine serve --model tinylab --port 8000 &
    python -m engine bench serve --model tinylab --port 8000 --num-prompts 50 --request-rate 8 \\
        --burstiness 1 --goodput ttft:200 tpot:50

What it does, in vLLM's terms and with vLLM's flag names:
- requests: `--dataset-name random` draws `--num-prompts` prompts of random token ids, input and
  output lengths uniform in [L * (1 - r), L * (1 + r)] for L = `--random-input-len` /
  `--random-output-len` and r = `--random-range-ratio` (the server is told to write exactly that
  many tokens only with `--ignore-eos`); `--dataset-name custom --dataset-path f.jsonl` reads one
  {"prompt", "output_len", "user"} object per line instead (a mixed workload: lengths and
  tenants of your choice);
- arrivals: `--request-rate inf` sends everything at once; a finite rate draws the gaps between
  requests from a gamma distribution with shape `--burstiness` and mean 1 / rate:

      burstiness 1 (Poisson):   |  |    | ||   |     |  |   |      the gaps of a memoryless stream
      burstiness 0.25:          ||||        |||           ||||    the same mean rate, in bursts
      burstiness 4:             |   |   |   |   |  |   |   |      nearly a metronome

  `--max-concurrency` caps the requests in flight (the others wait in the client, and that wait is
  not counted as latency, as in vLLM);
- measuring: each request is streamed; a token's time is when its chunk arrived. TTFT, TPOT, ITL,
  E2E, throughput and goodput (`--goodput ttft:ms tpot:ms e2el:ms`) are computed by
  `engine/companions/metrics.py`, the same code that reads the engine's own `Trace`, so the client's
  view and the server's can be compared.

Percentiles are nearest-rank ones (engine/companions/metrics.py explains why); vLLM's numpy
percentiles interpolate, so on a few requests the two can differ a little.
Prints vLLM's table; `--save-result` writes its JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from engine.companions.metrics import SLO, RequestTiming, mean, nearest_rank, std, summarize
from engine.progress import progress_bar

# vLLM's AIOHTTP_TIMEOUT: a benchmark request may wait behind hours of queue
REQUEST_TIMEOUT_S = 6 * 3600
GOODPUT_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}  # vLLM's names -> SLO fields
METRIC_TITLES = {  # vLLM's section titles and labels in the printed table
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
TABLE_WIDTH, LABEL_WIDTH = 50, 40  # vLLM's table: 50 columns, labels padded to 40


# ---- what to send, and when ----------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One request of the benchmark: a prompt (text or token ids), its length
    and the tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    user: str | None = None  # OpenAI's `user`: the server's tenant


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int,
                    avoid_ids: Sequence[int] = ()) -> list[BenchRequest]:
    """vLLM's random dataset: lengths uniform in [L(1 - r), L(1 + r)], token ids uniform over the
    vocabulary without `avoid_ids`
    (special tokens such as BOS/EOS would change what the prompt means)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio={range_ratio!r} must be in [0, 1)")
    for name, value in (("--random-input-len", input_len), ("--random-output-len", output_len),
                        ("--num-prompts", num_prompts)):
        if value < 1:
            raise ValueError(f"{name}={value!r} must be >= 1")
    rng, avoid = random.Random(seed), set(avoid_ids)
    ids = [i for i in range(vocab_size) if i not in avoid]

    def length(base: int) -> int:
        return rng.randint(max(1, int(base * (1 - range_ratio))), int(base * (1 + range_ratio)))

    out = []
    for _ in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        out.append(BenchRequest([rng.choice(ids) for _ in range(n_in)], n_in, n_out))
    return out


def custom_requests(path: str | Path, num_prompts: int,
                    default_output_len: int) -> list[BenchRequest]:
    """A mixed workload from a JSONL file:
    one {"prompt": text or token ids, "output_len"?: int, "user"?: str} per line, taken in order
    (and cycled when the file has fewer than `num_prompts` lines)."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{i + 1}: each line must be a JSON object with a 'prompt' "
                             "(text or token ids), "
                             "e.g. {\"prompt\": \"2+2=\", \"output_len\": 8}") from None
        # text: the server's usage tells the length
        n_in = len(prompt) if isinstance(prompt, list) else 0
        rows.append(BenchRequest(prompt, n_in, int(row.get("output_len", default_output_len)),
                                 row.get("user")))
    if not rows:
        raise ValueError(f"{path} has no requests; write one JSON object per line")
    return [rows[i % len(rows)] for i in range(num_prompts)]


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, in seconds after the start: all at 0 for an infinite rate,
    else gaps drawn from Gamma(shape=burstiness, scale=1 / (rate * burstiness)),
    whose mean is 1 / rate (vLLM's process)."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate={request_rate!r} must be > 0 requests per second "
                         "(or inf)")
    if not burstiness > 0:
        raise ValueError(f"--burstiness={burstiness!r} must be > 0 "
                         "(1: Poisson; < 1 burstier; > 1 steadier)")
    if math.isinf(request_rate):
        return [0.0] * num
    rng, theta, now, out = random.Random(seed), 1.0 / (request_rate * burstiness), 0.0, []
    for _ in range(num):
        out.append(now)
        now += rng.gammavariate(burstiness, theta)
    return out


def parse_goodput(items: Sequence[str] | None) -> SLO | None:
    """vLLM's `--goodput ttft:200 tpot:50 e2el:2000` (milliseconds) as an SLO
    (None when not given)."""
    if not items:
        return None
    limits = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of "
                             f"{', '.join(GOODPUT_KEYS)}, e.g. --goodput ttft:200 tpot:50")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the limit must be a number of milliseconds, "
                             "e.g. ttft:200") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the limit must be > 0 milliseconds")
        limits[GOODPUT_KEYS[key]] = ms / 1000
    return SLO(**{"ttft_s": math.inf, "tpot_s": math.inf, **limits})


# ---- one request, as the client sees it ----------------------------------------------------------


@dataclass
class RequestResult:
    """One request as the client measured it
    (times in seconds on the client's perf_counter clock)."""

    request_id: str = ""  # the server's id (the response's "id"): the engine's request id
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    send_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str = ""

    def timing(self) -> RequestTiming:
        """The same record `engine/companions/metrics.py` builds from a trace,
        from the client's clock."""
        return RequestTiming(self.request_id, self.send_time, list(self.token_times),
                             finish_time=self.end_time, finish_reason=self.finish_reason,
                             prompt_tokens=self.prompt_len)


def payload(req: BenchRequest, model: str, chat: bool, ignore_eos: bool,
            temperature: float) -> dict:
    """The request body, shaped like vLLM's benchmark client's
    (plus return_token_ids, to time each token)."""
    body = {"model": model, "max_tokens": req.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
            "return_token_ids": True}
    if req.user is not None:
        body["user"] = req.user
    if chat:
        return {**body, "messages": [{"role": "user", "content": req.prompt}]}
    return {**body, "prompt": req.prompt}


async def send_request(client: httpx.AsyncClient, url: str, body: dict,
                       prompt_len: int) -> RequestResult:
    """Stream one request; time each token's arrival. Never raises: failures are `success=False`."""
    r = RequestResult(prompt_len=prompt_len, send_time=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r.error = (f"HTTP {resp.status_code}: "
                           f"{(await resp.aread()).decode(errors='replace')}")
                return r
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and _read_chunk(r, line[len("data: "):],
                                                             time.perf_counter()):
                    break
        r.end_time = time.perf_counter()
        r.success = not r.error and r.end_time is not None and r.finish_reason is not None
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


def _read_chunk(r: RequestResult, data: str, now: float) -> bool:
    """Fold one SSE chunk into r; True at `[DONE]`. A chunk carries one token per choice when the
    server returns token ids; otherwise (another server) each chunk with text counts as one
    token, as vLLM does."""
    if data.strip() == "[DONE]":
        return True
    chunk = json.loads(data)
    if "error" in chunk:
        r.error = chunk["error"].get("message", str(chunk["error"]))
        return True
    r.request_id = chunk.get("id", r.request_id)
    for choice in chunk.get("choices", []):
        text = (choice.get("text") if "text" in choice
                else (choice.get("delta") or {}).get("content") or "")
        r.text += text or ""
        n = len(choice["token_ids"]) if "token_ids" in choice else int(bool(text))
        r.token_times += [now] * n
        r.finish_reason = choice.get("finish_reason") or r.finish_reason
    usage = chunk.get("usage")
    if usage:
        r.output_tokens = usage["completion_tokens"]
        r.prompt_len = usage["prompt_tokens"]
    return False


# ---- the whole run -------------------------------------------------------------------------------


@dataclass
class BenchRun:
    """A finished benchmark: vLLM's result dict (`result`, what --save-result writes) and each
    request's client-side record (`results`, with the server's request ids)."""

    result: dict
    results: list[RequestResult]

    def timings(self) -> list[RequestTiming]:
        """The successful requests as `RequestTiming`s (send time = arrival),
        for engine/companions/metrics.py."""
        return [r.timing() for r in self.results if r.success]


async def benchmark(base_url: str, model: str, requests: Sequence[BenchRequest],
                    request_rate: float = math.inf, burstiness: float = 1.0,
                    max_concurrency: int | None = None, seed: int = 0,
                    endpoint: str = "/v1/completions", ignore_eos: bool = False,
                    temperature: float = 0.0, slo: SLO | None = None,
                    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                    percentiles: Sequence[float] = (99,), disable_tqdm: bool = False) -> BenchRun:
    """Send `requests` to `base_url + endpoint` on the arrival process, wait for all,
    and summarize."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency={max_concurrency!r} must be >= 1 "
                         "(or left out: no limit)")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    chat, url = "chat" in endpoint, base_url.rstrip("/") + endpoint
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress_bar(total=len(requests), disable=disable_tqdm, desc="bench serve", unit="req")
    limits = httpx.Limits(max_connections=max_concurrency,
                          max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = payload(req, model, chat, ignore_eos, temperature)
            if gate is None:
                result = await send_request(client, url, body, req.prompt_len)
            else:
                async with gate:  # waiting here is the client's queue, not the server's latency
                    result = await send_request(client, url, body, req.prompt_len)
            bar.update(1)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r, at)
                                         for r, at in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
    bar.close()
    config = {"request_rate": request_rate, "burstiness": burstiness,
              "max_concurrency": max_concurrency}
    return BenchRun(result_dict(list(results), duration, slo, percentile_metrics, percentiles,
                                config), list(results))


def result_dict(results: list[RequestResult], duration_s: float, slo: SLO | None,
                percentile_metrics: Sequence[str], percentiles: Sequence[float],
                config: dict) -> dict:
    """vLLM's result JSON (the same keys),
    computed by engine/companions/metrics.py from the successful requests."""
    ok = [r for r in results if r.success]
    timings = [r.timing() for r in ok]
    summary = summarize(timings, duration_s, slo)
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), **config, "duration": duration_s,
        "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "request_goodput": summary.goodput.per_s if summary.goodput else None,
        "output_throughput": n_out / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (n_in + n_out) / duration_s if duration_s > 0 else math.nan,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.timing().ttft_s if r.success else 0.0 for r in results],
        "itls": [r.timing().itl_s if r.success else [] for r in results],
        "generated_texts": [r.text for r in results], "errors": [r.error for r in results],
        "request_ids": [r.request_id for r in results],
        "percentile_metrics": list(percentile_metrics), "percentiles": list(percentiles),
    }
    values = {"ttft": [t.ttft_s for t in timings], "tpot": [t.tpot_s for t in timings],
              "itl": [gap for t in timings for gap in t.itl_s], "e2el": [t.e2e_s for t in timings]}
    for name, vs in values.items():
        ms = [v * 1000 for v in vs]
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = mean(ms), nearest_rank(ms, 50)
        out[f"std_{name}_ms"] = std(ms)
        for p in percentiles:
            out[f"p{_pct(p)}_{name}_ms"] = nearest_rank(ms, p)
    return out


def _pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def format_table(result: dict) -> str:
    """vLLM's printed result table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=TABLE_WIDTH, c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<{LABEL_WIDTH}} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name in result["percentile_metrics"]:
        title, label = METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=TABLE_WIDTH, c="-"))
        row(f"Mean {label} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {label} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in result["percentiles"]:
            row(f"P{_pct(p)} {label} (ms):", result[f"p{_pct(p)}_{name}_ms"], ".2f")
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


# ---- the command line ----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags
    (defaults sized for tinylab's 512-token context: vLLM's are 1024 / 128)."""
    p.add_argument("--backend", default="vllm", choices=["vllm", "openai", "openai-chat"])
    p.add_argument("--base-url", default=None,
                   help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="default: /v1/completions (/v1/chat/completions for openai-chat)")
    p.add_argument("--model", default="tinylab", help="the served model's name (GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="for random prompts' vocabulary (default: --model)")
    p.add_argument("--dataset-name", default="random", choices=["random", "custom"])
    p.add_argument("--dataset-path", default=None,
                   help="custom: JSONL of {prompt, output_len?, user?}")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, or inf (all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 Poisson, <1 bursty")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--custom-output-len", type=int, default=64,
                   help="custom: output_len of lines without one")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly the asked output lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None,
                   help="SLOs in ms, e.g. ttft:200 tpot:50 e2el:2000")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)


def _tokenizer(args):
    from engine.loading.loader import resolve_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_path(args.tokenizer or args.model))


def build_requests(args, chat: bool = False) -> list[BenchRequest]:
    """The requests --dataset-name asks for;
    for a chat endpoint, random token ids are decoded to text."""
    if args.dataset_name == "custom":
        if not args.dataset_path:
            raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
        return custom_requests(args.dataset_path, args.num_prompts, args.custom_output_len)
    tok = _tokenizer(args)
    special = [i for i in (tok.bos_token_id, tok.pad_token_id, *tok.eos_token_ids) if i is not None]
    special += list(tok.tk.get_added_tokens_decoder())
    requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, tok.vocab_size, args.seed, special)
    if chat:  # a chat turn is text
        requests = [BenchRequest(tok.decode(r.prompt), r.prompt_len, r.output_len, r.user)
                    for r in requests]
    return requests


def run_cli(args) -> BenchRun:
    """`python -m engine bench serve ...`: run, print vLLM's table, optionally save the JSON."""
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := [m for m in metrics if m not in METRIC_TITLES]:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; "
                         f"choose from {', '.join(METRIC_TITLES)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    slo = parse_goodput(args.goodput)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat"
                                 else "/v1/completions")
    requests = build_requests(args, chat="chat" in endpoint)
    poisson = " (Poisson process)" if args.burstiness == 1 else ""
    print(f"Traffic request rate: {args.request_rate}\n"
          f"Burstiness factor: {args.burstiness}{poisson}\n"
          f"Maximum request concurrency: {args.max_concurrency}")
    run = asyncio.run(benchmark(base_url, args.model, requests, args.request_rate, args.burstiness,
                                args.max_concurrency, args.seed, endpoint, args.ignore_eos,
                                args.temperature, slo, metrics, percentiles, args.disable_tqdm))
    run.result.update(backend=args.backend, model_id=args.model,
                      tokenizer_id=args.tokenizer or args.model, num_prompts=args.num_prompts)
    print(format_table(run.result))
    if run.result["failed"]:
        first = next(e for e in run.result["errors"] if e)
        print(f"{run.result['failed']} request(s) failed; the first one: {first}", file=sys.stderr)
    if args.save_result:
        name = args.result_filename or (f"{args.backend}-{args.request_rate}qps-"
                                        f"concurrency{args.max_concurrency}-"
                                        f"{args.model}-{run.result['date']}.json")
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run.result, indent=1))
        print(f"saved {path}")
    return run


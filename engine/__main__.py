"""Command line: `python -m engine generate|chat|eval|demo|kv-size|train-tinylab ...`
(see --help)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from engine.trace import SERVER_FULL_STEPS, TRACE_FILE_MAX_BYTES

# What a user's bad input raises (a wrong option, a broken model folder or file, an unknown name);
# anything else is a bug in servelab and keeps its traceback.
CLI_ERRORS = (ValueError, TypeError, KeyError, OSError)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPEEDS = ("reference", "fast")  # engine/config.py's SPEEDS (not imported: --help stays quick)
SPEED_HELP = ("reference: the readable path only (Python layers, reference attention); "
              "fast: the fast wing (engine/fast/), the default")


# the fast wing's measured answers (engine/fast/tuning.py), one per shape class
TUNED_PREFIXES = ("linear-", "prefill-")
SPECULATIVE_HELP = ("chapter 12: vLLM's speculative_config as JSON, e.g. "
                    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                    "(methods: ngram, draft_model, layer_skip)")


def speculative_config_arg(text: str) -> dict:
    """--speculative-config's JSON object (argparse shows the ValueError's message)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); give an object like "
                                         "'{\"method\": \"ngram\", "
                                         "\"num_speculative_tokens\": 4}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def print_speculation(engine) -> None:
    """After a run with speculative decoding: how many guesses were made and kept (stderr)."""
    if engine.proposer is None:
        return
    from engine.companions.metrics import spec_decode_stats

    s = spec_decode_stats(engine.trace)
    print(f"[speculative: {engine.proposer.name} k={engine.speculative.num_speculative_tokens}, "
          f"{s.num_drafts} verify steps, {s.num_accepted_tokens}/{s.num_draft_tokens} guesses kept "
          f"({s.acceptance_rate:.0%}), {s.mean_acceptance_length:.2f} tokens per verify step]",
          file=sys.stderr, flush=True)


def print_speed(engine) -> None:
    """One line per choice the engine's speed made, with its reason
    (stderr: the text stays clean)."""
    reasons = engine.acceleration.reasons
    for name, choice in engine.acceleration.choices.items():
        why = reasons.get(name)
        if why and name.startswith(TUNED_PREFIXES):  # the timings are long: doctor prints them
            why = f"{why.split(':', 1)[0]}; python -m engine doctor shows the timings"
        print(f"[{name}: {choice}{f' ({why})' if why else ''}]", file=sys.stderr, flush=True)


def cmd_generate(args) -> None:
    if (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1 or args.speed is not None
            or args.speculative_config is not None):
        return cmd_generate_engine(args)
    cmd_generate_loop(args)


def cmd_generate_loop(args) -> None:
    """generate without the paged engine: chapter 03's contiguous-cache loop,
    or chapter 01's naive one."""


    from engine.companions.kv_cache import generate_cached
    from engine.companions.naive import generate_naive
    from engine.loading.loader import load_model
    from engine.sampling import SamplingParams
    from engine.threads import check_num_threads, default_num_threads, torch_threads
    from engine.tokenizer import encode_prompt

    model, tok = load_model(args.model, dtype=DTYPES[args.dtype])
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    # errors before any output
    ids = encode_prompt(args.prompt, tok, model.config.max_position_embeddings)
    threads = (default_num_threads(model.config.num_params()) if args.threads is None
               else args.threads)
    check_num_threads(threads)
    run = generate_naive if args.no_cache else generate_cached
    print(args.prompt, end="", flush=True)
    with torch_threads(threads):
        result = run(model, tok, ids, params, on_text=lambda s: print(s, end="", flush=True))
    print(f"\n\n[finish_reason={result.finish_reason}  tokens={len(result.token_ids)}  "
          f"TTFT={result.ttft_s * 1e3:.1f} ms  TPOT={result.tpot_s * 1e3:.1f} ms  "
          f"{'naive loop' if args.no_cache else 'KV cache'}, {threads} torch thread(s)]")


def cmd_generate_engine(args) -> None:
    """generate through the paged engine at --speed, split over processes with
    --tensor/pipeline-parallel-size (chapter 08): the whole text at the end."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    if args.no_cache:
        raise ValueError("--no-cache runs chapter 01's loop, which has no --speed, parallel "
                         "split or --speculative-config; drop one")
    llm = LLM(args.model, dtype=args.dtype, speed=args.speed,
              tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size, num_threads=args.threads,
              speculative_config=args.speculative_config)
    print_speed(llm.engine)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
        t0 = time.perf_counter()
        out = llm.generate(args.prompt, params, use_tqdm=False)[0].outputs[0]
        seconds, stats = time.perf_counter() - t0, getattr(llm.engine.runner, "comm_stats", None)
        print(args.prompt + out.text)
        moved = "" if stats is None else "; rank 0 moved: " + ", ".join(
            f"{kind} {nbytes / 1e6:.2f} MB" for kind, nbytes in stats.bytes.items() if nbytes)
        print(f"\n[finish_reason={out.finish_reason}  tokens={len(out.token_ids)}  "
              f"{seconds:.2f} s  speed={llm.engine.config.speed}  "
              f"TP={args.tensor_parallel_size} PP={args.pipeline_parallel_size}, "
              f"{llm.engine.num_threads} torch thread(s) per rank{moved}]")
        print_speculation(llm.engine)
    finally:
        llm.engine.shutdown()


def cmd_eval(args) -> None:
    from engine.lab import tasks
    from engine.lab.eval import evaluate_model
    from engine.loading.loader import load_model

    if args.quant_head and args.quant in (None, "gguf"):
        raise ValueError("--quant-head quantizes the LM head beside --quant's linears: give "
                         "--quant a scheme (a GGUF file's head keeps its own blocks)")
    if args.quant_head_bits != 8 and not args.quant_head:
        raise ValueError(f"--quant-head-bits {args.quant_head_bits} needs --quant-head")
    model, tok = load_model(args.model, dtype=DTYPES[args.dtype],
                            quantization="gguf" if args.quant == "gguf" else None)
    bytes_line = _quantize_for_eval(model, tok, args)
    names = tuple(args.tasks.split(",")) if args.tasks else tasks.TASKS
    start = time.perf_counter()
    rows = evaluate_model(model, tok, names, n=args.n, window=args.window,
                          kv_cache_dtype=args.kv_cache_dtype, speed=args.speed)
    print(tasks.format_table(rows))
    print(f"\n{args.model}: {args.n} examples per task in {time.perf_counter() - start:.0f} s")
    print(bytes_line)


# GPTQ calibrates on the training side of the task corpus (never the eval documents): 4 x 128 tokens
EVAL_CALIBRATION = {"documents": 150, "batch_size": 4, "seq_len": 128, "batches": 2}


def _quantize_for_eval(model, tok, args) -> str:
    """Quantize ``model`` in place as ``--quant`` asks; returns a line with its weight bytes."""
    import warnings

    from engine.lab.tasks import training_corpus
    from engine.loading.quantization import (
        calibration_batches,
        get_scheme,
        quantize_lm_head,
        quantize_model,
        set_backend,
        weight_bytes_breakdown,
    )

    before = sum(weight_bytes_breakdown(model).values())
    if args.quant == "gguf":
        set_backend(model, args.quant_backend)
    elif args.quant is not None:
        calibration = None
        if get_scheme(args.quant).method == "gptq":
            c = EVAL_CALIBRATION
            ids = [i for text in training_corpus(n_examples=c["documents"])
                   for i in tok.encode(text)]
            calibration = calibration_batches(ids, c["batch_size"], c["seq_len"])[: c["batches"]]
        # e.g. smaller groups where G does not divide K: said once, below
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            quantize_model(model, args.quant, calibration=calibration, backend=args.quant_backend)
    if args.quant_head:  # cmd_eval refused it without a scheme or beside "gguf" (its own head)
        quantize_lm_head(model, backend=args.quant_backend, bits=args.quant_head_bits)
    parts = weight_bytes_breakdown(model)
    detail = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in parts.items() if v)
    scheme = args.quant or f"none ({args.dtype})"
    return (f"weights: {sum(parts.values()) / 2**20:.2f} MiB with --quant {scheme} "
            f"(MiB: {detail}); {before / 2**20:.2f} MiB as loaded")


def cmd_demo(args) -> None:
    from engine.lab.demo import run_demo

    run_demo(args)


def cmd_kv_size(args) -> None:
    from engine.companions.memory import dtype_bytes, kv_cache_bytes
    from engine.config import MODEL_PRESETS

    if args.preset not in MODEL_PRESETS:
        sys.exit(f"unknown --preset {args.preset!r}; choose one of {', '.join(MODEL_PRESETS)}")
    c = MODEL_PRESETS[args.preset]
    L, Hkv, D = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    n = kv_cache_bytes(L, args.batch, args.tokens, Hkv, D, dtype_bytes(args.dtype))
    print(f"{args.preset}: 2 x L={L} x B={args.batch} x T={args.tokens} x Hkv={Hkv} "
          f"x D={D} x b={dtype_bytes(args.dtype)} = {n:,} bytes = {n / 1e9:.2f} GB")


def cmd_train(args) -> None:
    from pathlib import Path

    from engine.lab.training import RECIPES, TrainConfig, train

    flags = {"total_tokens": args.tokens, "recall_drills": args.recall_drills, "lr": args.lr,
             "tokenizer_path": args.tokenizer, "probe_every": args.probe_every,
             "max_minutes": args.max_minutes, "stop_step": args.stop_step}
    cfg = TrainConfig(**{**RECIPES[args.recipe],
                         **{k: v for k, v in flags.items() if v is not None}})
    resume = Path(args.resume_from) if args.resume_from else None
    log = train(cfg, Path(args.out), resume_from=resume, start_step=args.start_step)
    print(f"trained in {log['train_seconds']:.0f} s; final loss {log['loss'][-1]:.3f}; "
          f"saved to {args.out}")


def stream_reply(engine, messages: list[dict], params, write) -> dict:
    """Answer the conversation `messages` on `engine`, calling `write(delta)` with the text of each
    step as it is generated; returns {"text", "tokens", "ttft_s", "tok_per_s", "finish_reason"}."""
    tok = engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    req = engine.get_request(engine.add_request(prompt_ids, params))
    shown = 0
    while not req.is_finished:
        engine.step()
        if len(req.text) > shown:
            write(req.text[shown:])
            shown = len(req.text)
    engine.pop_request(req.request_id)
    n, decode_s = len(req.output_token_ids), req.finish_time - req.first_token_time
    return {"text": req.text, "tokens": n, "ttft_s": req.first_token_time - req.arrival_time,
            "tok_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan"),
            "finish_reason": req.finish_reason}


def cmd_chat(args) -> None:
    """An interactive chat, one line of stdin per user turn
    (so a test can drive it through a pipe)."""
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine.from_pretrained(args.model, args.dtype, speed=args.speed, max_num_seqs=1)
    print_speed(engine)
    if engine.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer.json; chat needs text in and out")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print(f"chatting with {args.model}; /reset starts over, /quit (or Ctrl-D) ends", flush=True)
    while True:
        print("\n> ", end="", flush=True)
        line = sys.stdin.readline()
        text = line.strip()
        if not line or text == "/quit":
            break
        if text == "/reset":
            history = list(start)
            print("[conversation cleared]", flush=True)
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        try:
            r = stream_reply(engine, history, params, lambda s: print(s, end="", flush=True))
        except ValueError as err:
            # e.g. the conversation outgrew the context: say so, keep the session
            history.pop()
            print(f"[error: {err}; /reset starts over]", flush=True)
            continue
        history.append({"role": "assistant", "content": r["text"]})
        print(f"\n[TTFT {r['ttft_s'] * 1e3:.0f} ms | {r['tokens']} tokens | "
              f"{r['tok_per_s']:.1f} tok/s | {r['finish_reason']}]", flush=True)


def cmd_serve(args) -> None:
    from engine.llm_engine import LLMEngine
    from engine.serving.admission import api_keys_from_args, limits_from_args
    from engine.serving.dashboard import attach_dashboard
    from engine.serving.lifecycle import pin_malloc_thresholds, serve
    from engine.serving.server import build_app
    from engine.trace import TraceRetention

    options = {"max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens,
               "enable_chunked_prefill": args.enable_chunked_prefill, "block_size": args.block_size,
               "enable_prefix_caching": args.enable_prefix_caching,
               "default_tenant_max_running": args.tenant_max_running,
               "speculative_config": args.speculative_config}
    # bad flags: before loading
    limits, keys = limits_from_args(args), api_keys_from_args(args.api_key)
    trace = TraceRetention.server(args.trace_steps, args.trace_file,
                                  file_max_bytes=int(args.trace_file_max_mb * 2**20))
    allocator = pin_malloc_thresholds() if args.pin_malloc else "allocator: as the process started"
    engine = LLMEngine.from_pretrained(args.model, args.dtype, speed=args.speed,
                                       **{k: v for k, v in options.items() if v is not None})
    print_speed(engine)
    print(f"[{allocator}]", file=sys.stderr, flush=True)
    app = build_app(engine, args.served_model_name or args.model, limits=limits, api_keys=keys,
                    trace=trace)
    if not args.no_dashboard:
        attach_dashboard(app)  # the classroom page: http://HOST:PORT/dashboard
    serve(app, args.host, args.port, shutdown_timeout_s=args.shutdown_timeout)


def cmd_dashboard(args) -> None:
    from engine.serving.dashboard import replay_app
    from engine.serving.lifecycle import serve
    from engine.trace import Trace

    app, player = replay_app(Trace.load(args.replay), speed=args.speed)
    player.start()
    print(f"replaying {args.replay} at {args.speed:g}x: "
          f"open http://{args.host}:{args.port}/dashboard", flush=True)
    serve(app, args.host, args.port)


def cmd_diagnose(args) -> None:
    from engine.serving.diagnose import main as diagnose_main

    diagnose_main(args.trace)


def cmd_doctor(args) -> None:
    """What the fast wing chose on this machine for a model, and the measured reasons
    (engine/fast/tuning.py); --retune measures again instead of reading the cache."""
    from engine.llm import LLM
    from engine.speed import remeasure_on_build, tuning_machine

    if args.retune:
        remeasure_on_build()
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, speed="fast", num_threads=args.threads)
    facts = tuning_machine(llm.engine.num_threads)
    print(f"machine: {facts['cpu']}; flags {' '.join(facts['flags']) or 'none of interest'}; "
          f"torch {facts['torch']}; {facts['threads']} torch thread(s) for {args.model} "
          f"({args.dtype})")
    print(f"built in {time.perf_counter() - t0:.1f} s (measuring included, where it measured)\n")
    reasons = llm.engine.acceleration.reasons
    for name, choice in llm.engine.acceleration.choices.items():
        print(f"{name}: {choice}")
        if name in reasons:
            print(f"    why: {reasons[name]}")


def cmd_bench_serve(args) -> None:
    from engine.serving.bench_serve import run_cli

    run_cli(args)


def _add_serve_parsers(sub) -> None:
    """`serve` and `bench serve` (chapter 09), with vLLM's flag names."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (streaming, /metrics)")
    s.add_argument("--model", default="tinylab")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients use (default: --model)")
    s.add_argument("--host", default="127.0.0.1",
                   help="0.0.0.0 lets other machines (a classroom) in")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dtype", default="float32", choices=DTYPES)
    s.add_argument("--speed", default=None, choices=SPEEDS, help=SPEED_HELP)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument("--enable-chunked-prefill", action="store_true", default=None)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="share the KV blocks of common prompt prefixes (chapter 06); "
                                      "on by default, --no-enable-prefix-caching turns it off")
    s.add_argument("--block-size", type=int, default=None)
    s.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   help=SPECULATIVE_HELP)
    s.add_argument("--shutdown-timeout", type=float, default=None,
                   help="seconds SIGTERM lets the requests in flight finish before they are "
                        "aborted (default 30: engine/serving/lifecycle.py); a second signal "
                        "exits at once")
    s.add_argument("--trace-steps", type=int, default=SERVER_FULL_STEPS,
                   help="full step reports kept in memory, the newest (default "
                        f"{SERVER_FULL_STEPS}); memory stays bounded however long it runs")
    s.add_argument("--trace-file", default=None,
                   help="also stream every step report to this file as JSON lines, rotated "
                        "(python -m engine diagnose FILE reads it)")
    s.add_argument("--pin-malloc", action=argparse.BooleanOptionalAction, default=True,
                   help="pin glibc's mmap/trim thresholds so the heap stays flat over a long run "
                        "(engine/serving/lifecycle.py; --no-pin-malloc to compare)")
    s.add_argument("--trace-file-max-mb", type=float, default=TRACE_FILE_MAX_BYTES / 2**20,
                   help="rotate the trace file at this size (3 old files kept)")
    s.add_argument("--no-dashboard", action="store_true",
                   help="do not serve the classroom page /dashboard")
    s.add_argument("--tenant-max-running", type=int, default=None,
                   help="the scheduler's per-tenant quota of running requests (chapter 05)")
    from engine.serving.admission import add_arguments as add_admission_arguments

    add_admission_arguments(s)
    s.set_defaults(func=cmd_serve)
    from engine.serving.bench_serve import add_arguments

    b = sub.add_parser("bench", help="benchmarks: `bench serve` loads a running server like vLLM's")
    bench = b.add_subparsers(dest="bench_command", required=True)
    bs = bench.add_parser("serve",
                          help="send a workload to a server and report TTFT/TPOT/ITL/E2E/goodput")
    add_arguments(bs)
    bs.set_defaults(func=cmd_bench_serve)


def _quant_schemes() -> list[str]:
    from engine.loading.quantization import SCHEMES

    return list(SCHEMES)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine",
                                description="servelab: a step-through LLM engine")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion to the terminal")
    g.add_argument("prompt")
    g.add_argument("--model", default="tinylab")
    g.add_argument("--dtype", default="float32", choices=DTYPES)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-cache", action="store_true", help="use chapter 01's naive loop")
    g.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   help=SPECULATIVE_HELP)
    g.add_argument("--speed", default=None, choices=SPEEDS,
                   help="run the paged engine at this speed (" + SPEED_HELP + "); without it, "
                   "chapter 03's contiguous-cache loop")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: 1 for small models, see engine/threads.py)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split every layer over this many processes (chapter 08; or start it "
                        "under torchrun)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the layers into this many stages, one process each (chapter 08)")
    g.set_defaults(func=cmd_generate)
    e = sub.add_parser("eval", help="evaluate a model on the task suite")
    e.add_argument("--model", default="tinylab")
    e.add_argument("--dtype", default="float32", choices=DTYPES)
    e.add_argument("--tasks", default=None,
                   help="comma-separated subset of arith,recall,json,refuse,story")
    e.add_argument("--speed", default=None, choices=SPEEDS,
                   help="answer through the paged engine at this speed (default: chapter 03's "
                   "loop)")
    e.add_argument("--n", type=int, default=100)
    e.add_argument("--window", type=int, default=None,
                   help="sliding-window KV cache of this many tokens")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="int8: generate through the paged engine with int8 K/V (chapter 07)")
    e.add_argument("--quant", default=None, choices=[*_quant_schemes(), "gguf"],
                   help="quantize the decoder linears first (chapter 07); "
                        "gguf: keep a GGUF model's own blocks")
    e.add_argument("--quant-backend", default="torch",
                   choices=["torch", "packed", "native", "triton", "cuda"],
                   help="the quantized matmul kernel (packed: torch's int8/int4 CPU ops, bf16 "
                        "inside; native: our C kernel, x rounded to int8 per 32 inputs)")
    e.add_argument("--quant-head", action="store_true",
                   help="with --quant: the LM head quantized too "
                        "(groups of 32; the embedding stays float)")
    e.add_argument("--quant-head-bits", type=int, default=8, choices=[8, 4],
                   help="with --quant-head: int8 (default) or int4 head")
    e.set_defaults(func=cmd_eval)
    d = sub.add_parser("demo", help="the classroom demo on the bundled model")
    d.add_argument("--model", default="tinylab")
    d.add_argument("--steps", type=int, default=None)
    d.add_argument("--no-pause", action="store_true")
    d.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   help=SPECULATIVE_HELP + "; the step-through part shows its verify steps")
    d.add_argument("--speed", default=None, choices=SPEEDS,
                   help=SPEED_HELP + " (the engine parts of the demo)")
    d.set_defaults(func=cmd_demo)
    k = sub.add_parser("kv-size", help="the KV-cache memory formula for a model preset")
    k.add_argument("--preset", default="Llama-3-8B")
    k.add_argument("--batch", type=int, default=1)
    k.add_argument("--tokens", type=int, default=8192)
    k.add_argument("--dtype", default="fp16")
    k.set_defaults(func=cmd_kv_size)
    t = sub.add_parser("train-tinylab",
                       help="retrain the bundled model from scratch (about an hour)")
    t.add_argument("--out", default="runs/tinylab")
    t.add_argument("--recipe", default="first",
                   choices=["first", "lookup", "polish", "extend", "finish", "scratch", "draft"],
                   help="first: the first tinylab's recipe; lookup: the lookup curriculum; "
                        "polish: a short pass after lookup; extend: lookup continued from its "
                        "step 2000; finish: extend continued from its step 3500; scratch: all "
                        "of it in one recipe from random weights; draft: tinylab-draft, a small "
                        "draft model distilled from tinylab (engine/lab/training.py)")
    t.add_argument("--tokens", type=int, default=None,
                   help="training tokens (default: the recipe's)")
    t.add_argument("--recall-drills", type=int, default=None,
                   help="extra lookups per recall document")
    t.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: the recipe's)")
    t.add_argument("--tokenizer", default=None,
                   help="reuse this tokenizer.json instead of training one")
    t.add_argument("--probe-every", type=int, default=None,
                   help="probe recall/arith/json every N steps")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="stop and save after about this many minutes")
    t.add_argument("--stop-step", type=int, default=None,
                   help="stop and save once this many steps are done")
    t.add_argument("--resume-from", default=None, help="continue from a folder this command saved")
    t.add_argument("--start-step", type=int, default=0, help="the step that folder was saved at")
    t.set_defaults(func=cmd_train)
    c = sub.add_parser("chat",
                       help="chat in the terminal with a model (streams tokens; /reset, /quit)")
    c.add_argument("--model", default="smollm2-135m-instruct")
    c.add_argument("--system", default=None, help="a system message that starts every conversation")
    c.add_argument("--dtype", default="float32", choices=DTYPES)
    c.add_argument("--speed", default=None, choices=SPEEDS, help=SPEED_HELP)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--seed", type=int, default=None)
    c.set_defaults(func=cmd_chat)
    _add_serve_parsers(sub)
    db = sub.add_parser("dashboard",
                        help="the classroom dashboard replaying a saved Trace (chapter 10)")
    db.add_argument("--replay", required=True, help="a Trace saved as JSON (Trace.save)")
    db.add_argument("--speed", type=float, default=1.0,
                    help="playback speed: 1 = real time, 10 = ten times faster")
    db.add_argument("--host", default="127.0.0.1")
    db.add_argument("--port", type=int, default=8000)
    db.set_defaults(func=cmd_dashboard)
    dg = sub.add_parser("diagnose",
                        help="walk the troubleshooting order on a saved Trace (chapter 10)")
    dg.add_argument("trace",
                    help="a Trace saved as JSON (Trace.save; python -m engine.lab.incidents)")
    dg.set_defaults(func=cmd_diagnose)
    dr = sub.add_parser("doctor", help="the fast paths chosen on this machine, and the measured "
                                       "reasons (cached per CPU, flags, dtype, shape class)")
    dr.add_argument("--model", default="tinylab")
    dr.add_argument("--dtype", default="float32", choices=DTYPES)
    dr.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 for small models, else every core)")
    dr.add_argument("--retune", action="store_true",
                    help="measure again and overwrite this machine's cached answers")
    dr.set_defaults(func=cmd_doctor)
    args = p.parse_args(argv)
    try:
        args.func(args)
    except CLI_ERRORS as err:  # bad input of any kind: one clear line, never a traceback
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        sys.exit(f"error: {message}")


if __name__ == "__main__":
    main()

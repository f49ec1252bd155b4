"""Command line: `python -m engine generate|eval|demo|kv-size|train-tinylab ...` (see --help)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cmd_generate(args) -> None:
    from engine.kv_cache import generate_cached
    from engine.loader import load_model
    from engine.naive import generate_naive
    from engine.sampling import SamplingParams

    model, tok = load_model(args.model, dtype=DTYPES[args.dtype])
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    run = generate_naive if args.no_cache else generate_cached
    print(args.prompt, end="", flush=True)
    result = run(model, tok, args.prompt, params, on_text=lambda s: print(s, end="", flush=True))
    print(f"\n\n[finish_reason={result.finish_reason}  tokens={len(result.token_ids)}  "
          f"TTFT={result.ttft_s * 1e3:.1f} ms  TPOT={result.tpot_s * 1e3:.1f} ms  "
          f"{'naive loop' if args.no_cache else 'KV cache'}]")


def cmd_eval(args) -> None:
    from engine.lab import tasks
    from engine.lab.eval import evaluate_model
    from engine.loader import load_model

    model, tok = load_model(args.model, dtype=DTYPES[args.dtype])
    names = tuple(args.tasks.split(",")) if args.tasks else tasks.TASKS
    start = time.perf_counter()
    rows = evaluate_model(model, tok, names, n=args.n, window=args.window)
    print(tasks.format_table(rows))
    print(f"\n{args.model}: {args.n} examples per task in {time.perf_counter() - start:.0f} s")


def cmd_demo(args) -> None:
    from engine.lab.demo import run_demo

    run_demo(args)


def cmd_kv_size(args) -> None:
    from engine.memory import PRESETS, dtype_bytes, kv_cache_bytes

    if args.preset not in PRESETS:
        sys.exit(f"unknown --preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    s = PRESETS[args.preset]
    n = kv_cache_bytes(s.layers, args.batch, args.tokens, s.kv_heads, s.head_dim, dtype_bytes(args.dtype))
    print(f"{args.preset}: 2 x L={s.layers} x B={args.batch} x T={args.tokens} x Hkv={s.kv_heads} "
          f"x D={s.head_dim} x b={dtype_bytes(args.dtype)} = {n:,} bytes = {n / 1e9:.2f} GB")


def cmd_train(args) -> None:
    from pathlib import Path

    from engine.lab.training import TrainConfig, train

    cfg = TrainConfig(total_tokens=args.tokens, recall_drills=args.recall_drills)
    resume = Path(args.resume_from) if args.resume_from else None
    log = train(cfg, Path(args.out), resume_from=resume, start_step=args.start_step)
    print(f"trained in {log['train_seconds']:.0f} s; final loss {log['loss'][-1]:.3f}; saved to {args.out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine", description="servelab: a step-through LLM engine")
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
    g.set_defaults(func=cmd_generate)
    e = sub.add_parser("eval", help="evaluate a model on the task suite")
    e.add_argument("--model", default="tinylab")
    e.add_argument("--dtype", default="float32", choices=DTYPES)
    e.add_argument("--tasks", default=None, help="comma-separated subset of arith,recall,json,refuse,story")
    e.add_argument("--n", type=int, default=100)
    e.add_argument("--window", type=int, default=None, help="sliding-window KV cache of this many tokens")
    e.set_defaults(func=cmd_eval)
    d = sub.add_parser("demo", help="the classroom demo on the bundled model")
    d.add_argument("--model", default="tinylab")
    d.add_argument("--steps", type=int, default=None)
    d.add_argument("--no-pause", action="store_true")
    d.set_defaults(func=cmd_demo)
    k = sub.add_parser("kv-size", help="the KV-cache memory formula for a model preset")
    k.add_argument("--preset", default="Llama-3-8B")
    k.add_argument("--batch", type=int, default=1)
    k.add_argument("--tokens", type=int, default=8192)
    k.add_argument("--dtype", default="fp16")
    k.set_defaults(func=cmd_kv_size)
    t = sub.add_parser("train-tinylab", help="retrain the bundled model from scratch (about an hour)")
    t.add_argument("--out", default="runs/tinylab")
    t.add_argument("--tokens", type=int, default=9_000_000)
    t.add_argument("--recall-drills", type=int, default=6, help="extra lookups per recall document")
    t.add_argument("--resume-from", default=None, help="continue from a folder this command saved")
    t.add_argument("--start-step", type=int, default=0, help="the step that folder was saved at")
    t.set_defaults(func=cmd_train)
    args = p.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()

"""The kernels on a GPU, each checked against its PyTorch reference, then timed.

Paged decode attention (torch reference, Triton, CUDA; full context, a sliding window, int8 K/V; split-K
against the one-pass kernels, at B=32 x 2048 tokens and at B=4 x 8192, where split-K matters most) and
the fused dequant-GEMV (int8, int4-g128) against a bf16 matmul.

Needs a CUDA GPU (it refuses to run without one). Every kernel's output is checked against the PyTorch
reference before it is timed; times are triton.testing.do_bench medians (warm-up, L2 flushed between
runs), and each row gives the bytes the kernel must move and the bandwidth that implies (split-K rows
include its fp32 scratch: kernels/paged_attention/split_k.py scratch_traffic_bytes).

    python benchmarks/gpu_kernels.py [--out DIR]        # results/gpu_kernels.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A Llama-3-8B layer's attention at decode: B sequences of L cached tokens, H = 32, Hkv = 8, D = 128, bf16.
BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 2048, 32, 8, 128, 16
WINDOW = 512  # a sliding window a quarter of the context: it should read a quarter of the bytes
# split-K's cases (B, context): the one above, and few long sequences, where one program per
# (sequence, head) leaves most SMs idle; each is timed at these partition counts and the chooser's
SPLIT_CASES = ((BATCH, CONTEXT), (4, 8192))
SPLIT_PARTITIONS = (1, 2, 4, 8, 16, 32)
GEMV_N = GEMV_K = 4096  # a 7B-class projection at batch 1
GROUP = 128


def paged_inputs(dtype, device, batch, context, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                 block=BLOCK, seed=0):
    """Random K/V for `batch` sequences of `context` tokens in shuffled blocks of one pool (the last block of
    each sequence partly filled where `context` is not a multiple of `block`), and one query per sequence."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = math.ceil(context / block)
    num_blocks = batch * blocks_per_seq
    k_pool = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(device, dtype)
    v_pool = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=g).reshape(batch, blocks_per_seq).to(device, torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(device, dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, seq_lens=lens, scale=head_dim ** -0.5)


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))  # ms


def chosen_partitions(backend: str, inputs: dict, window=None):
    """The P that `backend` picks by itself for these inputs (None for torch, which does not split): the
    Triton kernel has Hkv programs per sequence before splitting, the CUDA one H thread blocks."""
    from kernels.paged_attention.split_k import partition_plan

    if backend not in ("triton", "cuda"):
        return None
    batch, heads, _ = inputs["q"].shape
    parallel = KV_HEADS if backend == "triton" else heads
    return partition_plan(None, batch, parallel, inputs["block_tables"].shape[1], BLOCK, window,
                          inputs["q"].device)[0]


def attention_rows(device) -> list[dict]:
    from kernels.paged_attention import paged_decode_attention
    from kernels.paged_attention.reference import quantize_kv_int8
    from kernels.paged_attention.triton import decode_traffic_bytes

    inputs = paged_inputs(torch.bfloat16, device, BATCH, CONTEXT)
    ref = paged_decode_attention(**inputs, backend="torch").float()
    rows = []
    for window in (None, WINDOW):
        tokens = min(CONTEXT, window or CONTEXT)
        fused = decode_traffic_bytes(BATCH, tokens, HEADS, KV_HEADS, HEAD_DIM, 2)["fused"]
        expected = paged_decode_attention(**inputs, backend="torch", sliding_window=window).float()
        for backend in ("torch", "triton", "cuda"):
            out = paged_decode_attention(**inputs, backend=backend, sliding_window=window)
            err = (out.float() - expected).abs().max().item()
            ms = bench(lambda b=backend, w=window: paged_decode_attention(**inputs, backend=b, sliding_window=w))
            rows.append(dict(op="paged decode attention", kv="bf16", window=window, backend=backend,
                             num_partitions=chosen_partitions(backend, inputs, window), ms=ms,
                             bytes=fused, gb_s=fused / ms / 1e6, max_abs_err=err))
    # int8 K/V: the same cache quantized per token and head; Triton dequantizes in registers
    k8, ks = quantize_kv_int8(inputs["k_pool"].reshape(-1, KV_HEADS, HEAD_DIM))
    v8, vs = quantize_kv_int8(inputs["v_pool"].reshape(-1, KV_HEADS, HEAD_DIM))
    shape = inputs["k_pool"].shape
    int8_inputs = dict(inputs, k_pool=k8.reshape(shape), v_pool=v8.reshape(shape))
    scales = (ks.reshape(shape[:3]), vs.reshape(shape[:3]))
    int8_bytes = BATCH * CONTEXT * KV_HEADS * 2 * (HEAD_DIM + 4) + 2 * BATCH * HEADS * HEAD_DIM * 2
    for backend in ("torch", "triton"):
        out = paged_decode_attention(**int8_inputs, backend=backend, scales=scales)
        err = (out.float() - ref).abs().max().item()  # against the bf16 cache: the quantization error
        ms = bench(lambda b=backend: paged_decode_attention(**int8_inputs, backend=b, scales=scales))
        rows.append(dict(op="paged decode attention", kv="int8", window=None, backend=backend,
                         num_partitions=chosen_partitions(backend, int8_inputs), ms=ms,
                         bytes=int8_bytes, gb_s=int8_bytes / ms / 1e6, max_abs_err=err))
    return rows


def split_k_rows(device) -> list[dict]:
    """Split-K against the one-pass kernels (P = 1), bf16, no window: each case at SPLIT_PARTITIONS and
    at the chooser's P, the bytes including the partitions' fp32 scratch."""
    from kernels.paged_attention.cuda import paged_decode_attention_cuda
    from kernels.paged_attention.reference import paged_decode_attention_ref
    from kernels.paged_attention.split_k import scratch_traffic_bytes
    from kernels.paged_attention.triton import decode_traffic_bytes, paged_decode_attention_triton

    launchers = {"triton": paged_decode_attention_triton, "cuda": paged_decode_attention_cuda}
    rows = []
    for batch, context in SPLIT_CASES:
        inputs = paged_inputs(torch.bfloat16, device, batch, context)
        expected = paged_decode_attention_ref(**inputs).float()
        fused = decode_traffic_bytes(batch, context, HEADS, KV_HEADS, HEAD_DIM, 2)["fused"]
        for backend, run in launchers.items():
            chosen = chosen_partitions(backend, inputs)
            for parts in sorted({p for p in SPLIT_PARTITIONS if p <= context // BLOCK} | {chosen}):
                out = run(**inputs, num_partitions=parts)
                err = (out.float() - expected).abs().max().item()
                ms = bench(lambda r=run, i=inputs, p=parts: r(**i, num_partitions=p))
                moved = fused + scratch_traffic_bytes(batch, HEADS, HEAD_DIM, parts)
                rows.append(dict(op="paged decode attention, split-K", batch=batch, context=context,
                                 backend=backend, num_partitions=parts, chosen=parts == chosen, ms=ms,
                                 bytes=moved, gb_s=moved / ms / 1e6, max_abs_err=err))
    return rows


def gemv_rows(device) -> list[dict]:
    from kernels.quant_matmul import quant_matmul, quantize
    from kernels.quant_matmul.reference import quant_matmul_ref

    g = torch.Generator(device="cpu").manual_seed(1)
    w = (torch.randn(GEMV_N, GEMV_K, generator=g) * 0.02).to(device)
    x = torch.randn(1, GEMV_K, generator=g).to(device, torch.bfloat16)
    w16 = w.to(torch.bfloat16)
    rows = [dict(op="GEMV 4096x4096", scheme="bf16", backend="torch", ms=bench(lambda: x @ w16.T),
                 bytes=w16.nbytes, max_abs_err=0.0)]
    for scheme, bits, group in (("int8", 8, None), ("int4-g128", 4, GROUP)):
        qw = quantize(w, bits, group)
        weight_bytes = qw.qweight.nbytes + qw.scales.nbytes + (qw.zeros.nbytes if qw.zeros is not None else 0)
        expected = quant_matmul_ref(x.float(), qw)
        for backend in ("torch", "triton", "cuda"):
            y = quant_matmul(x, qw, backend=backend)
            err = (y.float() - expected).abs().max().item()
            ms = bench(lambda b=backend, q=qw: quant_matmul(x, q, backend=b))
            rows.append(dict(op="GEMV 4096x4096", scheme=scheme, backend=backend, ms=ms, bytes=weight_bytes,
                             max_abs_err=err))
    for r in rows:
        r["gb_s"] = r["bytes"] / r["ms"] / 1e6
    return rows


def markdown(meta: dict, attention: list[dict], split: list[dict], gemv: list[dict]) -> str:
    lines = [f"# Kernels on {meta['gpu']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; times are do_bench medians; "
             "every output was checked against the PyTorch reference first (max |error| column).", "",
             f"## Paged decode attention: B={BATCH}, context {CONTEXT}, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, "
             f"BS={BLOCK}", "", "P: the split-K partitions the kernel chose by itself (1: the one-pass kernel).", "",
             "| K/V | window | backend | P | ms | bytes moved (MB) | GB/s | max abs err |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in attention:
        lines.append(f"| {r['kv']} | {r['window'] or 'none'} | {r['backend']} | {r['num_partitions'] or '-'} | "
                     f"{r['ms']:.4f} | {r['bytes'] / 1e6:.1f} | {r['gb_s']:.0f} | {r['max_abs_err']:.2e} |")
    lines += ["", f"## Split-K against one pass: bf16, no window, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, "
              f"BS={BLOCK}", "", "P = 1 is the one-pass kernel; \"chosen\" marks split_k.choose_num_partitions' "
              "P; bytes include the partitions' fp32 scratch.", "",
              "| B | context | backend | P | chosen | ms | bytes moved (MB) | GB/s | max abs err |",
              "| ---: | ---: | --- | ---: | :-: | ---: | ---: | ---: | ---: |"]
    for r in split:
        lines.append(f"| {r['batch']} | {r['context']} | {r['backend']} | {r['num_partitions']} | "
                     f"{'yes' if r['chosen'] else ''} | {r['ms']:.4f} | {r['bytes'] / 1e6:.1f} | {r['gb_s']:.0f} | "
                     f"{r['max_abs_err']:.2e} |")
    lines += ["", f"## GEMV {GEMV_N}x{GEMV_K}, batch 1, bf16 activations", "",
              "| weights | backend | ms | weight bytes (MB) | GB/s | max abs err |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in gemv:
        lines.append(f"| {r['scheme']} | {r['backend']} | {r['ms']:.4f} | {r['bytes'] / 1e6:.1f} | {r['gb_s']:.0f} | "
                     f"{r['max_abs_err']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py needs a CUDA GPU; on a CPU see benchmarks/quantization.py")
    import triton

    device = torch.device("cuda")
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, host=platform.node())
    attention = attention_rows(device)
    split = split_k_rows(device)
    gemv = gemv_rows(device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps(dict(meta=meta, attention=attention, split_k=split,
                                                               gemv=gemv), indent=1))
    text = markdown(meta, attention, split, gemv)
    (args.out / "gpu_kernels.md").write_text(text)
    print(text)
    assert all(math.isfinite(r["ms"]) for r in attention + split + gemv)


if __name__ == "__main__":
    main()

"""The kernels on a GPU: paged decode attention (torch reference, Triton, CUDA; full context, a sliding
window, int8 K/V) and the fused dequant-GEMV (int8, int4-g128) against a bf16 matmul.

Needs a CUDA GPU (it refuses to run without one). Every kernel's output is checked against the PyTorch
reference before it is timed; times are triton.testing.do_bench medians (warm-up, L2 flushed between
runs), and each row gives the bytes the kernel must move and the bandwidth that implies.

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
GEMV_N = GEMV_K = 4096  # a 7B-class projection at batch 1
GROUP = 128


def paged_inputs(dtype, device):
    """Random K/V for BATCH sequences of CONTEXT tokens in shuffled blocks of one pool."""
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = CONTEXT // BLOCK
    num_blocks = BATCH * blocks_per_seq
    k_pool = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    v_pool = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=g).reshape(BATCH, blocks_per_seq).to(device, torch.int32)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=g).to(device, dtype)
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device=device)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, seq_lens=lens, scale=HEAD_DIM ** -0.5)


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))  # ms


def attention_rows(device) -> list[dict]:
    from kernels.paged_attention import paged_decode_attention
    from kernels.paged_attention.reference import quantize_kv_int8
    from kernels.paged_attention.triton import decode_traffic_bytes

    inputs = paged_inputs(torch.bfloat16, device)
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
            rows.append(dict(op="paged decode attention", kv="bf16", window=window, backend=backend, ms=ms,
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
        rows.append(dict(op="paged decode attention", kv="int8", window=None, backend=backend, ms=ms,
                         bytes=int8_bytes, gb_s=int8_bytes / ms / 1e6, max_abs_err=err))
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


def markdown(meta: dict, attention: list[dict], gemv: list[dict]) -> str:
    lines = [f"# Kernels on {meta['gpu']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; times are do_bench medians; "
             "every output was checked against the PyTorch reference first (max |error| column).", "",
             f"## Paged decode attention: B={BATCH}, context {CONTEXT}, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, "
             f"BS={BLOCK}", "", "| K/V | window | backend | ms | bytes moved (MB) | GB/s | max abs err |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in attention:
        lines.append(f"| {r['kv']} | {r['window'] or 'none'} | {r['backend']} | {r['ms']:.4f} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['gb_s']:.0f} | {r['max_abs_err']:.2e} |")
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
    gemv = gemv_rows(device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps(dict(meta=meta, attention=attention, gemv=gemv), indent=1))
    text = markdown(meta, attention, gemv)
    (args.out / "gpu_kernels.md").write_text(text)
    print(text)
    assert all(math.isfinite(r["ms"]) for r in attention + gemv)


if __name__ == "__main__":
    main()

"""The roofline: why prefill is compute-bound and decode is bandwidth-bound.

Chapter 02 ("Prefill 和 Decode 为什么表现不同" in the text). A forward pass does some number
of floating-point operations (FLOPs) and moves some number of bytes between memory and the chip.
A machine can do at most `peak_flops` per second and move at most `bandwidth` bytes per second,
so a forward takes at least

    time >= max(flops / peak_flops, bytes / bandwidth)

Which term wins depends on the arithmetic intensity, flops / bytes:

    attainable FLOP/s
        ^
   peak |.................___________________   <- compute-bound (roof)
        |               /
        |             /  slope = bandwidth
        |           /
        |         /      <- bandwidth-bound
        +--------+------------------------->  intensity (FLOPs per byte)
               ridge = peak / bandwidth

Decode with batch 1 reads every weight once (2 bytes in fp16) to do 2 FLOPs with it (one
multiply, one add): intensity about 1, far left of any GPU's ridge (hundreds). Prefill reuses each
weight for every prompt token, so its intensity is about the prompt length: far right.
Batching decode moves it right too, which is the whole point of chapter 05.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from engine.companions.memory import activation_breakdown, dtype_bytes, kv_cache_bytes
from engine.config import ModelConfig

# Each matmul weight does one multiply and one add per token: 2 FLOPs.
FLOPS_PER_MAC = 2
# Attention per (query, key) pair and head: q.k is D MACs, the weighted sum of V another D,
# so 2 * D MACs = 4 * D FLOPs.
ATTENTION_FLOPS_PER_PAIR_PER_DIM = 4
# Activations are written once by the op that makes them and read once by the next.
ACTIVATION_TRAFFIC_FACTOR = 2
# Quantized weights (int8/int4) are dequantized into 16-bit activations.
MIN_ACTIVATION_BYTES = 2


@dataclass(frozen=True)
class ForwardCost:
    """FLOPs and bytes moved by one forward pass (every count is for the whole batch)."""

    flops: int
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    activation_bytes: int
    total_bytes: int
    intensity: float  # FLOPs per byte moved
    matmul_flops: int = 0
    attention_flops: int = 0


def _check_positive_int(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"forward_cost: {field} must be a positive int (1, 2, 3, ...), "
                         f"got {value!r}")


def forward_cost(config: ModelConfig, batch: int, new_tokens: int, context_tokens: int,
                 weight_dtype_bytes: float, kv_dtype_bytes: float,
                 activation_dtype_bytes: float | None = None) -> ForwardCost:
    """Count the work of one forward: `batch` sequences, each adding `new_tokens` tokens
    on top of a history, so each attends to `context_tokens` tokens (new ones included).

      prefill of a P-token prompt:  batch=1, new_tokens=P, context_tokens=P
      one decode step of B chats:   batch=B, new_tokens=1, context_tokens=current length

    FLOPs: 2 x matmul params x tokens, plus attention 4 x L x H x D x new_tokens x context per
    sequence. We count the full [new_tokens, context] rectangle, as a dense kernel does; a causal
    kernel skips the upper triangle, about half of it in prefill. The context is capped at the
    sliding window if the model has one.
    Bytes: weights read once per forward (the untied embedding table is not read, only looked
    up), the KV of the context read and that of the new tokens written, and the activations of
    `activation_breakdown` written once and read once per layer (logits once).
    """
    for field, value in (("batch", batch), ("new_tokens", new_tokens),
                         ("context_tokens", context_tokens)):
        _check_positive_int(field, value)
    if new_tokens > context_tokens:
        raise ValueError(f"forward_cost: context_tokens ({context_tokens}) includes the new "
                         f"tokens, so it must be >= new_tokens ({new_tokens})")
    w_b, kv_b = dtype_bytes(weight_dtype_bytes), dtype_bytes(kv_dtype_bytes)
    act_b = activation_dtype_bytes or max(w_b, MIN_ACTIVATION_BYTES)
    tokens = batch * new_tokens
    attended = min(context_tokens, config.sliding_window or context_tokens)
    L, H, Hkv, D = (config.num_hidden_layers, config.num_attention_heads,
                    config.num_key_value_heads, config.head_dim)

    matmul_flops = FLOPS_PER_MAC * config.matmul_params() * tokens
    attention_flops = ATTENTION_FLOPS_PER_PAIR_PER_DIM * L * H * D * new_tokens * attended * batch
    kv_read = kv_cache_bytes(L, batch, attended, Hkv, D, kv_b)
    kv_write = kv_cache_bytes(L, batch, new_tokens, Hkv, D, kv_b)
    weights = _weight_bytes_read(config, w_b)
    activations = _activation_traffic(config, tokens, act_b)

    flops = matmul_flops + attention_flops
    total = weights + kv_read + kv_write + activations
    return ForwardCost(flops, weights, kv_read, kv_write, activations, total, flops / total,
                       matmul_flops, attention_flops)


def _weight_bytes_read(config: ModelConfig, weight_dtype_bytes: float) -> int:
    """Weights streamed from memory in one forward: all but an untied embedding table."""
    parts = config.param_breakdown()
    # tied: read in full as the LM head
    unread = 0 if config.tie_word_embeddings else parts["embedding"]
    return int((sum(parts.values()) - unread) * weight_dtype_bytes)


def _activation_traffic(config: ModelConfig, tokens: int, act_bytes: float) -> int:
    parts = activation_breakdown(config, tokens, act_bytes)
    logits = parts.pop("logits")
    per_layer = sum(parts.values())
    return ACTIVATION_TRAFFIC_FACTOR * (config.num_hidden_layers * per_layer + logits)


@dataclass(frozen=True)
class MachineRoofline:
    """A machine's two roofs: compute (FLOP/s) and memory bandwidth (bytes/s)."""

    peak_flops: float
    bandwidth_bytes_per_s: float
    dtype: str
    description: str


def ridge_point(roofline: MachineRoofline) -> float:
    """The intensity (FLOPs per byte) where the two roofs meet."""
    return roofline.peak_flops / roofline.bandwidth_bytes_per_s


def attainable_flops(roofline: MachineRoofline, intensity: float) -> float:
    """The roofline itself: min(peak, bandwidth x intensity)."""
    return min(roofline.peak_flops, roofline.bandwidth_bytes_per_s * intensity)


def classify(cost: ForwardCost, roofline: MachineRoofline) -> str:
    """"compute-bound" right of the ridge point, "bandwidth-bound" left of it."""
    return "compute-bound" if cost.intensity >= ridge_point(roofline) else "bandwidth-bound"


def predicted_time(cost: ForwardCost, roofline: MachineRoofline) -> float:
    """The roofline's lower bound on seconds: max(flops / peak, bytes / bandwidth)."""
    return max(cost.flops / roofline.peak_flops, cost.total_bytes / roofline.bandwidth_bytes_per_s)


def decode_roofline_tokens_per_s(config: ModelConfig, roofline: MachineRoofline, dtype_bytes: float,
                                 context_tokens: int = 1) -> float:
    """Upper bound on batch-1 decode speed: bandwidth / bytes read per token (weights + KV).

    Every new token must stream all the weights and the sequence's KV cache through the chip
    once, so no batch-1 decoder can beat this on this machine, however fast its arithmetic.
    """
    cost = forward_cost(config, 1, 1, context_tokens, dtype_bytes, dtype_bytes)
    return roofline.bandwidth_bytes_per_s / (cost.weight_bytes + cost.kv_read_bytes)


# Calibration sizes. The matmul must be big enough that arithmetic, not overhead, dominates;
# the copy buffer must be well beyond the CPU's last-level cache so we measure DRAM.
# FAST mode shortens the time, not the copy: a 16 MiB buffer sat in a 32 MiB L3 and read at about
# three times the DRAM rate, which moved the ridge left and made the roofline's verdicts wrong.
# 128 MiB is four times the 32 MiB L3 of most laptop and desktop parts; where the CPU reports more
# (a server's shared L3 seen from a VM: 480 MiB on one Intel Xeon here), the copy grows to
# COPY_OVER_CACHE times it.
MATMUL_N, MATMUL_N_FAST = 1024, 256
COPY_BYTES, COPY_BYTES_FAST = 256 * 2**20, 128 * 2**20
COPY_OVER_CACHE = 2  # the copy is at least this many times the last-level cache
LLC_SYSFS = "/sys/devices/system/cpu/cpu0/cache/index3/size"  # the L3's size, e.g. "32768K"
LLC_FALLBACK_BYTES = 32 * 2**20  # where sysfs does not say: a common laptop and desktop L3
SIZE_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30}
MIN_REPEATS = 3
DEFAULT_CALIBRATION_SECONDS = 2.0
FAST_CALIBRATION_SECONDS = 0.2


def last_level_cache_bytes(path: str = LLC_SYSFS) -> int:
    """This CPU's L3 in bytes as Linux reports it ("32768K"), else LLC_FALLBACK_BYTES."""
    try:
        text = open(path).read().strip()
    except OSError:
        return LLC_FALLBACK_BYTES
    digits = text.rstrip("".join(SIZE_SUFFIXES))
    if not digits.isdigit():
        return LLC_FALLBACK_BYTES
    return int(digits) * SIZE_SUFFIXES.get(text[-1], 1)


def calibration_copy_bytes(fast: bool, device: str = "cpu") -> int:
    """The copy buffer's size: COPY_BYTES (or COPY_BYTES_FAST), and on a CPU never under
    COPY_OVER_CACHE times its last-level cache (a GPU's L2 is far below either)."""
    size = COPY_BYTES_FAST if fast else COPY_BYTES
    if torch.device(device).type != "cpu":
        return size
    return max(size, COPY_OVER_CACHE * last_level_cache_bytes())


def calibrate(seconds: float | None = None, device: str = "cpu") -> MachineRoofline:
    """Measure this machine's roofline in about `seconds` seconds (fp32).

    These are achieved numbers, not the spec sheet's peak: a square fp32 matmul (best of several)
    for FLOP/s, and a large tensor copy (read + write bytes, best of several) for bandwidth.
    Spec sheets quote the best case of the best dtype; a real kernel reaches some fraction of it.
    SERVELAB_FAST=1 shrinks the matmul and the time so tests finish quickly; the copy stays at
    least twice this CPU's last-level cache (calibration_copy_bytes), so the bandwidth is DRAM's.
    """
    fast = os.environ.get("SERVELAB_FAST") == "1"
    if seconds is None:
        seconds = FAST_CALIBRATION_SECONDS if fast else DEFAULT_CALIBRATION_SECONDS
    n = MATMUL_N_FAST if fast else MATMUL_N
    copy_bytes = calibration_copy_bytes(fast, device)

    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    matmul_s = _best_time(lambda: torch.mm(a, b), seconds / 2, device)
    src = torch.ones(copy_bytes // 4, device=device)  # fp32: 4 bytes per element
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), seconds / 2, device)

    peak = FLOPS_PER_MAC * n**3 / matmul_s
    bandwidth = 2 * copy_bytes / copy_s  # a copy reads every byte once and writes it once
    where = (f"cpu ({torch.get_num_threads()} threads)" if device == "cpu"
             else f"{device} ({torch.cuda.get_device_name(device)})")
    description = (f"{where}: fp32 matmul {n}x{n}, copy {copy_bytes >> 20} MiB, "
                   f"best of repeats within {seconds:.1f} s; achieved, not spec-sheet peak")
    return MachineRoofline(peak, bandwidth, "fp32", description)


def _best_time(fn, budget_s: float, device: str) -> float:
    """Fastest of repeated runs of `fn`, after one warm-up; at least MIN_REPEATS runs."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    best, start, runs = float("inf"), time.perf_counter(), 0
    while runs < MIN_REPEATS or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best

"""Where the GPU's memory goes: weights, the KV cache and activations, counted in bytes.

Chapters 02 and 03 ("KV Cache 的形状与容量" in the text) lean on this file. It knows nothing
of the engine's model code: a model is described by its `ModelConfig` (the numbers you read off a
Hugging Face `config.json`; `engine.config.MODEL_PRESETS` holds published ones), and everything
here is arithmetic on those numbers. That lets a notebook ask "how many 8k-token chats of
Llama-3-8B fit on an 80 GB card?" without downloading a single weight.

The three consumers of GPU memory while serving, from the largest (usually) to the smallest:

    +--------------------------------------------------------------+
    | weights        fixed: num_params x bytes per parameter       |
    | KV cache       grows: 2 x L x B x T x Hkv x D x bytes         |
    | activations    transient: one forward's buffers, then freed  |
    | (reserve)      headroom for activations, CUDA context, ...   |
    +--------------------------------------------------------------+

Notation (as in engine/model.py): B batch, T tokens, H query heads, Hkv KV heads, D head dim,
E hidden, V vocab, L layers, I MLP intermediate size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.config import ModelConfig

# Bytes per element for the dtypes a serving stack meets. int4 packs two values in a byte.
# (Quantized formats also carry scales and zero points; we leave those out: they add a few percent
# and depend on the group size, see engine/loading/quantization.py's weight_bytes_breakdown.)
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1, "int4": 0.5}

# Other spellings people (and torch, and engine/config.py) use for the same dtypes.
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16", "float8": "fp8", "uint8": "int8",
}
ALLOWED_BYTES = (0.5, 1, 2, 4)

# Spec-sheet memory sizes. GB here is decimal (10**9 bytes), as on the spec sheets;
# nvidia-smi reports MiB (2**20), so an "80 GB" card shows about 81 000 MiB.
GPU_MEMORY_GB = {"24 GB (RTX 4090)": 24, "80 GB (A100/H100)": 80, "141 GB (H200)": 141}
GB = 10**9

# vLLM's default gpu_memory_utilization is 0.9: it leaves 10% of the card for activations,
# the CUDA context, the allocator's fragmentation and other processes. We reserve the same.
ACTIVATION_RESERVE_FRACTION = 0.10


def _check_positive_int(func: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{func}: {field} must be a positive int (1, 2, 3, ...), got {value!r}")


def _check_bytes(func: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in ALLOWED_BYTES:
        raise ValueError(f"{func}: {field} must be one of {ALLOWED_BYTES} bytes per element, "
                         f"got {value!r}")


def dtype_bytes(dtype) -> float:
    """Bytes per element of a dtype given by name ("bf16", "float16", "int4"),
    torch dtype or number.

    A number is passed through if it is one of 0.5, 1, 2, 4, so every function taking a dtype
    also accepts plain bytes.
    """
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        _check_bytes("dtype_bytes", "dtype", dtype)
        return dtype
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if name in DTYPE_BYTES:
            return DTYPE_BYTES[name]
    raise ValueError(f"dtype_bytes: dtype must be a torch dtype, one of {sorted(DTYPE_BYTES)} "
                     f"(or {sorted(_DTYPE_ALIASES)}) or one of {ALLOWED_BYTES}; got {dtype!r}")


def kv_cache_bytes(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int,
                   dtype_bytes: float) -> int:
    """The KV cache formula, M_KV = 2 * L * B * T * Hkv * D * b, in bytes.

    Each factor, and why it is there:
      2          we keep two tensors per layer, K and V, of the same shape;
      L layers   every layer has its own attention, so its own K and V;
      B batch    every sequence being served has its own history;
      T tokens   one K and one V vector per cached token (grows by one each decode step);
      Hkv        KV heads: with GQA/MQA several query heads share one KV head, so this is
                 the (smaller) number of KV heads, not the number of query heads;
      D          head dimension, the length of each K or V vector;
      b          bytes per element: 2 for fp16/bf16, 1 for int8/fp8, 0.5 for int4.

    The same bytes as a tensor of shape [L, 2, B, T, Hkv, D]; `.nbytes` of such a tensor
    equals this number (the tests check it).
    """
    for field, value in (("layers", layers), ("batch", batch), ("tokens", tokens),
                         ("kv_heads", kv_heads), ("head_dim", head_dim)):
        _check_positive_int("kv_cache_bytes", field, value)
    _check_bytes("kv_cache_bytes", "dtype_bytes", dtype_bytes)
    half_bytes = int(dtype_bytes * 2)  # integer arithmetic: exact even for int4 and huge caches
    return 2 * layers * batch * tokens * kv_heads * head_dim * half_bytes // 2


# KV int8 keeps one fp32 scale per token, KV head and K/V (kernels/paged_attention)
KV_INT8_SCALE_BYTES = 4


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype) -> int:
    """Bytes of one paged KV block: the formula with B = 1 and T = block_size (K and V, every
    layer); for int8 (``torch.int8`` or "int8") plus the per-token, per-head scales the paged
    pools keep."""
    cfg = model_config
    values = kv_cache_bytes(cfg.num_hidden_layers, 1, block_size, cfg.num_key_value_heads,
                            cfg.head_dim, dtype_bytes(dtype))
    if dtype is torch.int8 or (isinstance(dtype, str)
                               and _DTYPE_ALIASES.get(dtype, dtype) == "int8"):
        values += (2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads
                   * KV_INT8_SCALE_BYTES)
    return values


def num_kv_blocks(model_config: ModelConfig, block_size: int, dtype, budget_bytes: int) -> int:
    """How many whole KV blocks fit in `budget_bytes` (0 when not even one does).

        blocks = budget_bytes // (2 * L * block_size * Hkv * D * b)

    SmolLM2-135M in fp32 (L 30, Hkv 3, D 64, b 4) with 16-token blocks: 737 280 bytes a block,
    so 1 GiB holds 1456 blocks = 23 296 tokens, almost 3 requests of its 8192-token context.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"num_kv_blocks: budget_bytes must be an int >= 0, got {budget_bytes!r}")
    return budget_bytes // kv_block_bytes(model_config, block_size, dtype)


def weight_bytes(config: ModelConfig, dtype) -> int:
    """Bytes to hold all the weights in `dtype` (quantization scales not counted)."""
    return math.ceil(config.num_params() * dtype_bytes(dtype))


def kv_bytes_per_token(config: ModelConfig, dtype) -> int:
    """KV bytes one token adds to one sequence's cache: the formula with B = T = 1."""
    return kv_cache_bytes(config.num_hidden_layers, 1, 1, config.num_key_value_heads,
                          config.head_dim, dtype_bytes(dtype))


def cached_tokens_per_sequence(config: ModelConfig, context_tokens: int) -> int:
    """Tokens one sequence keeps in its cache: all of them, or the last `sliding_window`."""
    _check_positive_int("cached_tokens_per_sequence", "context_tokens", context_tokens)
    if config.sliding_window is None:
        return context_tokens
    return min(context_tokens, config.sliding_window)


def activation_breakdown(config: ModelConfig, tokens: int, dtype) -> dict[str, int]:
    """The largest transient buffers of one forward over `tokens` tokens (all sequences together).

    Layers run one after another, so only one layer's buffers are alive at a time; per layer:
      hidden         the residual stream and its normed copy,       2 x [T, E]
      qkv            the projections,                               [T, H*D] + 2 x [T, Hkv*D]
      attention_out  attention's output before Wo,                  [T, H*D]
      mlp            gate, up and silu(gate) * up,                  3 x [T, I]
    and once, at the end:
      logits         [T, V]  (an engine usually keeps only the last position of each sequence;
                     pass tokens = B for that case)
    Not counted: the [H, T, T] attention scores. A fused kernel (FlashAttention, SDPA) never
    writes them out; the naive one in chapter 01 does, and they grow with T squared.
    We add everything up, an upper bound: a real allocator frees q/k/v before the MLP runs.
    """
    _check_positive_int("activation_bytes", "tokens", tokens)
    b = dtype_bytes(dtype)
    T, E, D = tokens, config.hidden_size, config.head_dim
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    elements = {
        "hidden": 2 * T * E,
        "qkv": T * (H + 2 * Hkv) * D,
        "attention_out": T * H * D,
        "mlp": 3 * T * config.intermediate_size,
        "logits": T * config.vocab_size,
    }
    return {part: math.ceil(n * b) for part, n in elements.items()}


def activation_bytes(config: ModelConfig, tokens: int, dtype) -> int:
    """Sum of `activation_breakdown`: the transient memory of one forward, in bytes."""
    return sum(activation_breakdown(config, tokens, dtype).values())


@dataclass(frozen=True)
class MemoryPlan:
    """How one card's memory splits between weights, reserve and KV cache (all in bytes)."""

    gpu_bytes: int
    weight_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int

    @property
    def max_cached_tokens(self) -> int:
        """Tokens, over all sequences together, that the KV budget can hold."""
        return self.kv_budget_bytes // self.kv_bytes_per_token


def plan_memory(config: ModelConfig, gpu_bytes: int, weight_dtype, kv_dtype,
                reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> MemoryPlan:
    """Split `gpu_bytes` into weights, an activation reserve and what is left for the KV cache.

    Raises ValueError when the weights alone do not fit beside the reserve.
    """
    _check_positive_int("plan_memory", "gpu_bytes", gpu_bytes)
    if not 0 <= reserve_fraction < 1:
        raise ValueError("plan_memory: reserve_fraction must be in [0, 1), "
                         f"got {reserve_fraction!r}")
    weights = weight_bytes(config, weight_dtype)
    reserve = math.ceil(gpu_bytes * reserve_fraction)
    kv_budget = gpu_bytes - reserve - weights
    if kv_budget <= 0:
        raise ValueError(
            f"{config.name or 'this model'}: the weights alone need {weights / GB:.1f} GB in "
            f"{weight_dtype}, but a "
            f"{gpu_bytes / GB:.0f} GB card leaves {(gpu_bytes - reserve) / GB:.1f} GB after the "
            f"{reserve_fraction:.0%} activation reserve; use a larger card, a smaller weight dtype "
            f"(int8 or int4 weights) or split the model over several cards (tensor parallelism)")
    return MemoryPlan(gpu_bytes, weights, reserve, kv_budget, kv_bytes_per_token(config, kv_dtype))


def max_cached_tokens(config: ModelConfig, gpu_bytes: int, weight_dtype, kv_dtype,
                      reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> int:
    """How many tokens of KV cache fit on the card, shared among all sequences."""
    return plan_memory(config, gpu_bytes, weight_dtype, kv_dtype,
                       reserve_fraction).max_cached_tokens


def max_concurrent_sequences(config: ModelConfig, gpu_bytes: int, context_tokens: int,
                             weight_dtype, kv_dtype,
                             reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> int:
    """How many sequences of `context_tokens` tokens each can be cached at once.

    With a sliding window a sequence caches at most `sliding_window` tokens, however long it is.
    """
    per_sequence = cached_tokens_per_sequence(config, context_tokens)
    return (max_cached_tokens(config, gpu_bytes, weight_dtype, kv_dtype, reserve_fraction)
            // per_sequence)

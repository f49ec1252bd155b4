"""Where the GPU's memory goes: weights, the KV cache and activations, counted in bytes.

Chapters 02 and 03 ("KV Cache 的形状与容量" in the text) lean on this file. It knows nothing of
the engine's model code: a model is described by a small `ModelShape` (the numbers you read off a
Hugging Face `config.json`), and everything here is arithmetic on those numbers. That lets a
notebook ask "how many 8k-token chats of Llama-3-8B fit on an 80 GB card?" without downloading
a single weight.

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

# Bytes per element for the dtypes a serving stack meets. int4 packs two values in a byte.
# (Quantized formats also carry scales and zero points; we leave those out: they add a few
# percent and depend on the group size, see chapter 07.)
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
        raise ValueError(f"{func}: {field} must be one of {ALLOWED_BYTES} bytes per element, got {value!r}")


def dtype_bytes(dtype) -> float:
    """Bytes per element of a dtype given by name ("bf16", "float16", "int4"), torch dtype or number.

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


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a Llama-family model's size, as read from its config.json.

    `head_dim` is usually hidden // heads but some models set it on its own, so it is a field.
    `qkv_bias` (Qwen2) adds a bias to the q, k and v projections; `sliding_window`
    (Mistral) caps how many past tokens each layer attends to, and so how many we must cache.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_context: int
    qkv_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                      "max_context"):
            _check_positive_int(f"ModelShape {self.name!r}", field, getattr(self, field))
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape {self.name!r}: kv_heads must divide heads={self.heads} "
                             f"(each KV head serves a whole group of query heads), got {self.kv_heads}")
        if self.sliding_window is not None:
            _check_positive_int(f"ModelShape {self.name!r}", "sliding_window", self.sliding_window)

    def param_breakdown(self) -> dict[str, int]:
        """Parameters by part. Per layer: q/k/v/o projections, gate/up/down, two RMSNorms."""
        E, I, D = self.hidden, self.intermediate, self.head_dim
        q_out, kv_out = self.heads * D, self.kv_heads * D
        attention = E * q_out + 2 * E * kv_out + q_out * E  # Wq [E, H*D], Wk, Wv [E, Hkv*D], Wo [H*D, E]
        bias = (q_out + 2 * kv_out) if self.qkv_bias else 0
        mlp = 3 * E * I  # gate and up [E, I], down [I, E]
        return {
            "embedding": self.vocab * E,
            "attention": self.layers * (attention + bias),
            "mlp": self.layers * mlp,
            "norms": self.layers * 2 * E + E,  # input + post-attention norm per layer, final norm
            "lm_head": 0 if self.tied_embeddings else self.vocab * E,  # tied: reuses the embedding
        }

    def num_params(self) -> int:
        """Total parameter count (what a model card calls "8B")."""
        return sum(self.param_breakdown().values())

    def matmul_params(self) -> int:
        """Parameters that multiply every token: the layers' projections and the LM head.

        The embedding is a lookup (no FLOPs); norms and biases are elementwise (few FLOPs).
        The LM head is a [E, V] matmul even when its weights are tied to the embedding.
        """
        E, D = self.hidden, self.head_dim
        per_layer = 2 * E * self.heads * D + 2 * E * self.kv_heads * D + 3 * E * self.intermediate
        return self.layers * per_layer + E * self.vocab

    @classmethod
    def from_hf_config(cls, config: dict, name: str | None = None) -> ModelShape:
        """Build a shape from a Hugging Face config.json (already parsed into a dict)."""
        required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                    "vocab_size", "max_position_embeddings")
        missing = [key for key in required if key not in config]
        if missing:
            raise ValueError(f"ModelShape.from_hf_config: config.json lacks field(s) {missing}")
        heads = config["num_attention_heads"]
        window = config.get("sliding_window")
        if not config.get("use_sliding_window", True):  # Qwen2 writes a window but switches it off
            window = None
        return cls(
            name=name or config.get("_name_or_path") or config.get("model_type", "unnamed"),
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,  # absent: plain multi-head attention
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_context=config["max_position_embeddings"],
            qkv_bias=bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
            sliding_window=window,
        )


# Published shapes, copied from each model's config.json on the Hugging Face Hub. Field order in
# every entry: layers = num_hidden_layers, hidden = hidden_size, heads = num_attention_heads,
# kv_heads = num_key_value_heads, head_dim = hidden_size // num_attention_heads,
# intermediate = intermediate_size, vocab = vocab_size, tied_embeddings = tie_word_embeddings,
# max_context = max_position_embeddings.
PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-2-7b-hf: no GQA yet (num_key_value_heads == num_attention_heads).
    "Llama-2-7B": ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000, False, 4096),
    # meta-llama/Meta-Llama-3-8B: GQA with 8 KV heads, a 128k-token vocabulary.
    "Llama-3-8B": ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, False, 8192),
    # meta-llama/Meta-Llama-3-70B
    "Llama-3-70B": ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, False, 8192),
    # mistralai/Mistral-7B-v0.1: sliding_window = 4096 in its config.json.
    "Mistral-7B-v0.1": ModelShape("Mistral-7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, False, 32768,
                                  sliding_window=4096),
    # Qwen/Qwen2.5-7B(-Instruct): model_type qwen2, so q/k/v carry a bias; use_sliding_window false.
    # max_position_embeddings is 32768 in the Instruct config.json (the base one says 131072).
    "Qwen2.5-7B": ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, 32768,
                             qkv_bias=True),
    # HuggingFaceTB/SmolLM2-135M: tie_word_embeddings true, head_dim = 576 // 9 = 64.
    "SmolLM2-135M": ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True, 8192),
}


def weight_bytes(shape: ModelShape, dtype) -> int:
    """Bytes to hold all the weights in `dtype` (quantization scales not counted)."""
    return math.ceil(shape.num_params() * dtype_bytes(dtype))


def kv_bytes_per_token(shape: ModelShape, dtype) -> int:
    """KV bytes one token adds to one sequence's cache: the formula with B = T = 1."""
    return kv_cache_bytes(shape.layers, 1, 1, shape.kv_heads, shape.head_dim, dtype_bytes(dtype))


def cached_tokens_per_sequence(shape: ModelShape, context_tokens: int) -> int:
    """Tokens one sequence keeps in its cache: all of them, or the last `sliding_window`."""
    _check_positive_int("cached_tokens_per_sequence", "context_tokens", context_tokens)
    if shape.sliding_window is None:
        return context_tokens
    return min(context_tokens, shape.sliding_window)


def activation_breakdown(shape: ModelShape, tokens: int, dtype) -> dict[str, int]:
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
    T, E, D = tokens, shape.hidden, shape.head_dim
    elements = {
        "hidden": 2 * T * E,
        "qkv": T * (shape.heads + 2 * shape.kv_heads) * D,
        "attention_out": T * shape.heads * D,
        "mlp": 3 * T * shape.intermediate,
        "logits": T * shape.vocab,
    }
    return {part: math.ceil(n * b) for part, n in elements.items()}


def activation_bytes(shape: ModelShape, tokens: int, dtype) -> int:
    """Sum of `activation_breakdown`: the transient memory of one forward, in bytes."""
    return sum(activation_breakdown(shape, tokens, dtype).values())


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


def plan_memory(shape: ModelShape, gpu_bytes: int, weight_dtype, kv_dtype,
                reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> MemoryPlan:
    """Split `gpu_bytes` into weights, an activation reserve and what is left for the KV cache.

    Raises ValueError when the weights alone do not fit beside the reserve.
    """
    _check_positive_int("plan_memory", "gpu_bytes", gpu_bytes)
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"plan_memory: reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
    weights = weight_bytes(shape, weight_dtype)
    reserve = math.ceil(gpu_bytes * reserve_fraction)
    kv_budget = gpu_bytes - reserve - weights
    if kv_budget <= 0:
        raise ValueError(
            f"{shape.name}: the weights alone need {weights / GB:.1f} GB in {weight_dtype}, but a "
            f"{gpu_bytes / GB:.0f} GB card leaves {(gpu_bytes - reserve) / GB:.1f} GB after the "
            f"{reserve_fraction:.0%} activation reserve; use a larger card, a smaller weight dtype "
            f"(chapter 07) or split the model over several cards (chapter 08)")
    return MemoryPlan(gpu_bytes, weights, reserve, kv_budget, kv_bytes_per_token(shape, kv_dtype))


def max_cached_tokens(shape: ModelShape, gpu_bytes: int, weight_dtype, kv_dtype,
                      reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> int:
    """How many tokens of KV cache fit on the card, shared among all sequences."""
    return plan_memory(shape, gpu_bytes, weight_dtype, kv_dtype, reserve_fraction).max_cached_tokens


def max_concurrent_sequences(shape: ModelShape, gpu_bytes: int, context_tokens: int, weight_dtype,
                             kv_dtype, reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> int:
    """How many sequences of `context_tokens` tokens each can be cached at once.

    With a sliding window a sequence caches at most `sliding_window` tokens, however long it is.
    """
    per_sequence = cached_tokens_per_sequence(shape, context_tokens)
    return max_cached_tokens(shape, gpu_bytes, weight_dtype, kv_dtype, reserve_fraction) // per_sequence

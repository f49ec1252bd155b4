"""Configuration dataclasses.

Every config is a plain dataclass with units in its field names and a `__post_init__` that checks
each value and says what to change when it is wrong. `ModelConfig` is read from a Hugging Face
`config.json`; the others describe how the engine runs it (later chapters add fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The architectures whose weights map onto our one Llama-family decoder (see engine/model.py).
# value: does the architecture put a bias on the q/k/v projections?
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}

# Rope variants we implement: "default" (plain RoPE) and "llama3" (Llama 3.1's frequency rescaling).
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder, as in a Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama's attention_bias)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral: each token sees at most this many previous tokens
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            _require(self.hidden_size % self.num_attention_heads == 0,
                     f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                     f"({self.num_attention_heads}), or set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _require(self.architecture in SUPPORTED_ARCHITECTURES,
                 f"unsupported architecture {self.architecture!r}; supported: "
                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            _require(kind in SUPPORTED_ROPE_TYPES,
                     f"rope_scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
            if kind == "default":
                self.rope_scaling = None
        if self.sliding_window is not None:
            _require(self.sliding_window >= 1, f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    @property
    def gqa_group(self) -> int:
        """How many query heads share one KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Read a Hugging Face config.json (old `rope_theta`/`rope_scaling` or new `rope_parameters`)."""
        archs = d.get("architectures") or [_arch_from_model_type(d.get("model_type"))]
        arch = archs[0]
        _require(arch in SUPPORTED_ARCHITECTURES,
                 f"unsupported architecture {arch!r} in config.json; supported: "
                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        attention_bias = bool(d.get("attention_bias", False))
        uses_window = d.get("use_sliding_window", arch == "MistralForCausalLM")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            qkv_bias=SUPPORTED_ARCHITECTURES[arch] or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=d.get("sliding_window") if uses_window else None,
            architecture=arch,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def num_params(self) -> int:
        """Parameter count of the decoder (embeddings included once when tied)."""
        E, D, H, Hkv, F = (self.hidden_size, self.head_dim, self.num_attention_heads,
                           self.num_key_value_heads, self.intermediate_size)
        attn = E * H * D + 2 * E * Hkv * D + H * D * E
        attn += (H * D + 2 * Hkv * D) * self.qkv_bias + E * self.o_bias
        mlp = 3 * E * F + (2 * F + E) * self.mlp_bias
        per_layer = attn + mlp + 2 * E
        head = 0 if self.tie_word_embeddings else self.vocab_size * E
        return self.vocab_size * E + self.num_hidden_layers * per_layer + E + head


def _arch_from_model_type(model_type: str | None) -> str:
    table = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    return table.get(model_type or "", f"<model_type {model_type!r}>")


@dataclass
class CacheConfig:
    """How the KV cache is laid out (chapters 03-04)."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None: derived from max_num_seqs * max_model_len
    sliding_window: int | None = None
    swap_space_blocks: int | None = None  # CPU-side pool for swap preemption; None: as many as num_blocks

    def __post_init__(self) -> None:
        _require(self.block_size >= 1 and math.log2(self.block_size).is_integer(),
                 f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None:
            _require(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.swap_space_blocks is not None:
            _require(self.swap_space_blocks >= 0,
                     f"swap_space_blocks must be >= 0 (or None: as many as num_blocks), "
                     f"got {self.swap_space_blocks}")


@dataclass
class EngineConfig:
    """Everything the engine needs beyond the weights."""

    model: str = "tinylab"
    dtype: str = "float32"
    attention_backend: str = "torch"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig())  # defined below

    def __post_init__(self) -> None:
        _require(self.dtype in ("float32", "bfloat16", "float16"),
                 f"dtype must be one of float32, bfloat16, float16; got {self.dtype!r}")
        _require(self.attention_backend in ("torch", "triton", "cuda"),
                 f"attention_backend must be one of torch, triton, cuda; got {self.attention_backend!r}")


SCHEDULER_POLICIES = ("continuous", "static")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    """How the scheduler picks each step's work (chapter 05).

    policy: "continuous" admits waiting requests at every step while the token budget, max_num_seqs
        and the free KV blocks allow; "static" admits a batch only when nothing is running, and runs
        it to completion first (the baseline continuous batching is compared against).
    max_num_batched_tokens: tokens in one step's forward (prefill chunks + one per decode).
        None: the model's context length, so any prompt fits in one step.
    enable_chunked_prefill / max_prefill_chunk_tokens: split a long prompt over several steps,
        at most this many tokens per step (None: whatever budget is left), so decodes keep going.
    priority: each request's number; LOWER is served first (vLLM's convention), FCFS within one.
    tenant_max_running: per-tenant quota of running requests, e.g. {"free": 2}; tenants not
        listed get `default_tenant_max_running` (None: no quota).
    """

    policy: str = "continuous"
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    max_prefill_chunk_tokens: int | None = None
    preemption_mode: str = "recompute"
    tenant_max_running: dict[str, int] = field(default_factory=dict)
    default_tenant_max_running: int | None = None

    def __post_init__(self) -> None:
        _require(self.policy in SCHEDULER_POLICIES,
                 f"policy must be one of {SCHEDULER_POLICIES}, got {self.policy!r}")
        _require(self.preemption_mode in PREEMPTION_MODES,
                 f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
                 f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        for name in ("max_num_batched_tokens", "max_prefill_chunk_tokens", "default_tenant_max_running"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and value >= 1),
                     f"{name} must be None or an integer >= 1, got {value!r}")
        if self.max_prefill_chunk_tokens is not None:
            _require(self.enable_chunked_prefill,
                     f"max_prefill_chunk_tokens={self.max_prefill_chunk_tokens} needs "
                     "enable_chunked_prefill=True")
        for tenant, quota in self.tenant_max_running.items():
            _require(isinstance(quota, int) and quota >= 1,
                     f"tenant_max_running[{tenant!r}] must be an integer >= 1, got {quota!r}")

    def tenant_quota(self, tenant: str | None) -> int | None:
        """How many requests of `tenant` may run at once (None: no limit)."""
        return self.tenant_max_running.get(tenant, self.default_tenant_max_running)

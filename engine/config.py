"""Configuration dataclasses.

Every config is a plain dataclass with units in its field names and a `__post_init__` that checks
each value and says what to change when it is wrong. `ModelConfig` is read from a Hugging Face
`config.json`, or taken from `MODEL_PRESETS` (published models, for the arithmetic of
engine/companions/memory.py and engine/companions/roofline.py); the others describe how the engine
runs it (later chapters add fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.threads import check_num_threads

# The architectures whose weights map onto our one Llama-family decoder (see engine/model.py).
# value: does the architecture put a bias on the q/k/v projections?
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}

# Rope variants we implement: "default" (plain RoPE) and "llama3" (Llama 3.1's frequency rescaling).
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def is_int(value) -> bool:
    """A Python int; not a bool (True is not a count), not a float that happens to be whole. Every
    integer option of the configs and of SamplingParams is checked with it."""
    return isinstance(value, int) and not isinstance(value, bool)


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
    # a label for tables and figures, e.g. a preset's name; the model ignores it
    name: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            _require(is_int(value) and value >= 1,
                     f"{name} must be a positive integer, got {value!r}")
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
                     f"rope_scaling type {kind!r} is not supported; "
                     f"supported: {SUPPORTED_ROPE_TYPES}")
            if kind == "default":
                self.rope_scaling = None
        if self.sliding_window is not None:
            _require(self.sliding_window >= 1,
                     f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    @property
    def gqa_group(self) -> int:
        """How many query heads share one KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return (list(self.eos_token_id) if isinstance(self.eos_token_id, list)
                else [self.eos_token_id])

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Read a Hugging Face config.json (old `rope_theta`/`rope_scaling` or new
        `rope_parameters`)."""
        archs = d.get("architectures") or [_arch_from_model_type(d.get("model_type"))]
        arch = archs[0]
        _require(arch in SUPPORTED_ARCHITECTURES,
                 f"unsupported architecture {arch!r} in config.json; supported: "
                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                            else None)
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

    def param_breakdown(self) -> dict[str, int]:
        """Parameters by part; `num_params` and engine/companions/memory.py's byte counts both add
        these up.

        Per layer: the q/k/v/o projections (and their biases), gate/up/down (and theirs), two
        RMSNorms.
        """
        E, D, H, Hkv, F = (self.hidden_size, self.head_dim, self.num_attention_heads,
                           self.num_key_value_heads, self.intermediate_size)
        q_out, kv_out = H * D, Hkv * D
        # Wq [E, H*D], Wk, Wv [E, Hkv*D], Wo [H*D, E]
        attention = E * q_out + 2 * E * kv_out + q_out * E
        attention += (q_out + 2 * kv_out) * self.qkv_bias + E * self.o_bias
        mlp = 3 * E * F + (2 * F + E) * self.mlp_bias  # gate, up [E, F], down [F, E]
        L, V = self.num_hidden_layers, self.vocab_size
        return {
            "embedding": V * E,
            "attention": L * attention,
            "mlp": L * mlp,
            "norms": L * 2 * E + E,  # input + post-attention norm per layer, final norm
            "lm_head": 0 if self.tie_word_embeddings else V * E,  # tied: reuses the embedding
        }

    def num_params(self) -> int:
        """Parameter count of the decoder (what a model card calls "8B"; embeddings once when
        tied)."""
        return sum(self.param_breakdown().values())

    def matmul_params(self) -> int:
        """Parameters that multiply every token: the layers' projections and the LM head.

        The embedding is a lookup (no FLOPs); norms and biases are elementwise (few FLOPs).
        The LM head is an [E, V] matmul even when its weights are tied to the embedding.
        """
        E, D, F = self.hidden_size, self.head_dim, self.intermediate_size
        H, Hkv = self.num_attention_heads, self.num_key_value_heads
        per_layer = 2 * E * H * D + 2 * E * Hkv * D + 3 * E * F
        return self.num_hidden_layers * per_layer + E * self.vocab_size


def _arch_from_model_type(model_type: str | None) -> str:
    table = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM"}
    return table.get(model_type or "", f"<model_type {model_type!r}>")


# Published shapes: each keyword is the config.json field of the model on the Hugging Face Hub that
# the number was copied from (head_dim, where a config.json leaves it out, is hidden_size //
# num_attention_heads, written here so every factor of the KV formula is in sight). Only the fields
# that decide sizes are set (rope and norm settings keep our defaults): enough for every count in
# engine/companions/memory.py and engine/companions/roofline.py, and to build the model on the
# `meta` device, not to load its real weights. The configs are shared: change a copy
# (`dataclasses.replace(MODEL_PRESETS[name], ...)`), never a preset in place.
MODEL_PRESETS: dict[str, ModelConfig] = {c.name: c for c in (
    # meta-llama/Llama-2-7b-hf: no GQA yet (num_key_value_heads == num_attention_heads).
    ModelConfig(name="Llama-2-7B", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                max_position_embeddings=4096, tie_word_embeddings=False),
    # meta-llama/Meta-Llama-3-8B: GQA with 8 KV heads, a 128k-token vocabulary.
    ModelConfig(name="Llama-3-8B", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=8192, tie_word_embeddings=False),
    # meta-llama/Meta-Llama-3-70B
    ModelConfig(name="Llama-3-70B", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=8192, tie_word_embeddings=False),
    # mistralai/Mistral-7B-v0.1: sliding_window = 4096 in its config.json.
    ModelConfig(name="Mistral-7B-v0.1", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=32768, tie_word_embeddings=False, sliding_window=4096,
                architecture="MistralForCausalLM"),
    # Qwen/Qwen2.5-7B(-Instruct): Qwen2ForCausalLM, so q/k/v carry a bias; use_sliding_window false.
    # max_position_embeddings is 32768 in the Instruct config.json (the base one says 131072).
    ModelConfig(name="Qwen2.5-7B", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                max_position_embeddings=32768, tie_word_embeddings=False, qkv_bias=True,
                architecture="Qwen2ForCausalLM"),
    # HuggingFaceTB/SmolLM2-135M: tie_word_embeddings true, head_dim = 576 // 9 = 64 (not written).
    ModelConfig(name="SmolLM2-135M", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                max_position_embeddings=8192, tie_word_embeddings=True),
)}


# The KV budget when neither num_blocks nor kv_cache_memory_bytes is given. vLLM's CPU backend
# sizes its KV cache by VLLM_CPU_KVCACHE_SPACE (GiB, 4 unless set); we read SERVELAB_KVCACHE_SPACE
# the same way (engine/kv/kv_pool.py), but default to 1 GiB: servelab runs in notebooks on laptops,
# two test workers may each hold an engine, and the pool is zero-filled up front. 1 GiB holds 23,000
# tokens of SmolLM2-135M in fp32 (almost 3 requests at its full 8192-token context).
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 * 2**30
KVCACHE_SPACE_ENV = "SERVELAB_KVCACHE_SPACE"


KV_CACHE_DTYPES = ("auto", "int8")  # vLLM's option name; "auto" stores K/V in the model's dtype
# Which free-but-cached block the prefix cache gives up first when the device needs a block
# (engine/kv/evictor.py): "lru" the least recently used (vLLM's), "fifo" the one cached first,
# however often it was hit since.
EVICTION_POLICIES = ("lru", "fifo")


@dataclass
class CacheConfig:
    """How the KV cache is laid out and how big it is (chapters 03-04).

    Size, in this order: `num_blocks` (an exact block count), or `kv_cache_memory_bytes` (vLLM's
    absolute KV budget: as many blocks as fit), or, with neither, the smaller of what
    max_num_seqs requests of the model's full context need and DEFAULT_KV_CACHE_MEMORY_BYTES
    ($SERVELAB_KVCACHE_SPACE GiB when set). Give one of the two, not both.
    """

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # an exact count; None: sized by bytes (see above)
    kv_cache_memory_bytes: int | None = None  # KV budget in bytes; None: see above
    sliding_window: int | None = None
    # CPU-side pool for swap preemption; None: as many as num_blocks
    swap_space_blocks: int | None = None
    # chapter 06: share the full KV blocks of a cached prefix (vLLM's name). On by default, as in
    # vLLM: at 0 % hits its bookkeeping costs under 1 % (engine/kv/prefix_cache.py's cheap hash)
    enable_prefix_caching: bool = True
    # host tier for evicted prefix-cache blocks (0: none); needs enable_prefix_caching
    kv_offload_blocks: int = 0
    # "auto": the model's dtype; "int8": int8 K/V with per-token, per-head scales
    kv_cache_dtype: str = "auto"
    eviction_policy: str = "lru"  # which cached block is evicted first: one of EVICTION_POLICIES

    def __post_init__(self) -> None:
        _require(isinstance(self.enable_prefix_caching, bool),
                 f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        _require(is_int(self.block_size) and self.block_size >= 1
                 and math.log2(self.block_size).is_integer(),
                 f"block_size must be a power-of-two integer (1, 2, 4, 8, 16, ...), "
                 f"got {self.block_size!r}")
        for name, low, none_means in (("num_blocks", 1, "size the cache by bytes"),
                                      ("kv_cache_memory_bytes", 1, "the default budget"),
                                      ("swap_space_blocks", 0, "as many as num_blocks"),
                                      ("sliding_window", 1, "no window"),
                                      ("kv_offload_blocks", 0, "no host tier")):
            value = getattr(self, name)
            _require(value is None or (is_int(value) and value >= low),
                     f"{name} must be an integer >= {low} or None ({none_means}), got {value!r}")
        _require(self.eviction_policy in EVICTION_POLICIES,
                 f"eviction_policy must be one of {EVICTION_POLICIES}, "
                 f"got {self.eviction_policy!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.kv_offload_blocks in (0, None) or self.enable_prefix_caching,
                 f"kv_offload_blocks={self.kv_offload_blocks} needs enable_prefix_caching=True: "
                 "the host tier keeps the prefix cache's evicted blocks")
        _require(self.num_blocks is None or self.kv_cache_memory_bytes is None,
                 f"num_blocks={self.num_blocks} and "
                 f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} "
                 "both size the KV cache: give only one of them")


# The one switch between the readable engine and the fast one (engine/speed.py is the door between
# them):
#   "reference"  the spine only: engine/model.py's layers stepping in Python, attention through
#                kernels/paged_attention/reference.py, torch's argmax. No compiled library is
#                loaded.
#   "fast"       the fast wing (engine/fast/) transforms a copy of the model once at build (fused
#                and packed weights, C layers) and brings its own attention backends, decode step
#                and argmax.
# Both compute the same numbers up to float rounding; greedy tokens equal the naive loop's in both
# (the tests).
SPEEDS = ("reference", "fast")
DEFAULT_SPEED = "fast"
# The fast wing's expert overrides (FastOptions); "auto" lets engine/fast/probes.py choose for this
# machine.
ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "native", "triton", "cuda")
WEIGHT_LAYOUTS = ("auto", "linear", "packed")
LAYER_BACKENDS = ("auto", "python")
# What the reference path amounts to in the fast wing's words (so these overrides are allowed in
# either speed).
REFERENCE_CHOICES = {"attention_backend": "torch", "weight_layout": "linear",
                     "layer_backend": "python"}


@dataclass
class FastOptions:
    """Expert overrides of what the fast wing picks (`speed="fast"` only); leave them "auto".

    attention_backend: "torch" (the reference kernels), "sdpa" (torch's fused attention, a step's
        decodes in one call), "native" (decode and whole prompts in C), "triton" or "cuda" (the
        teaching kernels).
    weight_layout: "linear" keeps nn.Linear's [N, K]; "packed" fuses q/k/v and gate/up and packs
        every matrix for this CPU's matmuls (engine/fast/packed_linear.py).
    layer_backend: "python" keeps engine/model.py's PyTorch layers; "auto" runs small decode
        steps' layers in one C call and the norms, SiLU and RoPE of other steps as fused C ops
        where they can run.
    """

    attention_backend: str = "auto"
    weight_layout: str = "auto"
    layer_backend: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in (("attention_backend", ATTENTION_BACKENDS),
                              ("weight_layout", WEIGHT_LAYOUTS),
                              ("layer_backend", LAYER_BACKENDS)):
            value = getattr(self, name)
            _require(value in allowed, f"{name} must be one of {', '.join(allowed)}; got {value!r}")

    def overridden(self) -> dict[str, str]:
        """The options that are not "auto": what a reference engine must refuse."""
        return {name: value for name, value in vars(self).items() if value != "auto"}


# Speculative decoding (chapter 12): who proposes the guesses that one target step verifies.
#   "ngram"       prompt lookup: what followed the last n tokens where they appeared before
#   "draft_model" a smaller model with the same tokenizer (`model`: a bundled name or a folder;
#                 "self": a copy of the target, e.g. with quantization="int4")
#   "layer_skip"  the target's own first `num_draft_layers` layers, norm and head (no new weights)
SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip")
# k past which a verify step stops looking like a decode step on CPU (its rows leave the
# matrix-vector regime): a ceiling, not a default
MAX_SPECULATIVE_TOKENS = 16
# the draft model's weights, if quantized (engine/loading/quantization.py's weight-only schemes)
DRAFT_QUANTIZATIONS = (None, "int8", "int4")
# A verify step of B requests feeds B * (k + 1) rows: on 2 CPU cores a step of 8 decodes is
# already compute-bound enough that guesses stop paying (benchmarks/results/speculative.md), so
# from this many decodes on a step runs plain decode and records why.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# Below that, the guesses per request shrink so that a step feeds at most this many rows: 16 is
# where the fast wing's C decode layers stop taking a step in fp32 (GEMV_MAX_ROWS, engine/fast/);
# past it a verify step leaves the matrix-vector regime and costs much more than a decode step
DEFAULT_MAX_VERIFY_ROWS = 16


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config`: which proposer, how many guesses per step, when to switch off.

    num_speculative_tokens: k, the guesses verified per request per step (a verify step feeds
        k + 1 tokens and emits 1 to k + 1).
    prompt_lookup_min / prompt_lookup_max: "ngram" tries suffixes of the output from max down to
        min tokens long and proposes what followed their latest earlier occurrence.
    model / quantization: "draft_model"'s weights ("self" copies the target) and their scheme.
    num_draft_layers: "layer_skip"'s depth (fewer than the target's layers).
    disable_by_batch_size: a step with at least this many decoding requests runs without guesses
        (None: never switch off).
    max_verify_rows: below that, each request guesses at most max_verify_rows // decodes - 1
        tokens, so the step feeds at most this many rows (None: always k).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    quantization: str | None = None
    num_draft_layers: int | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    max_verify_rows: int | None = DEFAULT_MAX_VERIFY_ROWS

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                 f"got {self.method!r}")
        k = self.num_speculative_tokens
        _require(is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
                 f"speculative_config.num_speculative_tokens must be an integer in "
                 f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _require(is_int(lo) and is_int(hi) and 1 <= lo <= hi,
                 f"speculative_config.prompt_lookup_min / prompt_lookup_max must be integers with "
                 f"1 <= min <= max, got {lo!r} / {hi!r}")
        _require(self.quantization in DRAFT_QUANTIZATIONS,
                 f"speculative_config.quantization must be one of {DRAFT_QUANTIZATIONS}, "
                 f"got {self.quantization!r}")
        for name in ("disable_by_batch_size", "max_verify_rows"):
            value = getattr(self, name)
            _require(value is None or (is_int(value) and value >= 1),
                     f"speculative_config.{name} must be None or an integer >= 1, got {value!r}")
        self._check_method_fields()

    def _check_method_fields(self) -> None:
        """Each method's own fields are given, the others' are not (no silently unused option)."""
        needs = {"ngram": (), "draft_model": ("model",), "layer_skip": ("num_draft_layers",)}
        owned = {"model": "draft_model", "quantization": "draft_model",
                 "num_draft_layers": "layer_skip"}
        for name in needs[self.method]:
            _require(getattr(self, name) is not None,
                     f"speculative_config.method={self.method!r} needs {name}")
        for name, method in owned.items():
            _require(getattr(self, name) is None or method == self.method,
                     f"speculative_config.{name}={getattr(self, name)!r} belongs to "
                     f"method={method!r}, not {self.method!r}: drop it")
        if self.method == "layer_skip":
            _require(is_int(self.num_draft_layers) and self.num_draft_layers >= 1,
                     f"speculative_config.num_draft_layers must be an integer >= 1, "
                     f"got {self.num_draft_layers!r}")

    @classmethod
    def from_dict(cls, options: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict shape (`{"method": "ngram", "num_speculative_tokens": 4}`);
        an unknown key is refused by name."""
        if options is None or isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise TypeError(f"speculative_config must be a dict (e.g. {{'method': 'ngram', "
                            f"'num_speculative_tokens': 4}}) or None, got {type(options).__name__}")
        known = [f for f in cls.__dataclass_fields__]
        unknown = sorted(set(options) - set(known))
        _require(not unknown, f"speculative_config has unknown key(s) {unknown}; "
                              f"known: {', '.join(known)}")
        return cls(**options)


@dataclass
class EngineConfig:
    """Everything the engine needs beyond the weights."""

    model: str = "tinylab"
    dtype: str = "float32"
    speed: str = DEFAULT_SPEED  # "reference" or "fast": see SPEEDS
    # the fast wing's overrides ("fast" only)
    fast: FastOptions = field(default_factory=FastOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig())  # defined below
    # torch threads per step; None: 1 for small models (engine/threads.py)
    num_threads: int | None = None
    # defined below (chapter 08)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig())
    # chapter 12: None runs one token per request per step
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        check_num_threads(self.num_threads)
        _require(self.dtype in ("float32", "bfloat16", "float16"),
                 f"dtype must be one of float32, bfloat16, float16; got {self.dtype!r}")
        _require(self.speed in SPEEDS,
                 f"speed must be one of {', '.join(SPEEDS)}; got {self.speed!r}")
        fast_only = {k: v for k, v in self.fast.overridden().items() if v != REFERENCE_CHOICES[k]}
        if self.speed == "reference" and fast_only:
            named = ", ".join(f"{k}={v!r}" for k, v in fast_only.items())
            raise ValueError(f"{named}: fast-wing options, but speed='reference' runs the "
                             "readable path only "
                             f"({', '.join(f'{k}={v!r}' for k, v in REFERENCE_CHOICES.items())}); "
                             "drop them or use speed='fast'")


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
        _require(is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
                 f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        chunked = self.enable_chunked_prefill
        _require(isinstance(chunked, bool),
                 f"enable_chunked_prefill must be True or False, got {chunked!r}")
        for name in ("max_num_batched_tokens", "max_prefill_chunk_tokens",
                     "default_tenant_max_running"):
            value = getattr(self, name)
            _require(value is None or (is_int(value) and value >= 1),
                     f"{name} must be None or an integer >= 1, got {value!r}")
        if self.max_prefill_chunk_tokens is not None:
            _require(self.enable_chunked_prefill,
                     f"max_prefill_chunk_tokens={self.max_prefill_chunk_tokens} needs "
                     "enable_chunked_prefill=True")
        for tenant, quota in self.tenant_max_running.items():
            _require(is_int(quota) and quota >= 1,
                     f"tenant_max_running[{tenant!r}] must be an integer >= 1, got {quota!r}")

    def tenant_quota(self, tenant: str | None) -> int | None:
        """How many requests of `tenant` may run at once (None: no limit)."""
        return self.tenant_max_running.get(tenant, self.default_tenant_max_running)


# a collective that waits this long means a rank died or hangs: fail
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0


@dataclass
class ParallelConfig:
    """How one model is split over processes (chapter 08; vLLM's option names).

    tensor_parallel_size: every layer's matmuls split over this many ranks
        (engine/parallel/tensor_parallel.py); it must divide the query heads, the KV heads and the
        MLP width.
    pipeline_parallel_size: the layers split into this many stages, one per rank
        (engine/parallel/pipeline.py).
    num_micro_batches: a pipelined step's requests go through the stages in this many groups, so
        that stage 2 works on group 1 while stage 1 works on group 2 (None: as many as stages).
    collective_timeout_s: the longest any rank waits for another; past it the step fails with an
        error instead of hanging (a rank that died or got stuck).
    We split one way at a time: tensor OR pipeline parallel (vLLM combines them; the code would
    too, at the price of two process groups, which the chapter does not need).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_micro_batches: int | None = None
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _require(is_int(value) and value >= 1,
                     f"{name} must be an integer >= 1, got {value!r}")
        _require(self.tensor_parallel_size == 1 or self.pipeline_parallel_size == 1,
                 f"tensor_parallel_size={self.tensor_parallel_size} and pipeline_parallel_size="
                 f"{self.pipeline_parallel_size}: this engine splits one way at a time; "
                 "set one of them to 1")
        _require(self.num_micro_batches is None
                 or (is_int(self.num_micro_batches) and self.num_micro_batches >= 1),
                 f"num_micro_batches must be None (as many as stages) or an integer >= 1, "
                 f"got {self.num_micro_batches!r}")
        timeout = self.collective_timeout_s
        _require(isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                 and 0 < timeout < math.inf,
                 f"collective_timeout_s must be a positive number of seconds, got {timeout!r}")

    @property
    def world_size(self) -> int:
        """How many processes (ranks) run the model: 1 means no split at all."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

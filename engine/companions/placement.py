"""Placement: the ways a model can be spread over GPUs, which ones fit, and what each one costs.

Chapter 08 ("推理并行与模型放置" in the text). Llama-3-70B has 70.6 billion parameters: 141 GB in
bf16, and a big data-centre card holds 80 GB. Before any KV cache, before a single request, the
weights do not fit on one GPU. We have three ways to use several GPUs, and we can combine them:

    tensor parallel, TP=2           pipeline parallel, PP=2          replicas, R=2
    every layer cut in two          the stack of layers cut in two   the whole model twice

    GPU0 [L0a][L1a] ... [L79a]      GPU0 [L0 ........ L39]            GPU0 [L0 ........ L79]
           ^^   ^^        ^^                   |  E values            GPU1 [L0 ........ L79]
          2 all-reduces a layer                v  per token
    GPU1 [L0b][L1b] ... [L79b]      GPU1 [L40 ....... L79]            no traffic between them

- Tensor parallel (Megatron-LM style) splits every weight matrix: each GPU holds 1/TP of the query
  heads, of the KV heads and of the MLP's columns, so it reads 1/TP of the weights per token. After
  attention's output projection and after the MLP's down projection each GPU has only a partial sum
  of the [E] output; an all-reduce adds the partial sums up. Two all-reduces per layer, per token,
  every decode step: TP wants a fast link (NVLink), and its KV cache is split TP ways too.
- Pipeline parallel gives each GPU a contiguous range of layers. A token's hidden state (E values)
  crosses each stage boundary once: little traffic. But one sequence's decode step visits the stages
  one after another, so the other stages wait unless many requests are in flight (the text:
  流水线在单 Token Decode 时不易填满).
- Replicas are whole copies of the (possibly TP x PP split) model that serve different requests:
  no traffic at all and more throughput, but every copy pays the full weight memory again.

A layout is TP x PP x R. For each one we count, per GPU: the weight bytes,
engine/companions/memory.py's activation reserve, what is left for the KV cache and so how many
tokens, and sequences of the given context, fit per replica; and per token: the bytes
communicated and how long they take.

Choices we made (a student will ask):
- Idle GPUs are allowed. For each (TP, PP) with TP * PP <= num_devices we run as many replicas as
  fit, R = num_devices // (TP * PP), and report the GPUs left over. (SmolLM2-135M has 9 query
  heads, so TP=3 is valid; on 8 GPUs that is 2 replicas and 2 idle GPUs.)
- TP must divide num_attention_heads (a GPU holds whole query heads) and intermediate_size (the
  MLP's columns split evenly). KV heads follow vLLM: TP divides num_key_value_heads, or, when TP is
  larger, is a multiple of it; then every GPU keeps one KV head, each KV head copied on TP / Hkv
  GPUs, so the KV cache per GPU stops shrinking past TP = Hkv.
- PP must be <= num_hidden_layers. Uneven splits follow vLLM's get_pp_indices: every stage gets
  L // PP layers and the remainder goes one each to the stages just before the last.
- The first stage holds the embedding, the last the final norm and the LM head (a tied embedding is
  copied there when PP > 1); both are split over TP by vocabulary rows (vLLM's
  VocabParallelEmbedding; a vocabulary that does not divide is padded up).
- Communication counts the layers only. The vocabulary-parallel embedding adds one all-reduce per
  token and the LM head a gather of the logits: a few percent more for these models, left out.
  The time is bytes / bandwidth only; every message also pays a latency of some microseconds which,
  for a decode step's small messages, is often the larger part. Read the time as a lower bound.
- One interconnect for every link. Real clusters put TP inside a node (NVLink) and PP or replicas
  across nodes (InfiniBand, Ethernet); run the calculator once per link to compare.

Notation (as in engine/model.py): E hidden, H query heads, Hkv KV heads, D head dim, L layers,
I MLP intermediate size, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from engine.companions.memory import (
    ACTIVATION_RESERVE_FRACTION,
    GB,
    MemoryPlan,
    cached_tokens_per_sequence,
    dtype_bytes,
    kv_bytes_per_token,
)
from engine.companions.roofline import MIN_ACTIVATION_BYTES, MachineRoofline
from engine.config import MODEL_PRESETS, ModelConfig

TERA = 10**12
# Megatron-LM's tensor-parallel layer: attention's o_proj and the MLP's down_proj are row-parallel,
# each ends in an all-reduce of the [E] output.
ALLREDUCES_PER_LAYER = 2
MICROSECOND, NANOSECOND = 1e-6, 1e-9


def _check_name(cls: str, name) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls}.name must be a non-empty string (a label for tables), "
                         f"got {name!r}")


def _check_positive_int(field: str, value, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a positive int ({meaning}), got {value!r}")


def _check_positive_number(field: str, value, example: str) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            or math.isinf(value)):
        raise ValueError(f"{field} must be a positive, finite number ({example}), got {value!r}")


@dataclass(frozen=True)
class Device:
    """One accelerator as its datasheet describes it (decimal units: 1 GB = 10**9 bytes, as in
    engine/companions/memory.py; the card itself reports a little more, in MiB).

    peak_flops is the dense bf16 tensor-core rate; datasheets often print twice that
    "with sparsity".
    """

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float  # memory (HBM or GDDR) bandwidth
    peak_flops: float
    source: str = ""

    def __post_init__(self) -> None:
        _check_name("Device", self.name)
        _check_positive_int("Device.memory_bytes", self.memory_bytes,
                            "e.g. 80 * 10**9 for an 80 GB card")
        _check_positive_number("Device.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s,
                               "e.g. 3.35e12")
        _check_positive_number("Device.peak_flops", self.peak_flops, "e.g. 989e12")

    def roofline(self) -> MachineRoofline:
        """The same numbers as engine/companions/roofline.py's machine, for its formulas."""
        return MachineRoofline(self.peak_flops, self.bandwidth_bytes_per_s, "bf16",
                               f"{self.name}, datasheet")


@dataclass(frozen=True)
class Interconnect:
    """A link between GPUs. bytes_per_s is PER DIRECTION, per GPU: what one GPU sends while it
    receives as much. Datasheets often quote both directions added up (NVLink 4's "900 GB/s" is
    450 GB/s each way); a ring all-reduce sends and receives at once, so per direction is the
    number its time depends on."""

    name: str
    bytes_per_s: float
    source: str = ""

    def __post_init__(self) -> None:
        _check_name("Interconnect", self.name)
        _check_positive_number("Interconnect.bytes_per_s", self.bytes_per_s,
                               "per direction, e.g. 450e9")


# Datasheet numbers. Memory bandwidth as printed; FLOP/s dense bf16
# (half the "with sparsity" figure).
DEVICE_PRESETS: dict[str, Device] = {d.name: d for d in (
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 80 GB HBM3, 3.35 TB/s,
    # BF16 1,979 TFLOPS with sparsity.
    Device("H100-SXM-80GB", 80 * GB, 3.35 * TERA, 989e12, "NVIDIA H100 datasheet (SXM)"),
    # NVIDIA H200 datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity.
    Device("H200-SXM-141GB", 141 * GB, 4.8 * TERA, 989e12, "NVIDIA H200 datasheet (SXM)"),
    # NVIDIA A100 datasheet, A100 80GB SXM: 2,039 GB/s, BF16 312 TFLOPS (624 with sparsity).
    Device("A100-SXM-80GB", 80 * GB, 2.039 * TERA, 312e12, "NVIDIA A100 datasheet (80GB SXM)"),
    # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with sparsity.
    Device("L4-24GB", 24 * GB, 0.3 * TERA, 121e12, "NVIDIA L4 datasheet"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: 24 GB GDDR6X, 1,008 GB/s,
    # BF16 tensor with FP32 accumulate 165.2 TFLOPS (330.4 with sparsity).
    Device("RTX4090-24GB", 24 * GB, 1.008 * TERA, 165.2e12,
           "NVIDIA Ada GPU architecture whitepaper"),
)}

# Every figure per direction (see Interconnect). GB/s decimal; Ethernet and InfiniBand are quoted in
# Gb/s per direction (full duplex), so divide by 8.
INTERCONNECT_PRESETS: dict[str, Interconnect] = {i.name: i for i in (
    # NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions together (18 NVLink 4 links).
    Interconnect("NVLink4", 450e9, "NVIDIA H100 datasheet: 900 GB/s bidirectional"),
    # NVIDIA A100 datasheet: NVLink 600 GB/s per GPU, both directions together (12 NVLink 3 links).
    Interconnect("NVLink3", 300e9, "NVIDIA A100 datasheet: 600 GB/s bidirectional"),
    # PCI-SIG: PCIe 4.0 runs 16 GT/s a lane, x16 = 32 GB/s each way before 128b/130b encoding (31.5
    # after); datasheets print "64 GB/s" for both directions. Measured copies reach about 25.
    Interconnect("PCIe4-x16", 32e9, "PCIe 4.0 spec, 16 GT/s x16, per direction"),
    # PCIe 5.0: 32 GT/s a lane, x16 = 64 GB/s each way ("128 GB/s" bidirectional).
    Interconnect("PCIe5-x16", 64e9, "PCIe 5.0 spec, 32 GT/s x16, per direction"),
    # IEEE 802.3 100GBASE: 100 Gb/s each way.
    Interconnect("100GbE", 100e9 / 8, "100 Gb/s Ethernet, per direction"),
    # IEEE 802.3 400GBASE and InfiniBand NDR (NVIDIA ConnectX-7): 400 Gb/s each way.
    Interconnect("400GbE/NDR", 400e9 / 8, "400 Gb/s Ethernet or InfiniBand NDR, per direction"),
)}


@dataclass(frozen=True)
class Layout:
    """One way to place a model: TP x PP GPUs per replica, R replicas. Bytes are per GPU; where the
    stages differ (PP > 1) weights are the heaviest stage's and KV the tightest stage's. The memory
    fields are None when the split itself is impossible (`reason` says why)."""

    model: str
    device: str
    interconnect: str
    num_devices: int
    tp: int
    pp: int
    replicas: int
    idle_devices: int
    reason: str  # "" when the layout fits, else why not (and what to change)
    context_tokens: int  # tokens each sequence keeps in its cache (capped at a sliding window)
    reserve_bytes_per_device: int
    kv_heads_per_device: int | None
    weight_bytes_per_device: int | None
    # memory - reserve - weights; negative when weights overflow
    kv_budget_bytes_per_device: int | None
    kv_bytes_per_token_per_device: int | None
    kv_tokens_per_replica: int | None
    sequences_per_replica: int | None
    tp_bytes_per_token: float  # sent by each GPU of a TP group, all layers together
    pp_bytes_per_token: float  # sent across all stage boundaries together
    comm_s_per_token: float  # (tp + pp bytes) / link bandwidth: a lower bound, latency not counted
    # every stage reads its weights once: batch-1 decode's floor
    weight_read_s_per_token: float | None

    @property
    def fits(self) -> bool:
        return not self.reason

    @property
    def devices_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def sequences(self) -> int:
        """Sequences of `context_tokens` cached at once over all replicas
        (0 when it does not fit)."""
        return (self.sequences_per_replica or 0) * self.replicas if self.fits else 0

    @property
    def comm_bytes_per_token(self) -> float:
        return self.tp_bytes_per_token + self.pp_bytes_per_token


# ---- communication -------------------------------------------------------------------------------


def ring_allreduce_bytes(message_bytes: float, ranks: int) -> float:
    """Bytes each GPU sends (and receives) in a ring all-reduce of a `message_bytes` message.

    The ring does a reduce-scatter then an all-gather, each N - 1 steps of a message / N chunk:

        step:      1        2        3           N = 4 GPUs in a ring,
        GPU0 --> GPU1 --> GPU2 --> GPU3 --+      every GPU sends one chunk per step
          ^-------------------------------+

        sent per GPU = 2 (N - 1) / N x message   (0 when N = 1: nothing to add up)
    """
    _check_positive_int("ranks", ranks, "the number of GPUs in the group")
    return 2 * (ranks - 1) / ranks * message_bytes


def allreduce_bytes_per_token(model, tp: int, dtype) -> float:
    """Bytes each GPU of a tensor-parallel group sends per token: two all-reduces of E activations
    in every layer, L x 2 x 2 (TP - 1) / TP x E x b. `dtype` is the activations' (bf16 usually)."""
    config = _resolve_model(model)
    message = config.hidden_size * dtype_bytes(dtype)  # one token's [E] output
    return config.num_hidden_layers * ALLREDUCES_PER_LAYER * ring_allreduce_bytes(message, tp)


def pipeline_bytes_per_token(model, pp: int, dtype) -> float:
    """Bytes a token's hidden state carries across the PP - 1 stage boundaries: (PP - 1) x E x b."""
    config = _resolve_model(model)
    _check_positive_int("pp", pp, "the number of pipeline stages")
    return (pp - 1) * config.hidden_size * dtype_bytes(dtype)


# ---- memory per GPU ------------------------------------------------------------------------------


def kv_heads_per_device(model, tp: int) -> int:
    """KV heads each GPU keeps: Hkv / TP, or 1 (a replicated head) when TP > Hkv, as in vLLM."""
    config = _resolve_model(model)
    _check_positive_int("tp", tp, "the tensor-parallel size")
    return max(1, config.num_key_value_heads // tp)


def split_problem(model, tp: int, pp: int) -> str:
    """Why the model cannot be cut TP x PP ways ("" when it can)."""
    config = _resolve_model(model)
    _check_positive_int("tp", tp, "the tensor-parallel size")
    _check_positive_int("pp", pp, "the number of pipeline stages")
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    I, L = config.intermediate_size, config.num_hidden_layers
    if H % tp:
        return (f"TP={tp} does not divide num_attention_heads={H} (each GPU holds whole query "
                f"heads); use TP in {_divisors(H)}")
    if Hkv % tp and tp % Hkv:
        return (f"TP={tp} neither divides num_key_value_heads={Hkv} nor is a multiple of it "
                f"(then each GPU could keep one copied KV head); use TP in {_divisors(Hkv)} or a "
                f"multiple of {Hkv}")
    if I % tp:
        return (f"TP={tp} does not divide intermediate_size={I} (the MLP's columns must split "
                "evenly)")
    if pp > L:
        return (f"PP={pp} is more than num_hidden_layers={L}: a stage would hold no layer; "
                f"use PP <= {L}")
    return ""


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as vLLM's get_pp_indices splits them: L // PP each, the remainder
    one each to the stages just before the last (the last one also carries the LM head)."""
    _check_positive_int("num_layers", num_layers, "the model's num_hidden_layers")
    _check_positive_int("pp", pp, "the number of pipeline stages")
    counts = [num_layers // pp] * pp
    for stage in range(num_layers % pp):
        counts[-2 - stage] += 1
    return counts


def _shard(config: ModelConfig, tp: int, layers: int) -> ModelConfig:
    """One TP rank's slice of `layers` layers, written as a (smaller) model config, so that
    ModelConfig.param_breakdown and memory.kv_bytes_per_token count it for us."""
    return replace(config, num_hidden_layers=layers,
                   num_attention_heads=config.num_attention_heads // tp,
                   num_key_value_heads=kv_heads_per_device(config, tp),
                   intermediate_size=config.intermediate_size // tp,
                   vocab_size=-(-config.vocab_size // tp), name=f"{config.name} TP rank")


def _stage_params(config: ModelConfig, tp: int, pp: int, stage: int, layers: int) -> int:
    """Parameters on one GPU of pipeline stage `stage`
    (its layers, plus embedding / LM head at the ends)."""
    parts = _shard(config, tp, layers).param_breakdown()
    E = config.hidden_size
    # layers and their norms; final norm below
    params = parts["attention"] + parts["mlp"] + parts["norms"] - E
    if stage == 0:
        params += parts["embedding"]
    if stage == pp - 1:
        params += E  # the final norm
        copied_tied_head = parts["embedding"] if config.tie_word_embeddings and pp > 1 else 0
        params += parts["lm_head"] + copied_tied_head
    return params


def stage_memory_plans(model, device, tp: int, pp: int, weight_dtype="bf16", kv_dtype="bf16",
                       reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> list[MemoryPlan]:
    """engine/companions/memory.py's MemoryPlan for one GPU of each pipeline stage
    (budget < 0: weights overflow)."""
    config, device = _resolve_model(model), _resolve(device, DEVICE_PRESETS, Device, "device")
    _check_reserve(reserve_fraction)
    _check_positive_int("tp", tp, "the tensor-parallel size")
    problem = split_problem(config, tp, pp)
    if problem:
        raise ValueError(f"stage_memory_plans: {problem}")
    reserve = math.ceil(device.memory_bytes * reserve_fraction)  # as memory.plan_memory does
    plans = []
    for stage, layers in enumerate(stage_layer_counts(config.num_hidden_layers, pp)):
        weights = math.ceil(_stage_params(config, tp, pp, stage, layers)
                            * dtype_bytes(weight_dtype))
        per_token = kv_bytes_per_token(_shard(config, tp, layers), kv_dtype)
        plans.append(MemoryPlan(device.memory_bytes, weights, reserve,
                                device.memory_bytes - reserve - weights, per_token))
    return plans


# ---- layouts -------------------------------------------------------------------------------------


def plan_layout(model, device, num_devices: int, interconnect, tp: int, pp: int = 1, *,
                weight_dtype="bf16", kv_dtype="bf16", context_tokens: int | None = None,
                reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> Layout:
    """Place `model` as TP x PP GPUs per replica, as many replicas as `num_devices` allows.

    Returns a Layout whether or not it fits (`layout.reason` says why not). `model`, `device` and
    `interconnect` are objects or preset names; context_tokens defaults to the model's
    max_position_embeddings.
    """
    config = _resolve_model(model)
    device = _resolve(device, DEVICE_PRESETS, Device, "device")
    link = _resolve(interconnect, INTERCONNECT_PRESETS, Interconnect, "interconnect")
    _check_layout_args(num_devices, tp, pp)
    _check_reserve(reserve_fraction)
    dtype_bytes(kv_dtype)  # a bad name fails here, even for a split that never reaches the KV count
    context = cached_tokens_per_sequence(config, config.max_position_embeddings
                                         if context_tokens is None else context_tokens)
    # int8/int4 weights: bf16 activations
    activation_dtype = max(dtype_bytes(weight_dtype), MIN_ACTIVATION_BYTES)
    tp_bytes = allreduce_bytes_per_token(config, tp, activation_dtype)
    pp_bytes = pipeline_bytes_per_token(config, pp, activation_dtype)
    common = dict(model=config.name or "model", device=device.name, interconnect=link.name,
                  num_devices=num_devices, tp=tp, pp=pp, replicas=num_devices // (tp * pp),
                  idle_devices=num_devices % (tp * pp), context_tokens=context,
                  reserve_bytes_per_device=math.ceil(device.memory_bytes * reserve_fraction),
                  tp_bytes_per_token=tp_bytes, pp_bytes_per_token=pp_bytes,
                  comm_s_per_token=(tp_bytes + pp_bytes) / link.bytes_per_s)
    problem = split_problem(config, tp, pp)
    if problem:
        return Layout(**common, reason=problem, kv_heads_per_device=None,
                      weight_bytes_per_device=None, kv_budget_bytes_per_device=None,
                      kv_bytes_per_token_per_device=None, kv_tokens_per_replica=None,
                      sequences_per_replica=None, weight_read_s_per_token=None)
    plans = stage_memory_plans(config, device, tp, pp, weight_dtype, kv_dtype, reserve_fraction)
    tightest = min(plans, key=lambda p: p.max_cached_tokens)
    # every stage must hold each token's KV for its layers
    tokens = max(0, tightest.max_cached_tokens)
    heaviest = max(p.weight_bytes for p in plans)
    return Layout(**common, reason=_memory_problem(plans, tokens, context, device),
                  kv_heads_per_device=kv_heads_per_device(config, tp),
                  weight_bytes_per_device=heaviest,
                  kv_budget_bytes_per_device=tightest.kv_budget_bytes,
                  kv_bytes_per_token_per_device=tightest.kv_bytes_per_token,
                  kv_tokens_per_replica=tokens,
                  sequences_per_replica=tokens // context,
                  weight_read_s_per_token=(sum(p.weight_bytes for p in plans)
                                           / device.bandwidth_bytes_per_s))


def _memory_problem(plans: list[MemoryPlan], tokens: int, context: int, device: Device) -> str:
    heaviest = max(plans, key=lambda p: p.weight_bytes)
    if heaviest.kv_budget_bytes <= 0:
        return (f"weights need {_fmt_bytes(heaviest.weight_bytes)} per GPU + "
                f"{_fmt_bytes(heaviest.reserve_bytes)} reserve > {_fmt_bytes(device.memory_bytes)} "
                f"on {device.name}; raise TP or PP, or use smaller weights (int8, int4)")
    if tokens < context:
        return (f"weights fit, but the KV left holds {tokens:,} tokens per replica, less than one "
                f"sequence of {context:,}; shorten the context, raise TP or PP, or store the KV "
                "cache in int8")
    return ""


def candidate_layouts(model, device, num_devices: int, interconnect, *, weight_dtype="bf16",
                      kv_dtype="bf16", context_tokens: int | None = None,
                      reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> list[Layout]:
    """Every (TP, PP) with TP x PP <= num_devices, the ones that fit first (see feasible_layouts for
    their order), then the rejected ones, smallest first, each with its reason."""
    _check_positive_int("num_devices", num_devices, "how many GPUs there are")
    layouts = [plan_layout(model, device, num_devices, interconnect, tp, pp,
                           weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                           context_tokens=context_tokens, reserve_fraction=reserve_fraction)
               for tp in range(1, num_devices + 1) for pp in range(1, num_devices // tp + 1)]
    fitting = sorted((x for x in layouts if x.fits),
                     key=lambda x: (x.devices_per_replica, -x.sequences, x.pp))
    rejected = sorted((x for x in layouts if not x.fits),
                      key=lambda x: (x.devices_per_replica, x.pp))
    return fitting + rejected


def feasible_layouts(model, device, num_devices: int, interconnect, *, weight_dtype="bf16",
                     kv_dtype="bf16", context_tokens: int | None = None,
                     reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> list[Layout]:
    """The layouts that fit: fewest GPUs per replica first (least communication, most replicas),
    then the most sequences cached at once, then less PP (one sequence's step then visits fewer
    stages)."""
    return [x for x in candidate_layouts(model, device, num_devices, interconnect,
                                         weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                         context_tokens=context_tokens,
                                         reserve_fraction=reserve_fraction) if x.fits]


# ---- reading them --------------------------------------------------------------------------------


def explain(layout: Layout) -> str:
    """One line a student can read."""
    x = layout
    head = (f"{x.model} on {x.num_devices} x {x.device}: TP={x.tp} x PP={x.pp} x "
            f"{_plural(x.replicas, 'replica')}"
            + (f" ({x.idle_devices} idle)" if x.idle_devices else ""))
    if x.weight_bytes_per_device is None:
        return f"{head}: impossible, {x.reason}"
    memory = (f"per GPU {_fmt_bytes(x.weight_bytes_per_device)} weights + "
              f"{_fmt_bytes(x.reserve_bytes_per_device)} reserve")
    if not x.fits:
        return f"{head}: does not fit, {memory}; {x.reason}"
    return (f"{head}: {memory} + {_fmt_bytes(x.kv_budget_bytes_per_device)} KV = "
            f"{x.kv_tokens_per_replica:,} tokens = "
            f"{_plural(x.sequences_per_replica, 'sequence')} of {x.context_tokens:,} per replica "
            f"({x.sequences:,} in all); each token sends {_fmt_bytes(x.comm_bytes_per_token)}, "
            f"{_fmt_seconds(x.comm_s_per_token)} over {x.interconnect}")


def layouts_table(layouts: list[Layout]) -> str:
    """A markdown table of layouts (e.g. candidate_layouts' list);
    "-" where a split is impossible."""
    rows = ["| TP | PP | replicas | idle | weights/GPU | KV/GPU | KV tokens/replica | sequences "
            "| comm/token | comm time/token | fits |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for x in layouts:
        known = x.weight_bytes_per_device is not None
        cells = [str(x.tp), str(x.pp), str(x.replicas), str(x.idle_devices),
                 _fmt_bytes(x.weight_bytes_per_device) if known else "-",
                 _fmt_bytes(max(0, x.kv_budget_bytes_per_device)) if known else "-",
                 f"{x.kv_tokens_per_replica:,}" if known else "-", f"{x.sequences:,}",
                 _fmt_bytes(x.comm_bytes_per_token), _fmt_seconds(x.comm_s_per_token),
                 "yes" if x.fits else f"no: {x.reason}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---- small helpers -------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_seconds(seconds: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", MICROSECOND)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds / NANOSECOND:.3g} ns"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _resolve(value, presets: dict, cls: type, field: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value in presets:
        return presets[value]
    raise ValueError(f"{field} must be a {cls.__name__} or one of the preset names "
                     f"{sorted(presets)}, got {value!r}; for another one build {cls.__name__}(...) "
                     "with its datasheet numbers")


def _resolve_model(model) -> ModelConfig:
    return _resolve(model, MODEL_PRESETS, ModelConfig, "model")


def _check_layout_args(num_devices: int, tp: int, pp: int) -> None:
    _check_positive_int("num_devices", num_devices, "how many GPUs there are")
    _check_positive_int("tp", tp, "the tensor-parallel size")
    _check_positive_int("pp", pp, "the number of pipeline stages")
    if tp * pp > num_devices:
        raise ValueError(f"tp x pp = {tp} x {pp} = {tp * pp} GPUs per replica, but num_devices is "
                         f"{num_devices}; lower tp or pp, or raise num_devices")


def _check_reserve(reserve_fraction: float) -> None:
    if isinstance(reserve_fraction, bool) or not isinstance(reserve_fraction, (int, float)) \
            or not 0 <= reserve_fraction < 1:
        raise ValueError("reserve_fraction must be in [0, 1) (vLLM keeps 0.1 back), "
                         f"got {reserve_fraction!r}")

"""Checks for chapter 08: a linear layer split column- and row-wise, W simulated ranks against the
full matmul, the bytes a tensor-parallel group all-reduces per token, the pipeline bubble, and
picking a layout.

Each `check_<claim>(mod)` runs against the student's `exercises/ch08_parallelism.py` or the
reference in `exercises/solutions/`. The oracles are F.linear (the unsplit layer), the engine's own
tensor-parallel layers (engine/parallel/tensor_parallel.py), engine/parallel/pipeline.py's
StageTimeline (the bubble of a schedule), engine/companions/placement.py (allreduce_bytes_per_token,
stage_memory_plans, feasible_layouts) and numbers worked by hand.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.companions.memory import GB
from engine.companions.placement import Device, feasible_layouts, stage_memory_plans
from engine.companions.placement import (
    allreduce_bytes_per_token as engine_allreduce_bytes_per_token,
)
from engine.config import MODEL_PRESETS
from engine.parallel.pipeline import StageTimeline
from engine.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from exercises.checks import raises_naming

SEED = 8
ATOL = 1e-5  # fp32: the row split adds the same products in another order
# bf16 keeps 8 significant bits, so one rounding is off by up to 2^-8 of the value; a row split
# rounds each of its W partial sums and the bias addition: allow (W + 1) roundings of the largest
# output
BF16_REL_TOL = 2.0**-8
REL_TOL = 1e-9  # byte counts and fractions: exact but for float rounding
# (n, W): sizes
UNEVEN_SIZES = {(10, 4): [3, 3, 2, 2], (7, 3): [3, 2, 2], (6, 4): [2, 2, 1, 1], (8, 2): [4, 4]}
ANY_BANDWIDTH = 1e12  # the fit of a layout does not depend on the device's speed
LLAMA3_70B, LLAMA3_8B, SMOLLM2 = (MODEL_PRESETS[n]
                                  for n in ("Llama-3-70B", "Llama-3-8B", "SmolLM2-135M"))
# Llama-2-7B with one added pad token, a common fine-tune: 32,001 rows do not split evenly over 2
LLAMA2_7B_PADDED = replace(MODEL_PRESETS["Llama-2-7B"], name="Llama-2-7B + pad token",
                           vocab_size=32_001)


def _random(*shape: int, seed: int = SEED) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got, want, what: str, atol: float = ATOL) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)}, expected {list(want.shape)}"
    diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    assert diff <= atol, f"{what}: max |difference| from the expected values is {diff:.3g}"


def _number(got, want: float, what: str) -> None:
    assert isinstance(got, int | float) and not isinstance(got, bool), \
        f"{what}: expected a number, got {type(got).__name__}"
    assert math.isclose(got, want, rel_tol=REL_TOL, abs_tol=REL_TOL), (
        f"{what}: got {got!r}, expected {want!r}")


# ---- the shards ----------------------------------------------------------------------------------


def check_column_shard_takes_output_rows(mod) -> None:
    # nn.Linear(3, 4): weight [out=4, in=3], so output j is row j.
    # Rank 1 of 2 computes outputs 2 and 3.
    weight, bias = torch.arange(12.0).reshape(4, 3), torch.tensor([10.0, 11.0, 12.0, 13.0])
    w, b = mod.column_shard(weight, bias, 1, 2)
    _close(w, torch.tensor([[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]),
           "column_shard(weight [out=4, in=3], rank=1, world=2) weight (rows = output features: "
           "rows 2 and 3)")
    _close(b, torch.tensor([12.0, 13.0]),
           "column_shard(..., rank=1, world=2) bias (the bias of outputs 2 and 3)")
    w, b = mod.column_shard(weight, None, 0, 2)
    assert b is None, (
        f"column_shard(weight, None, 0, 2): a layer without a bias has no bias shard, got {b!r}")


def check_row_shard_takes_input_columns(mod) -> None:
    # weight [out=2, in=4]; rank 1 of 2 holds inputs 2 and 3: columns 2 and 3, every output row.
    weight = torch.arange(8.0).reshape(2, 4)
    _close(mod.row_shard(weight, 1, 2), torch.tensor([[2.0, 3.0], [6.0, 7.0]]),
           "row_shard(weight [out=2, in=4], rank=1, world=2) (columns = input features: "
           "columns 2 and 3)")


def check_column_shards_tile_the_weight_as_evenly_as_can_be(mod) -> None:
    for (n, world), sizes in UNEVEN_SIZES.items():
        weight, bias = _random(n, 5), _random(n, seed=SEED + 1)
        shards = [mod.column_shard(weight, bias, rank, world) for rank in range(world)]
        what = f"column_shard(weight [out={n}, in=5], rank, world={world})"
        got = [tuple(w.shape) for w, _ in shards]
        assert got == [(s, 5) for s in sizes], (
            f"{what}: shard shapes {got} for ranks 0..{world - 1}, expected "
            f"{[(s, 5) for s in sizes]} (as equal as can be, the first ranks one row longer)")
        _close(torch.cat([w for w, _ in shards]), weight, f"{what}: the shards stacked back")
        _close(torch.cat([b for _, b in shards]), bias, f"{what}: the bias shards stacked back")


def check_row_shards_tile_the_weight_as_evenly_as_can_be(mod) -> None:
    for (n, world), sizes in UNEVEN_SIZES.items():
        weight = _random(5, n)
        shards = [mod.row_shard(weight, rank, world) for rank in range(world)]
        what = f"row_shard(weight [out=5, in={n}], rank, world={world})"
        got = [tuple(w.shape) for w in shards]
        assert got == [(5, s) for s in sizes], (
            f"{what}: shard shapes {got} for ranks 0..{world - 1}, expected "
            f"{[(5, s) for s in sizes]} (as equal as can be, the first ranks one column longer)")
        _close(torch.cat(shards, dim=1), weight, f"{what}: the shards side by side")


def _full_linear(n_in: int, n_out: int) -> nn.Linear:
    full = nn.Linear(n_in, n_out)
    with torch.no_grad():
        full.weight.copy_(_random(n_out, n_in))
        full.bias.copy_(_random(n_out, seed=SEED + 1))
    return full


def check_column_shard_matches_the_engine_layer(mod) -> None:
    full = _full_linear(12, 8)
    for world in (1, 2, 4):
        for rank in range(world):
            engine = ColumnParallelLinear.from_linear(full, rank, world)
            w, b = mod.column_shard(full.weight.detach(), full.bias.detach(), rank, world)
            what = f"column_shard(nn.Linear(12, 8), rank={rank}, world={world})"
            _close(w, engine.weight.detach(),
                   f"{what} weight, against the engine's ColumnParallelLinear", atol=0)
            _close(b, engine.bias.detach(),
                   f"{what} bias, against the engine's ColumnParallelLinear", atol=0)


def check_row_shard_matches_the_engine_layer(mod) -> None:
    full = _full_linear(12, 8)
    for world in (1, 2, 4):
        for rank in range(world):
            # the weight only: no all-reduce run here
            engine = RowParallelLinear(full, rank, world, comm=None)
            _close(mod.row_shard(full.weight.detach(), rank, world), engine.weight.detach(),
                   f"row_shard(nn.Linear(12, 8), rank={rank}, world={world}), against the engine's "
                   "RowParallelLinear", atol=0)


# ---- W ranks in one process ----------------------------------------------------------------------


def _check_equals_the_full_matmul(mod, kind: str) -> None:
    for n_in, n_out, world in ((12, 10, 1), (12, 10, 2), (12, 10, 3), (12, 10, 4), (12, 10, 5),
                               (7, 9, 7)):
        weight, bias = _random(n_out, n_in), _random(n_out, seed=SEED + 1)
        x = _random(2, 3, n_in, seed=SEED + 2)  # [B, T, in]
        for b in (bias, None):
            what = (f"tensor_parallel_linear(x [2, 3, {n_in}], weight [{n_out}, {n_in}], "
                    f"{'a bias' if b is not None else 'no bias'}, world={world}, kind={kind!r})")
            _close(mod.tensor_parallel_linear(x, weight, b, world, kind), F.linear(x, weight, b),
                   f"{what}, against F.linear on the whole layer")


def check_column_parallel_linear_equals_the_full_matmul(mod) -> None:
    _check_equals_the_full_matmul(mod, "column")


def check_row_parallel_linear_equals_the_full_matmul(mod) -> None:
    _check_equals_the_full_matmul(mod, "row")


def check_row_parallel_linear_adds_the_bias_once(mod) -> None:
    # A zero weight: every partial sum is 0, so the layer's output is its bias, whatever the split.
    weight, bias, x = torch.zeros(3, 8), torch.ones(3), torch.ones(1, 8)
    y = mod.tensor_parallel_linear(x, weight, bias, 4, "row")
    _close(y, torch.ones(1, 3),
           "tensor_parallel_linear(zero weight, bias of ones, world=4, kind='row') "
           "(4.0 means every rank added the bias: add it once, after the all-reduce)")


def check_tensor_parallel_linear_keeps_bf16(mod) -> None:
    """A bf16 model runs its layers in bf16: the split layer must hand back what F.linear does, a
    bf16 tensor, equal to the exact product up to bf16 rounding (not an fp32 tensor, which the next
    layer would have to cast back, or which doubles the bytes an all-reduce sends)."""
    for kind in ("column", "row"):
        for world in (2, 3, 4):
            x = _random(2, 3, 64, seed=SEED + 3).bfloat16()  # [B, T, in]
            weight = _random(24, 64, seed=SEED + 4).bfloat16()
            bias = _random(24, seed=SEED + 5).bfloat16()
            what = f"tensor_parallel_linear(x, weight, bias all bf16, world={world}, kind={kind!r})"
            got = mod.tensor_parallel_linear(x, weight, bias, world, kind)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16, (
                f"{what} returned {getattr(got, 'dtype', type(got).__name__)}, F.linear gives "
                "torch.bfloat16: compute each rank's part in the inputs' dtype (a buffer from "
                "torch.zeros is fp32 and turns the sum into fp32)")
            exact = F.linear(x.float(), weight.float(), bias.float())  # the product, unrounded
            _close(got, exact, f"{what}, against the exact product",
                   atol=(world + 1) * BF16_REL_TOL * exact.abs().max().item())


def check_tensor_parallel_linear_refuses_an_unknown_kind(mod) -> None:
    weight, x = _random(4, 6), _random(2, 6)
    raises_naming("kind", lambda: mod.tensor_parallel_linear(x, weight, None, 2, "diagonal"),
                   "tensor_parallel_linear(kind='diagonal')")


# ---- all-reduce bytes ----------------------------------------------------------------------------


def check_allreduce_bytes_of_llama3_by_hand(mod) -> None:
    # Llama-3-70B: L = 80, E = 8192.
    # TP = 8 in bf16: 80 layers x 2 all-reduces x 2 x 7/8 x 8192 x 2 bytes
    # = 4,587,520 bytes per token (4.6 MB: at 450 GB/s of NVLink each way, 10 us a token).
    _number(mod.allreduce_bytes_per_token(LLAMA3_70B, 8, "bf16"), 4_587_520,
            "allreduce_bytes_per_token(Llama-3-70B, tp=8, 'bf16')")
    # TP = 2 in fp32: 80 x 2 x 2 x 1/2 x 8192 x 4 = 5,242,880.
    _number(mod.allreduce_bytes_per_token(LLAMA3_70B, 2, "fp32"), 5_242_880,
            "allreduce_bytes_per_token(Llama-3-70B, tp=2, 'fp32')")
    # Llama-3-8B (L = 32, E = 4096), TP = 4 in fp8: 32 x 2 x 2 x 3/4 x 4096 x 1 = 393,216.
    _number(mod.allreduce_bytes_per_token(LLAMA3_8B, 4, "fp8"), 393_216,
            "allreduce_bytes_per_token(Llama-3-8B, tp=4, 'fp8')")


def check_allreduce_bytes_are_0_for_a_single_gpu(mod) -> None:
    _number(mod.allreduce_bytes_per_token(LLAMA3_70B, 1, "bf16"), 0,
            "allreduce_bytes_per_token(Llama-3-70B, tp=1, 'bf16') (one GPU has nobody to add "
            "partial sums with)")


def check_allreduce_bytes_match_the_engine(mod) -> None:
    for model in MODEL_PRESETS.values():
        for tp in (1, 2, 3, 4, 8, 16):
            for dtype in ("bf16", "fp32", "fp8"):
                _number(mod.allreduce_bytes_per_token(model, tp, dtype),
                        engine_allreduce_bytes_per_token(model, tp, dtype),
                        f"allreduce_bytes_per_token({model.name}, tp={tp}, {dtype!r}), against "
                        "engine/companions/placement.py")


# ---- the pipeline bubble -------------------------------------------------------------------------


def check_pipeline_bubble_by_hand(mod) -> None:
    for stages, micro_batches, want in ((2, 3, 1 / 4), (4, 1, 3 / 4), (1, 8, 0.0), (4, 12, 3 / 15),
                                        (8, 8, 7 / 15)):
        _number(mod.pipeline_bubble(stages, micro_batches), want,
                f"pipeline_bubble(num_stages={stages}, num_micro_batches={micro_batches}) "
                "(idle stage-slots over all stage-slots between the first start and the last end)")


def _ideal_timeline(stages: int, micro_batches: int) -> StageTimeline:
    """Every stage takes one time unit per micro-batch;
    stage s starts micro-batch m at time s + m."""
    return StageTimeline([(s, m, float(s + m), float(s + m + 1))
                          for s in range(stages) for m in range(micro_batches)])


def check_pipeline_bubble_matches_the_engine_timeline(mod) -> None:
    for stages in range(1, 7):
        for micro_batches in range(1, 9):
            want = _ideal_timeline(stages, micro_batches).bubble_fraction()
            _number(mod.pipeline_bubble(stages, micro_batches), want,
                    f"pipeline_bubble({stages}, {micro_batches}), against "
                    "engine/parallel/pipeline.py's StageTimeline.bubble_fraction() of the "
                    "ideal schedule")


def check_pipeline_bubble_refuses_zero_stages_or_micro_batches(mod) -> None:
    raises_naming("num_stages", lambda: mod.pipeline_bubble(0, 4), "pipeline_bubble(0, 4)")
    raises_naming("num_micro_batches", lambda: mod.pipeline_bubble(2, 0), "pipeline_bubble(2, 0)")


def check_pipeline_bubble_refuses_sizes_that_are_not_positive_ints(mod) -> None:
    # A size read from a config file or a CLI flag arrives as 2.0 or "2"; True is an int to Python
    # but is no number of stages. Each must be refused by name, not turned into a fraction.
    for bad in (-1, 2.0, 1.5, True, "2", None):
        raises_naming("num_stages", lambda b=bad: mod.pipeline_bubble(b, 4),
                      f"pipeline_bubble(num_stages={bad!r}, num_micro_batches=4)")
        raises_naming("num_micro_batches", lambda b=bad: mod.pipeline_bubble(2, b),
                      f"pipeline_bubble(num_stages=2, num_micro_batches={bad!r})")


# ---- picking a layout ----------------------------------------------------------------------------


def _engine_pick(model, memory_bytes: int, num_devices: int, context: int, dtype: str = "bf16"):
    """The engine's answer: the first tensor-parallel-only layout (PP = 1) among the feasible ones
    (fewest GPUs per replica first), as (tp, replicas); None when none fits."""
    device = Device("test", memory_bytes, ANY_BANDWIDTH, ANY_BANDWIDTH)
    layouts = feasible_layouts(model, device, num_devices, "NVLink4", weight_dtype=dtype,
                               kv_dtype=dtype, context_tokens=context)
    return next(((x.tp, x.replicas) for x in layouts if x.pp == 1), None)


def _expect(mod, want, model, memory_bytes: int, num_devices: int, context: int, why: str,
            dtype="bf16") -> None:
    got = mod.pick_layout(model, memory_bytes, num_devices, context, dtype)
    assert got == want, (
        f"pick_layout({model.name}, {memory_bytes:,} bytes, num_devices={num_devices}, "
        f"context_tokens={context:,}, {dtype!r}) = {got!r}, "
        f"expected (tp, replicas) = {want}: {why}")


def check_pick_layout_of_llama3_70b_on_8_h100_by_hand(mod) -> None:
    # TP = 1: 70.6 billion parameters x 2 bytes = 141 GB > 80 GB.
    # TP = 2: each GPU holds half the layers' matmuls (attention 75,497,472 + MLP 352,321,536 params
    # a layer, + 16,384 of norms) x 80 layers, and 64,128 x 8192 rows of the embedding and of the
    # LM head, + the final norm: 35,277,512,704 params = 70,555,025,408 bytes.
    # + 8 GB reserve = 78.56 GB; the 1,444,974,592 bytes left hold 8,819 tokens at
    # 2 x 80 x 4 KV heads x 128 x 2 = 163,840 bytes a token: one 8,192-token sequence fits.
    # 8 / 2 = 4 replicas.
    _expect(mod, (2, 4), LLAMA3_70B, 80 * GB, 8, 8192,
            "TP = 2 holds the weights and one 8,192-token sequence")


def check_pick_layout_leaves_room_for_the_kv_cache(mod) -> None:
    # Llama-3-8B on 24 GB: the weights (16.1 GB) + reserve (2.4 GB) fit at TP = 1, but the 5.5 GB
    # left hold 42,262 tokens of KV (131,072 bytes each), less than one 65,536-token sequence.
    _expect(mod, (2, 2), LLAMA3_8B, 24 * GB, 4, 65536,
            "at TP = 1 the weights fit but the KV cache of one 65,536-token sequence does not")


def check_pick_layout_keeps_the_reserve(mod) -> None:
    # Llama-3-70B at TP = 2 needs 70.6 GB of weights + 16,384 x 163,840 = 2.7 GB of KV = 73.2 GB:
    # under 80 GB, but over the 72 GB left once 10% is kept back for activations.
    _expect(mod, (4, 2), LLAMA3_70B, 80 * GB, 8, 16384,
            "TP = 2 would fit only by using the 10% kept back for activations")


def check_pick_layout_skips_a_tp_that_does_not_divide_the_heads(mod) -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads. On 250 MB GPUs TP = 1 (458 MB) does not fit;
    # TP = 2 is no split at all (4.5 heads a GPU); TP = 3 fits, twice on 8 GPUs (2 idle).
    _expect(mod, (3, 2), SMOLLM2, 250 * 10**6, 8, 8192,
            "TP must divide the 9 query heads: 2 does not")


def check_pick_layout_keeps_one_kv_head_per_gpu_past_tp_equal_hkv(mod) -> None:
    # Llama-3-70B has 8 KV heads: at TP = 16 each GPU still keeps one (a copy), 40,960 bytes a
    # token, so 400,000 tokens need 16.4 GB of KV next to 9 GB of weights: too much for 21.6 GB.
    # TP = 32 fits.
    _expect(mod, (32, 1), LLAMA3_70B, 24 * GB, 32, 400_000,
            "past TP = Hkv = 8 the KV cache per GPU stops shrinking (one KV head a GPU, "
            "never half a head)")


def check_pick_layout_counts_a_device_filled_exactly_as_fitting(mod) -> None:
    # The memory at which Llama-3-70B at TP = 2 holds exactly one 8,192-token sequence, found with
    # the engine's own memory plan: the smallest card whose KV budget is exactly 8,192 tokens.
    need = 8192 * 163_840
    memory = round((70_555_025_408 + need) / (1 - 0.10)) - 20
    while (stage_memory_plans(LLAMA3_70B, Device("test", memory, ANY_BANDWIDTH, ANY_BANDWIDTH),
                              2, 1)[0].kv_budget_bytes < need):
        memory += 1
    _expect(mod, (2, 4), LLAMA3_70B, memory, 8, 8192,
            "the KV budget left at TP = 2 is exactly one sequence")
    _expect(mod, (4, 2), LLAMA3_70B, memory - 1, 8, 8192, "one byte less and TP = 2 no longer fits")


def check_pick_layout_fits_an_int8_layout_to_the_byte(mod) -> None:
    """Weights and KV both in int8 (1 byte a number) on a card sized to the byte, found with the
    engine's own memory plan: the smallest memory at which TP = 2 holds one 65,536-token sequence of
    Llama-2-7B with a 32,001-row vocabulary (each GPU holds ceil(32,001 / 2) = 16,001 rows)."""
    def plan(memory: int):
        device = Device("test", memory, ANY_BANDWIDTH, ANY_BANDWIDTH)
        return stage_memory_plans(LLAMA2_7B_PADDED, device, 2, 1, "int8", "int8")[0]

    need = 65_536 * plan(80 * GB).kv_bytes_per_token
    # just short of it, then byte by byte
    memory = round((plan(80 * GB).weight_bytes + need) / (1 - 0.10)) - 20
    while plan(memory).kv_budget_bytes < need:
        memory += 1
    assert _engine_pick(LLAMA2_7B_PADDED, memory, 8, 65_536, "int8") == (2, 4), "the engine agrees"
    _expect(mod, (2, 4), LLAMA2_7B_PADDED, memory, 8, 65_536,
            "TP = 2 holds the int8 weights (16,001 vocabulary rows a GPU) and one sequence of "
            "int8 KV, to the byte", "int8")
    _expect(mod, (4, 2), LLAMA2_7B_PADDED, memory - 1, 8, 65_536,
            "one byte less and TP = 2 no longer fits", "int8")


def check_pick_layout_refuses_zero_devices(mod) -> None:
    for n in (0, -2):
        raises_naming("num_devices", lambda k=n: mod.pick_layout(SMOLLM2, 80 * GB, k, 8192, "bf16"),
                      f"pick_layout(SmolLM2-135M, 80 GB, num_devices={n}) (no GPU, no layout: a "
                      "layout with 0 replicas serves nobody)")


def check_pick_layout_says_when_nothing_fits(mod) -> None:
    raises_naming("num_devices", lambda: mod.pick_layout(LLAMA3_70B, 24 * GB, 4, 8192, "bf16"),
                   "pick_layout(Llama-3-70B, 24 GB, num_devices=4) (141 GB of weights "
                   "on 4 x 24 GB)")


def check_pick_layout_matches_the_engine_placement(mod) -> None:
    cases = [(model, memory, n, context, dtype)
             for model in (LLAMA3_70B, LLAMA3_8B, SMOLLM2, MODEL_PRESETS["Qwen2.5-7B"],
                           MODEL_PRESETS["Llama-2-7B"])
             for memory, n in ((80 * GB, 8), (24 * GB, 8), (40 * GB, 4), (GB // 4, 6))
             for context in (8192, 131072) for dtype in ("bf16", "int8")]
    for model, memory, n, context, dtype in cases:
        want = _engine_pick(model, memory, n, context, dtype)
        if want is None:
            raises_naming("num_devices",
                           lambda a=(model, memory, n, context, dtype): mod.pick_layout(*a),
                           f"pick_layout({model.name}, {memory:,} bytes, num_devices={n}, "
                           f"{context:,}, {dtype!r}) "
                           "(engine/companions/placement.py finds no layout)")
        else:
            _expect(mod, want, model, memory, n, context,
                    "engine/companions/placement.py's feasible_layouts", dtype)

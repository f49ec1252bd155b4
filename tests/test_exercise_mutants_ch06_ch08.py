"""Held-out mutants for chapters 06 and 08: the two families of mistakes the first round of checks let
through (issue 33).

- inputs a student would not think of: token ids that are not Python ints (numpy, a torch tensor),
  physical block 0 (falsy, and still a block), pipeline sizes that are not positive ints, a TP layout
  on zero devices;
- numerics: a layer in bf16 (the result must stay bf16, as F.linear's does), and a tight int8 budget
  (weights and KV both in int8, the reserve rounded up, at the exact byte where a layout stops fitting).

A mutant is the reference solution with one plausible mistake patched into one function, as in
tests/test_exercise_mutants.py (which holds the first round and the machinery used here): `old` must
occur exactly once in that function. Each names the check that must fail on it; the reference must
still pass every check.
"""

from __future__ import annotations

import types

import pytest

import exercises
from engine.kv import prefix_cache
from test_exercise_mutants import Mutant, mutated_module

ROW_SUM = ("        total, start = None, 0\n",
           "        total, start = torch.zeros(*x.shape[:-1], weight.shape[0]), 0\n")

MUTANTS = [
    # ---- ch06: ids that are not Python ints, block 0 --------------------------------------------------------
    Mutant("ch06", "block_hash", "packs each id with int.to_bytes (numpy and torch ids have none)",
           'struct.pack(f"<{len(token_ids)}q", *token_ids)',
           'b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)', "block_hash_takes_any_integer_ids"),
    Mutant("ch06", "find_cached_prefix", "physical block 0 taken for a miss", "if h not in cached:",
           "if not cached.get(h):", "find_cached_prefix_finds_physical_block_0"),
    Mutant("ch06", "plan_prefill", "physical block 0 taken for a miss", "if h not in cached:",
           "if not cached.get(h):", "plan_prefill_shares_physical_block_0"),
    # ---- ch08: sizes that are not positive ints, zero devices ------------------------------------------------
    Mutant("ch08", "pipeline_bubble", "accepts a float size (only checks >= 1)",
           "if isinstance(value, bool) or not isinstance(value, int) or value < 1:", "if value < 1:",
           "pipeline_bubble_refuses_sizes_that_are_not_positive_ints"),
    Mutant("ch08", "pipeline_bubble", "accepts True as 1 stage (bool is an int)",
           "if isinstance(value, bool) or not isinstance(value, int) or value < 1:",
           "if not isinstance(value, int) or value < 1:", "pipeline_bubble_refuses_sizes_that_are_not_positive_ints"),
    Mutant("ch08", "pipeline_bubble", "refuses only zero (a negative size gives a number)",
           "or value < 1:", "or value == 0:", "pipeline_bubble_refuses_sizes_that_are_not_positive_ints"),
    Mutant("ch08", "pick_layout", "tries TP = 1 even on zero devices (0 replicas)",
           "for tp in range(1, num_devices + 1):", "for tp in range(1, max(num_devices, 1) + 1):",
           "pick_layout_refuses_zero_devices"),
    # ---- ch08: bf16 ------------------------------------------------------------------------------------------
    Mutant("ch08", "tensor_parallel_linear", "sums the row split into an fp32 buffer (bf16 in, fp32 out)",
           *ROW_SUM, "tensor_parallel_linear_keeps_bf16"),
    Mutant("ch08", "tensor_parallel_linear", "computes the column split in fp32",
           "F.linear(x, *column_shard(weight, bias, rank, world))",
           "F.linear(x.float(), *(t if t is None else t.float() for t in column_shard(weight, bias, rank, world)))",
           "tensor_parallel_linear_keeps_bf16"),
    Mutant("ch08", "tensor_parallel_linear", "adds an fp32 copy of the bias", "total + bias  #",
           "total + bias.float()  #", "tensor_parallel_linear_keeps_bf16"),
    # ---- ch08: a tight int8 budget ---------------------------------------------------------------------------
    Mutant("ch08", "pick_layout", "the KV cache always in bf16", "kv_bytes_per_token(shard, dtype)",
           'kv_bytes_per_token(shard, "bf16")', "pick_layout_fits_an_int8_layout_to_the_byte"),
    Mutant("ch08", "pick_layout", "the weights always in bf16", "shard.num_params() * dtype_bytes(dtype)",
           'shard.num_params() * dtype_bytes("bf16")', "pick_layout_fits_an_int8_layout_to_the_byte"),
    Mutant("ch08", "pick_layout", "the reserve rounded down", "math.ceil(device_memory_bytes * RESERVE_FRACTION)",
           "int(device_memory_bytes * RESERVE_FRACTION)", "pick_layout_fits_an_int8_layout_to_the_byte"),
    Mutant("ch08", "pick_layout", "the reserve rounded half to even",
           "math.ceil(device_memory_bytes * RESERVE_FRACTION)", "round(device_memory_bytes * RESERVE_FRACTION)",
           "pick_layout_fits_an_int8_layout_to_the_byte"),
    Mutant("ch08", "pick_layout", "the vocabulary rows rounded down (V // tp, not padded up)",
           "vocab_size=math.ceil(model.vocab_size / tp)", "vocab_size=model.vocab_size // tp",
           "pick_layout_fits_an_int8_layout_to_the_byte"),
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_the_named_check_fails_on_the_held_out_mutant(mutant):
    checks = dict(exercises.load_checks(mutant.chapter))
    assert mutant.caught_by in checks, f"{mutant.id}: no check named {mutant.caught_by!r}"
    module = mutated_module(mutant)
    try:
        checks[mutant.caught_by](module)
    except Exception:  # noqa: BLE001 - any failure of the check counts as catching the mutant
        return
    pytest.fail(f"{mutant.id}: check {mutant.caught_by!r} passed on a solution that {mutant.mistake}")


@pytest.mark.parametrize("chapter", ["ch06", "ch08"])
def test_the_reference_solution_still_passes_every_check(chapter):
    failed = [(r.name, r.reason) for r in exercises.run_checks(chapter, solutions=True) if not r.passed]
    assert not failed, failed


@pytest.mark.parametrize("chapter", ["ch06", "ch08"])
def test_the_stubs_fail_the_new_checks(chapter):
    names = {m.caught_by for m in MUTANTS if m.chapter == chapter}
    results = {r.name: r for r in exercises.run_checks(chapter)}
    assert all(not results[name].passed for name in names), {n: results[n].reason for n in names}


def test_the_engine_hashes_any_integer_ids_as_the_new_check_demands():
    """The check asks of a student's block_hash what the engine's own does: numpy and torch ids hash as ints."""
    engine = types.SimpleNamespace(block_hash=prefix_cache.block_hash, block_hashes=prefix_cache.block_hashes)
    check = dict(exercises.load_checks("ch06"))["block_hash_takes_any_integer_ids"]
    check(engine)

"""Split-K for paged decode attention: how many partitions to cut a sequence's context into.

Both the Triton and the CUDA kernels can run in two ways (the story is in ``triton.py``'s
docstring): one pass, where one program walks ALL of a sequence's blocks, or split-K
("flash-decoding", Dao et al. 2023; vLLM's paged_attention_v2), where the blocks a sequence reads
are cut into P partitions of whole blocks, P programs work on them at the same time, and a small
second kernel combines their results. This file holds what the two launchers share:

- ``check_num_partitions``: the argument's contract (None: choose; 1: the one-pass kernel);
- ``blocks_read``: how many blocks one sequence reads at most (fewer under a sliding window);
- ``choose_num_partitions``: the rule that picks P, with its constants and their reasons;
- ``partition_plan``: (P, blocks per partition), what the launchers pass to the kernels;
- ``scratch_traffic_bytes``: what split-K moves on top of the K/V bytes.

Partitions are counted from the first block a sequence reads (block first // BS under a window),
so a window never leaves programs idle at the front::

    W = 20, BS = 4, seq_len = 30: reads positions 10..29, blocks 2..7 (6 blocks);  P = 3
    table       [ -1  -1 | b2  b3 | b4  b5 | b6  b7 ]
    partition              p = 0   p = 1    p = 2       2 blocks each

A partition that starts past a sequence's last block (a short sequence in a batch of long ones,
or P larger than the blocks) reads nothing and reports m = -inf, l = 0: it adds nothing.
"""

from __future__ import annotations

import functools
import math

import torch

# An H100 / H200 SXM has 132 streaming multiprocessors; a CUDA device is asked for its own count.
DEFAULT_NUM_SMS = 132
# Programs we want per SM. A program is 4 warps that stream K/V and wait on DRAM most of the time;
# only many loads in flight hide that latency, so an SM should hold several programs at once and
# have more queued: 8 of them (32 warps, half of an H100 SM's 64) is our target, not a measurement.
PROGRAMS_PER_SM = 8
# Each partition streams at least this many tokens. Its fixed costs (loading q, writing its
# [G, D + 2] fp32 state, the combine reading it back) are then about 3 % of its K/V bytes
# (256 tokens x D = 128 x 2 B x 2 (K and V) = 128 KiB per KV head in bf16, against
# 2 x G = 4 heads x 130 x 4 B = 4 KiB of state written and read back).
MIN_PARTITION_TOKENS = 256
# The most partitions a launch takes: a CUDA grid's third axis holds at most 65535 thread blocks
# (Triton's grid too). Far beyond any useful split; larger values are an error, not a clamp.
MAX_PARTITIONS = 65535
SCRATCH_BYTES = 4  # partition state is fp32 whatever the storage type


def check_num_partitions(num_partitions) -> None:
    """None (choose) or an integer 1..MAX_PARTITIONS; anything else is a ValueError naming it."""
    if num_partitions is None:
        return
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) \
            or not 1 <= num_partitions <= MAX_PARTITIONS:
        raise ValueError(f"num_partitions: must be an integer in 1..{MAX_PARTITIONS} "
                         "(1: the one-pass kernel) or None (choose_num_partitions picks), "
                         f"got {num_partitions!r}")


def blocks_read(max_blocks: int, block_size: int, sliding_window: int | None) -> int:
    """The most blocks one sequence reads: its table's width, or under a window of W tokens the
    blocks W consecutive positions can touch (ceil((W - 1) / BS) + 1: they may start mid-block)."""
    if sliding_window is None:
        return max_blocks
    return min(max_blocks, -(-(sliding_window - 1) // block_size) + 1)


def choose_num_partitions(batch: int, parallel_heads: int, max_blocks: int, block_size: int,
                          num_sms: int = DEFAULT_NUM_SMS) -> int:
    """How many partitions to cut each sequence into (1: run the one-pass kernel).

    Args:
        batch: sequences B.
        parallel_heads: programs per sequence without splitting: Hkv for the Triton kernel (one
            per KV head), H for the CUDA one (one thread block per query head).
        max_blocks: the most blocks one sequence reads (``blocks_read``).
        block_size: tokens per block BS.
        num_sms: streaming multiprocessors of the GPU.

    We split only as far as needed to give every SM ``PROGRAMS_PER_SM`` programs, and never into
    partitions shorter than ``MIN_PARTITION_TOKENS``. P is then rounded so that every partition
    has the same whole number of blocks and the last one is not empty.
    """
    programs = batch * parallel_heads
    wanted = math.ceil(num_sms * PROGRAMS_PER_SM / max(programs, 1))
    min_blocks = math.ceil(MIN_PARTITION_TOKENS / block_size)
    parts = min(wanted, max_blocks // min_blocks, MAX_PARTITIONS)
    if parts <= 1:
        return 1
    per_partition = math.ceil(max_blocks / parts)
    return math.ceil(max_blocks / per_partition)


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA device; ``DEFAULT_NUM_SMS`` elsewhere (the interpreter on CPU takes
    the choice a GPU would make, so CPU tests run the same path)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


def partition_plan(num_partitions, batch: int, parallel_heads: int, max_blocks: int,
                   block_size: int, sliding_window: int | None,
                   device: torch.device) -> tuple[int, int]:
    """(P, blocks per partition) for a launch; ``num_partitions`` None lets the chooser pick."""
    check_num_partitions(num_partitions)
    span = blocks_read(max_blocks, block_size, sliding_window)
    if num_partitions is None:
        num_partitions = choose_num_partitions(batch, parallel_heads, span, block_size,
                                               num_sms(device))
    return num_partitions, math.ceil(span / num_partitions)


def scratch_traffic_bytes(batch: int, num_heads: int, head_dim: int, num_partitions: int) -> int:
    """The bytes split-K adds: every partition writes m, l and acc [D] in fp32 for each query
    head, and the combine reads them back (0 for the one-pass kernel)."""
    if num_partitions == 1:
        return 0
    return 2 * batch * num_heads * num_partitions * (head_dim + 2) * SCRATCH_BYTES

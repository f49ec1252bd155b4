"""Timing small things honestly on a busy machine: interleaved calls, medians,
optionally cold caches.

    ms = interleaved_medians_ms({"sdpa": f, "native": g}, rounds=9)
    # ms == {"sdpa": 0.41, "native": 0.17}

Interleaving (f, g, f, g, ...) lets a busy moment of a shared machine hit every contender alike, and
the median ignores the rounds it spoiled. With ``flush`` (a tensor bigger than the CPU's last-level
cache) each call is preceded by reading it, outside the timed part: the call then finds its data in
memory, not in a cache, as a layer of a real decode step does after 29 other layers' weights
streamed through.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

FLUSH_BYTES = 256 * 2**20  # larger than any last-level cache of the machines this project runs on


def cache_flusher(nbytes: int = FLUSH_BYTES) -> torch.Tensor:
    """A tensor to pass as ``flush``: reading it evicts what the caches held."""
    return torch.ones(nbytes // 4)


def interleaved_medians_ms(fns: dict[str, Callable[[], object]], rounds: int,
                           flush: torch.Tensor | None = None) -> dict[str, float]:
    """Median milliseconds of each zero-argument call over ``rounds`` interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if flush is not None:
                flush.sum()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}

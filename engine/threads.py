"""How many CPU threads torch may use for a forward pass, and why the answer is usually ONE here.

A matmul of a small model at decode time is tiny: tinylab's biggest one is 1 x 256 x 1024, about
half a million multiply-adds, a fraction of a millisecond on one core. Splitting it over two threads
saves little, and costs a hand-over between threads at every one of the hundreds of matmuls of a
forward pass. Worse, when another program is using the second core, the second thread waits for a
core that is not free, and every matmul waits for that thread. We measured one tinylab decode step
at 2.4 ms on one thread and 284 ms on two while another job ran: 100x slower, for nothing.

So the engine runs every step inside `torch_threads(n)`, with a setting it owns (`num_threads`):

    n = None  ->  default_num_threads(model): 1 for models below SMALL_MODEL_PARAMS, else the
                  machine's cores (big matmuls do split well, and such a machine is rarely shared)
    n = 4     ->  exactly 4

and gives the caller's setting back after each step, so a notebook's own code is left as it was.
Every timing that a notebook or a benchmark prints says how many threads it ran on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Below this many parameters a decode step's matmuls are too small to be worth a second thread
# (tinylab has 4.5M, SmolLM2-135M 135M: on 2 cores both decode at least as fast on one thread).
SMALL_MODEL_PARAMS = 200_000_000


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers often narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_num_threads(num_params: int) -> int:
    """One thread for small models, every available core for big ones (see the module docstring)."""
    return 1 if num_params < SMALL_MODEL_PARAMS else available_cores()


def check_num_threads(num_threads) -> None:
    """Raise a clear error unless `num_threads` is None or an integer >= 1."""
    if num_threads is not None and (isinstance(num_threads, bool)
                                    or not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads must be None (automatic: 1 for small models) "
                         f"or an integer >= 1, got {num_threads!r}")


@contextmanager
def torch_threads(num_threads: int) -> Iterator[int]:
    """Run the body with `num_threads` torch threads, then restore the caller's count."""
    check_num_threads(num_threads)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield num_threads
    finally:
        torch.set_num_threads(before)


def use_threads(num_threads: int = 1) -> int:
    """Set torch's thread count for the rest of the session (a notebook's first cell); return it."""
    check_num_threads(num_threads)
    torch.set_num_threads(num_threads)
    return torch.get_num_threads()

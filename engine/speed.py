"""The one door between the readable engine and the fast wing: `speed="reference" | "fast"`.

Everything the engine computes with (model, attention backend, decode step, greedy argmax) comes
from `accelerate` below, once, when the engine is built:

    speed="reference"   engine/model.py as loaded, engine/runner.py's PagedAttention (the PyTorch
                        reference kernels), torch's argmax: only the spine runs; no compiled
                        library is loaded
    speed="fast"        engine/fast/ hands back a transformed copy of the model and its own parts

This is the only module that imports engine/fast (tests/test_speed_door.py checks that no spine
module does), so a student can read the whole reference path without meeting a line of C, and the
fast wing can grow without touching the spine.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.kv.kv_pool import PagedKVPool
from engine.runner import Acceleration, PagedAttention


def accelerate(model, kv_pool: PagedKVPool, config: EngineConfig, sliding_window: int | None,
               num_threads: int, transform_model: bool = True) -> Acceleration:
    """What a runner computes with, for `config.speed` (see the module docstring)."""
    if config.speed == "reference":
        return Acceleration(model, PagedAttention(kv_pool, sliding_window),
                            choices={"speed": "reference"},
                            reasons={"speed": "the spine only: Python layers, reference attention"})
    # the door: the fast wing is imported here and nowhere else
    from engine.fast import accelerate as fast

    acceleration = fast(model, kv_pool, config.fast, sliding_window, num_threads, transform_model)
    acceleration.choices = {"speed": "fast", **acceleration.choices}
    return acceleration


def tuning_machine(num_threads: int) -> dict:
    """What the fast wing's measured choices are keyed by on this machine (CPU, flags, torch,
    threads: engine/fast/tuning.py), for `python -m engine doctor`."""
    from engine.fast import machine_facts

    return machine_facts(num_threads)


def remeasure_on_build() -> None:
    """Make engines built from now on in this process measure their fast paths again and overwrite
    the cached answers (`doctor --retune`)."""
    from engine.fast import remeasure_on_build as remeasure

    remeasure()

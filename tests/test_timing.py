"""engine/companions/timing.py: every contender is called once per round, in turn, and its median is reported."""

import time

import torch

from engine.companions.timing import cache_flusher, interleaved_medians_ms


def test_calls_interleave_and_medians_order_the_contenders():
    calls = []
    ms = interleaved_medians_ms({"fast": lambda: calls.append("fast"),
                                 "slow": lambda: calls.append("slow") or time.sleep(0.003)}, rounds=5)
    assert calls == ["fast", "slow"] * 5
    assert set(ms) == {"fast", "slow"} and 0 <= ms["fast"] < 3 <= ms["slow"]


def test_the_flusher_is_read_before_every_call():
    flush = cache_flusher(4096)
    assert flush.numel() == 1024
    reads = []

    class Spy(torch.Tensor):
        def sum(self, *a, **k):
            reads.append(1)
            return super().sum(*a, **k)

    interleaved_medians_ms({"a": lambda: None, "b": lambda: None}, rounds=3, flush=flush.as_subclass(Spy))
    assert len(reads) == 6

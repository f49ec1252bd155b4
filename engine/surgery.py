"""Model surgery in one helper: a copy of a model with some of its modules replaced, the rest
shared.

Several parts of servelab compute with a changed copy of the model you loaded, and leave yours as
it was (the oracle tests, the notebooks and the quantizer read the original):

    engine/fast/fused_projections.py   q/k/v and gate/up stacked into one matrix each
    engine/fast/packed_linear.py       every nn.Linear in the layout this CPU's matmul reads fastest
    engine/fast/native_ops.py          norms, SiLU and RoPE as fused C ops
    engine/parallel/tensor_parallel.py each rank's shard of every layer

Each says WHICH modules become WHAT as a function `swap(name, module) -> new module | None`, and
`replaced` does the walking: a branch in which nothing is replaced is shared as it is (no copy), a
branch with a replacement below is shallow-copied on the way down, so every tensor not replaced is
shared::

    model ─┬─ embed_tokens            shared
           ├─ layers ─┬─ 0 ─┬─ self_attn   -> swap(...) = the new module
           │          │     └─ mlp         shared
           │          └─ 1 ...            (copied only where something below changed)
           └─ lm_head                 shared (or swapped)
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

Swap = Callable[[str, nn.Module], "nn.Module | None"]


def replaced(module: nn.Module, swap: Swap, name: str = "") -> nn.Module:
    """`module` with every submodule for which `swap(dotted name, submodule)` returns a module
    replaced by it (not visiting its children then); `module` itself when nothing is replaced."""
    new = swap(name, module)
    if new is not None:
        return new
    children = {key: None if child is None
                else replaced(child, swap, f"{name}.{key}" if name else key)
                for key, child in module._modules.items()}
    if all(children[key] is child for key, child in module._modules.items()):
        return module
    twin = copy.copy(module)  # the same parameters and buffers; a new table of children
    twin._modules = children
    return twin

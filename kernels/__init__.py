"""servelab's kernels: each op as a readable PyTorch reference (its oracle) and the fast backends
that exist for it: C for the CPU, torch's fused attention, Triton, CUDA, not all for every op.

One folder per op (``kernels/<op>/``), each with ``reference.py`` (the oracle) beside its kernels;
where an op has several backends, its ``__init__.py`` picks one by name. ``kernels/README.md`` has
the table of ops and the backends each really has, who uses them, their tests, and the measured
numbers with their machines.

Nothing here imports Triton or builds CUDA or C code at import time: backends load when first used.
"""

"""servelab's kernels: each op as a readable PyTorch reference, a Triton kernel and a CUDA kernel.

One folder per op (``kernels/<op>/``), each with ``reference.py`` (the oracle), ``triton.py``,
a ``.cu`` file and a small ``__init__.py`` that picks a backend by name. See ``kernels/README.md``
for the table of ops, backends and chapters, and how to run their tests.

Nothing here imports Triton or builds CUDA code at import time: backends load when first used.
"""

"""Figures for the chapters: `render_*(...) -> matplotlib Figure`, and thin ipywidgets players over
them.

One module per topic (sampling, memory, engine traces, ..., parallel: chapter 08's splits and
replicas); every widget wraps a `render_*` function, so the same picture works without widgets (CI,
GitHub preview).
"""

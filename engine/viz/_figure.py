"""What every figure module needs: a figure pyplot does not keep,
and an error that names the field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt


def new_figure(figsize, nrows: int = 1, ncols: int = 1, **kw):
    """(fig, axes [nrows, ncols]): pyplot does not keep the figure;
    we return it and the notebook shows it once."""
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False, layout="constrained",
                             **kw)
    plt.close(fig)
    return fig, axes


def fail(func: str, field: str, message: str):
    """Raise the ValueError every renderer uses for bad input: "render_x: field what is wrong"."""
    raise ValueError(f"{func}: {field} {message}")


def need_rows(func: str, rows: Sequence[Mapping], keys: Sequence[str]) -> None:
    """Measured rows for a renderer: at least one, each with every key it draws (else `fail`)."""
    if not rows:
        fail(func, "rows", "is empty: give at least one measured row")
    missing = sorted({k for r in rows for k in keys if k not in r})
    if missing:
        fail(func, "rows", f"lack the key(s) {missing}; each row needs {list(keys)}")

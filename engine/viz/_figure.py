"""What every figure module needs: a figure pyplot does not keep,
and an error that names the field."""

from __future__ import annotations

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

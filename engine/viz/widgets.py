"""Sliders over a figure, drawn as a PNG in an `ipywidgets.Image` (no Output widget).

Every player in engine/viz is the same idea: some controls, and a ``render(**values) -> Figure``
redrawn whenever one of them moves. ``interactive_figure`` builds that picture::

    controls (sliders, menus)  --value changes-->  render(**values)  -->  PNG  -->  Image widget
                                                    (ValueError: its message in a label instead)

Why not ``ipywidgets.interactive_output``? It draws into an *Output* widget, and a notebook
executor (nbclient, which runs ``jupyter nbconvert --execute``, nbmake and papermill) imitates that
widget by sending a message back to the kernel, on the shell channel, while it waits on that same
socket for the cell's reply. Now and then the reply's wake-up is lost and the executor sits idle
until the cell's timeout runs out, then goes on as if nothing happened (jupyter/nbclient issue
312; PR 311 is not merged). An Image widget only receives messages: no executor ever answers it, so
there is nothing to race. In Jupyter, VS Code or Colab the sliders work the same way.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping

from matplotlib.figure import Figure

# pixels per inch of the PNG: the size a notebook's inline backend draws figures at
FIGURE_DPI = 100


def figure_png(fig: Figure, dpi: int = FIGURE_DPI) -> bytes:
    """The figure as PNG bytes, trimmed to what is drawn (as the inline backend shows it)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def interactive_figure(render: Callable[..., Figure], controls: Mapping):
    """A widget showing ``render(**{name: control.value})``, redrawn whenever a control changes.

    controls: {keyword of render: an ipywidgets control with a ``value``}. When ``render`` raises
    ValueError (a combination the figure cannot take), the last picture stays and a line under it
    says why. Needs ipywidgets (imported here, so engine/viz works without it).
    """
    import ipywidgets as widgets

    image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", height="auto"))
    message = widgets.Label()

    def redraw(_change=None) -> None:
        try:
            image.value = figure_png(render(**{k: c.value for k, c in controls.items()}))
            message.value = ""
        except ValueError as err:
            message.value = f"Cannot draw this: {err}"

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([image, message])

"""engine/viz/widgets.py: sliders over a figure drawn as a PNG in an Image widget (no Output widget,
so notebook executors have nothing to answer and cannot stall on it)."""

import pytest

widgets = pytest.importorskip("ipywidgets", reason="the players need ipywidgets")

from engine.viz._figure import new_figure  # noqa: E402
from engine.viz.widgets import figure_png, interactive_figure  # noqa: E402


def _bar(height: int):
    if height < 0:
        raise ValueError(f"height must be >= 0, got {height}")
    fig, axes = new_figure((2.0, 2.0))
    axes[0][0].bar([0], [height])
    axes[0][0].set_ylim(0, 10)
    return fig


def test_the_picture_is_the_render_of_the_controls_current_values():
    slider = widgets.IntSlider(value=3, min=-5, max=10)
    box = interactive_figure(lambda height: _bar(height), {"height": slider})
    image, message = box.children
    assert isinstance(image, widgets.Image) and image.value == figure_png(_bar(3))
    slider.value = 7
    assert image.value == figure_png(_bar(7)) != figure_png(_bar(3))
    assert message.value == ""


def test_a_value_the_figure_cannot_take_keeps_the_last_picture_and_says_why():
    slider = widgets.IntSlider(value=2, min=-5, max=10)
    image, message = interactive_figure(lambda height: _bar(height), {"height": slider}).children
    slider.value = -1
    assert image.value == figure_png(_bar(2))
    assert message.value == "Cannot draw this: height must be >= 0, got -1"
    slider.value = 4
    assert image.value == figure_png(_bar(4)) and message.value == ""


def test_the_png_is_a_png():
    assert figure_png(_bar(1)).startswith(b"\x89PNG\r\n\x1a\n")

"""The engine's one progress bar: right in a terminal, in a live notebook, and in a saved one.

`tqdm.auto` gives a Jupyter *widget* inside a kernel. A widget is drawn by the browser, and a
notebook executed headless (nbconvert, nbmake: what `make test` runs) and then shown as a static
page (GitHub, HTML) keeps only the text the widget had when it was first displayed:

    generate:   0%|          | 0/8 [00:00<?, ?req/s]        <- frozen there, though the run finished

So inside a kernel we draw tqdm's plain text bar ourselves, as ONE display output that every
refresh replaces (`update_display_data`). A live notebook shows it moving; a saved notebook keeps
its last state (nbclient applies the updates to the stored output), so a static page shows 100 %.
It is display data, not stderr, so it is not painted red either. Outside a kernel (a terminal,
pytest, a script) it is the plain tqdm bar on stderr.
"""

from __future__ import annotations

import sys

from tqdm.std import tqdm as text_tqdm

NOTEBOOK_COLUMNS = 80  # a notebook output has no terminal to ask for its width; 80 fits any cell


class _Discard:
    """Where tqdm's own stream writes go in a kernel: we display the bar instead. It claims UTF-8,
    so tqdm draws the smooth block bar, which every notebook font has."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class NotebookTextBar(text_tqdm):
    """tqdm's text bar shown as one display output, updated in place on every refresh."""

    def __init__(self, *args, **kwargs):
        self._handle = None  # the display output, made at the first refresh
        kwargs.setdefault("file", _Discard())
        kwargs.setdefault("ncols", NOTEBOOK_COLUMNS)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        from IPython.display import display  # we only get here inside a kernel

        text = {"text/plain": self.__str__() if msg is None else msg}
        if self._handle is None:
            self._handle = display(text, raw=True, display_id=True)
        else:
            self._handle.update(text, raw=True)
        return True


def in_jupyter_kernel() -> bool:
    """Are we running inside a Jupyter kernel (live or headless), not a terminal IPython?"""
    ipython = sys.modules.get("IPython")  # never imported here: a script has no IPython
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def progress_bar(*args, **kwargs) -> text_tqdm:
    """A tqdm progress bar (the same arguments as `tqdm.tqdm`) that a static render of a notebook
    shows finished: the text bar as one updated display output in a kernel, else plain tqdm."""
    bar_class = NotebookTextBar if in_jupyter_kernel() else text_tqdm
    return bar_class(*args, **kwargs)

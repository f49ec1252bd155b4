"""engine.progress: the bar a saved notebook shows finished, and plain tqdm outside a kernel."""

import io
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from tqdm.std import tqdm as text_tqdm

from engine import progress

REPO = Path(__file__).resolve().parents[1]
KERNEL_TIMEOUT_S = 120  # starting a kernel on a busy 2-core machine


def test_outside_a_kernel_the_bar_is_plain_tqdm_text_on_its_stream():
    stream = io.StringIO()
    with progress.progress_bar(total=4, file=stream, desc="generate") as bar:
        bar.update(4)
    assert type(bar) is text_tqdm and not progress.in_jupyter_kernel()
    assert "generate: 100%" in stream.getvalue() and "4/4" in stream.getvalue()


class _FakeHandle:
    def __init__(self, shown):
        self.shown = shown

    def update(self, obj, raw=False):
        assert raw
        self.shown.append(("update", obj["text/plain"]))


def test_in_a_kernel_the_bar_is_one_display_output_updated_until_it_reads_100_percent(monkeypatch, capsys):
    import IPython.display

    shown = []

    def fake_display(obj, raw=False, display_id=False):
        assert raw and display_id is True
        shown.append(("display", obj["text/plain"]))
        return _FakeHandle(shown)

    monkeypatch.setattr(IPython.display, "display", fake_display)
    monkeypatch.setattr(progress, "in_jupyter_kernel", lambda: True)
    with progress.progress_bar(total=3, desc="tasks", mininterval=0) as bar:
        for _ in range(3):
            bar.update(1)
    kinds = [kind for kind, _ in shown]
    assert kinds[0] == "display" and set(kinds[1:]) == {"update"}  # one output, then updates of it
    assert shown[0][1].startswith("tasks:   0%") and shown[-1][1].startswith("tasks: 100%")
    assert "3/3" in shown[-1][1] and all(len(text) <= progress.NOTEBOOK_COLUMNS for _, text in shown)
    assert capsys.readouterr().err == ""  # nothing on stderr (a notebook paints it red)


def test_a_disabled_bar_in_a_kernel_shows_nothing(monkeypatch):
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: pytest.fail("displayed a disabled bar"))
    monkeypatch.setattr(progress, "in_jupyter_kernel", lambda: True)
    with progress.progress_bar(total=3, disable=True) as bar:
        bar.update(3)


def test_a_notebook_executed_headless_keeps_the_bar_at_100_percent():
    """What a static render (GitHub, nbconvert HTML) shows is the saved output: it must be the
    finished bar, not tqdm.auto's widget frozen at 0 %."""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(
        "from engine.progress import progress_bar\n"
        "for _ in progress_bar(range(5), desc='generate', mininterval=0):\n"
        "    pass"))
    NotebookClient(nb, timeout=KERNEL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = nb.cells[0].outputs
    assert [o.output_type for o in outputs] == ["display_data"], outputs  # one output, no stderr
    text = outputs[0].data["text/plain"]
    assert text.startswith("generate: 100%") and "5/5" in text, text
    assert "application/vnd.jupyter.widget-view+json" not in outputs[0].data


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

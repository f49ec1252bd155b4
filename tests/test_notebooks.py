"""Notebooks are committed clean: no outputs, no execution counts (nbmake runs them in `make test`)."""

import json
from pathlib import Path

import pytest

CHAPTERS = sorted((Path(__file__).parent.parent / "chapters").glob("*.ipynb"))


def test_there_are_chapter_notebooks():
    assert CHAPTERS, "chapters/ holds no notebooks"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"])
             if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; strip them (jupyter nbconvert --clear-output)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_notebook_defines_no_library_code(path):
    """Notebooks import from engine/kernels; they do not define functions or classes of their own."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        assert not any(line.startswith(("def ", "class ")) for line in src.splitlines()), \
            f"{path.name} defines library code in a cell:\n{src[:200]}"

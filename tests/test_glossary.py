"""The glossary (chapters/GLOSSARY.md) points only at things that exist: every notebook it links, every
engine file it names, every exercise it cites; and every chapter's opening cell links to it."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLOSSARY = ROOT / "chapters" / "GLOSSARY.md"


def test_every_link_path_and_exercise_in_the_glossary_exists():
    text = GLOSSARY.read_text()
    notebooks = set(re.findall(r"\]\((\d\d_[a-z_]+\.ipynb)\)", text))
    paths = set(re.findall(r"`((?:engine|kernels)/[\w/]+\.py)`", text))
    exercises = set(re.findall(r"`(ch\d\d)`", text))
    assert notebooks and paths and exercises
    assert [n for n in notebooks if not (ROOT / "chapters" / n).exists()] == []
    assert [p for p in paths if not (ROOT / p).exists()] == []
    assert [e for e in exercises if not list((ROOT / "exercises").glob(f"{e}_*.py"))] == []


def test_every_chapter_opens_with_a_link_to_the_glossary():
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        first = next(c for c in cells if c["cell_type"] == "markdown")
        assert "GLOSSARY.md" in "".join(first["source"]), path.name

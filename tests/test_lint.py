"""The code keeps the project's style rules: `ruff check` (pyproject.toml: pycodestyle, pyflakes, import
order, bugbear, pyupgrade; 100-character lines in engine/, kernels/ and exercises/) finds nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["engine", "kernels", "exercises", "tests", "benchmarks"]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (requirements-dev.txt installs it)")
    done = subprocess.run([ruff, "check", "--no-cache", *FOLDERS], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

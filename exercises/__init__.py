"""Exercises, one chapter at a time, and the machinery that checks them.

Each chapter NN has three files, found by name:

    exercises/chNN_<topic>.py            your file: stubs raising NotImplementedError with a hint
    exercises/solutions/chNN_<topic>.py  the reference answers, same signatures
    exercises/checks/chNN.py             the checks, written once and run against either of them

A check is a top-level function `check_<claim>(module)` in the checks file; it raises (usually an
AssertionError saying what went wrong) when the module gets something wrong. We run them in the
order they are written. From a terminal:

    python -m exercises list
    python -m exercises check ch01              # your file
    python -m exercises check ch01 --solutions  # the reference

and from Python (a notebook, a test): `run_checks("ch01")`, which re-imports your file each time
so that edits show up without restarting the kernel.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent
CHAPTER_RE = re.compile(r"(?:ch)?(\d{1,2})")  # "ch01", "01" and "1" all name chapter 01
CHECK_PREFIX = "check_"

__all__ = ["CheckResult", "exercise_path", "list_chapters", "load_checks", "load_module",
           "run_checks"]


@dataclass(frozen=True)
class CheckResult:
    # the check's function name without "check_": a claim, e.g. "top_p_keeps_the_boundary_token"
    name: str
    passed: bool
    reason: str = ""  # why it failed; empty when it passed


def list_chapters() -> list[str]:
    """Every chapter that has a checks file, e.g. ["ch01", "ch03"]."""
    return sorted(path.stem for path in (PACKAGE_DIR / "checks").glob("ch[0-9][0-9].py"))


def _chapter_name(chapter: str | int) -> str:
    match = CHAPTER_RE.fullmatch(str(chapter).strip().lower())
    name = f"ch{int(match.group(1)):02d}" if match else None
    if name not in list_chapters():
        raise ValueError(f"chapter={chapter!r} has no exercises: choose one of {list_chapters()}")
    return name


def _import_fresh(name: str) -> ModuleType:
    """Import a module, or re-import it if it was loaded before (so edits to it take effect)."""
    if name in sys.modules:
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def exercise_path(chapter: str | int, solutions: bool = False) -> Path:
    """The file that holds a chapter's stubs (or, with solutions=True, its reference answers)."""
    name = _chapter_name(chapter)
    folder = PACKAGE_DIR / "solutions" if solutions else PACKAGE_DIR
    matches = sorted(folder.glob(f"{name}_*.py"))
    if len(matches) != 1:
        raise FileNotFoundError(f"expected exactly one {folder}/{name}_<topic>.py, "
                                f"found {len(matches)}")
    return matches[0]


def load_module(chapter: str | int, solutions: bool = False) -> ModuleType:
    """Your module for a chapter (or the reference one), freshly imported."""
    package = "exercises.solutions" if solutions else "exercises"
    return _import_fresh(f"{package}.{exercise_path(chapter, solutions).stem}")


def load_checks(chapter: str | int) -> list[tuple[str, Callable[[ModuleType], None]]]:
    """(claim, check function) pairs of a chapter, in the order the checks file defines them."""
    checks = _import_fresh(f"exercises.checks.{_chapter_name(chapter)}")
    return [
        (name.removeprefix(CHECK_PREFIX), fn)
        for name, fn in vars(checks).items()
        if name.startswith(CHECK_PREFIX) and callable(fn) and fn.__module__ == checks.__name__
    ]


def _source_files(target) -> set[str]:
    """The files the module under test is written in: its own file, and (for a namespace of
    functions and classes, as the tests build) the files those are defined in."""
    files = {str(Path(target.__file__).resolve())} if getattr(target, "__file__", None) else set()
    for value in vars(target).values():
        if inspect.isfunction(value) or inspect.isclass(value):
            try:
                files.add(str(Path(inspect.getfile(value)).resolve()))
            except (TypeError, OSError):  # a builtin class: no file of its own
                pass
    return files


def _where_in(err: Exception, files: set[str]) -> str:
    """`path:line in function: source` of the last traceback frame inside `files`, or ""."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if str(Path(f.filename).resolve()) in files]
    if not frames:
        return ""
    frame = frames[-1]
    path = Path(frame.filename).resolve()
    shown = (path.relative_to(PACKAGE_DIR.parent) if path.is_relative_to(PACKAGE_DIR.parent)
             else path)
    return f"{shown}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _failure_reason(err: Exception, files: set[str] = frozenset()) -> str:
    """Why a check failed. A check's own assertion speaks for itself; an error raised inside the
    student's code also says where: the last line of their file that ran, so they can go there."""
    if isinstance(err, NotImplementedError):
        return f"not implemented yet: {err}".rstrip(": ")
    where = _where_in(err, files)
    if isinstance(err, AssertionError) and str(err) and not where:
        return str(err)
    message = f"{type(err).__name__}: {err}".rstrip(": ")
    return f"{message}\n  at {where}" if where else message


def run_checks(chapter: str | int, solutions: bool = False,
               module: ModuleType | None = None) -> list[CheckResult]:
    """Run every check of a chapter against your module, the reference (solutions=True), or any
    object with the right functions (module=...). A check that raises anything fails; the rest
    still run. An error raised inside the module's code names its file and line in the reason."""
    target = module if module is not None else load_module(chapter, solutions)
    files = _source_files(target)
    results = []
    for name, check in load_checks(chapter):
        try:
            check(target)
        except Exception as err:  # noqa: BLE001 - any error in the student's code is a failed check
            results.append(CheckResult(name, False, _failure_reason(err, files)))
        else:
            results.append(CheckResult(name, True))
    return results

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
    python -m exercises check ch01 --hint       # the same, with the fuller hints
    python -m exercises check ch01 --solutions  # the reference

and from Python (a notebook, a test): `print(format_results(run_checks("ch01")))`; run_checks
re-imports your file each time so that edits show up without restarting the kernel.

Every exercise has two hints: a question in the stub's NotImplementedError (the check table shows
it), and the recipe in exercises/hints.py, which `--hint` (or `format_hints`) prints for each
function a failing check used.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from exercises.hints import FULL_HINTS

PACKAGE_DIR = Path(__file__).resolve().parent
CHAPTER_RE = re.compile(r"(?:ch)?(\d{1,2})")  # "ch01", "01" and "1" all name chapter 01
CHECK_PREFIX = "check_"

TABLE_WIDTH = 100  # columns of a check table: a terminal's or a notebook cell's width
REASON_INDENT = 6  # a reason goes under its check's name, after "FAIL  "
SAME_AS_ABOVE = '" (same as above)'  # a stub's hint is shown once, not once per check it fails

__all__ = ["CheckResult", "exercise_path", "format_hints", "format_results", "list_chapters",
           "load_checks", "load_module", "run_checks"]


@dataclass(frozen=True)
class CheckResult:
    # the check's function name without "check_": a claim, e.g. "top_p_keeps_the_boundary_token"
    name: str
    passed: bool
    reason: str = ""  # why it failed; empty when it passed
    # (function, its level-2 hint) for the functions of the module this failed check used that
    # have one: only the unimplemented one when it raised NotImplementedError
    hints: tuple[tuple[str, str], ...] = ()


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


def _raising_function(err: Exception, files: set[str]) -> str:
    """The qualified name ("top_p_filter", "TokenBucket.refill") of the last function inside
    `files` that the error passed through, or ""."""
    names, tb = [], err.__traceback__
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()) in files:
            names.append(tb.tb_frame.f_code.co_qualname)
        tb = tb.tb_next
    return names[-1] if names else ""


def _failure_reason(err: Exception, files: set[str] = frozenset()) -> str:
    """Why a check failed. A check's own assertion speaks for itself; an error raised inside the
    student's code also says where: the last line of their file that ran, so they can go there.
    An unwritten stub names itself and asks its question (the level-1 hint)."""
    if isinstance(err, NotImplementedError):
        function = _raising_function(err, files)
        return f"not implemented yet{f' ({function})' if function else ''}: {err}".rstrip(": ")
    where = _where_in(err, files)
    if isinstance(err, AssertionError) and str(err) and not where:
        return str(err)
    message = f"{type(err).__name__}: {err}".rstrip(": ")
    return f"{message}\n  at {where}" if where else message


class _NameRecorder:
    """Stands in for the module under test and notes which of its names a check looks up, so that
    a failed check can offer the hints of exactly the functions it used."""

    def __init__(self, module):
        object.__setattr__(self, "_recorded_module", module)
        object.__setattr__(self, "_recorded_names", [])

    def __getattr__(self, name: str):
        value = getattr(self._recorded_module, name)  # an AttributeError is the check's to see
        if name not in self._recorded_names:
            self._recorded_names.append(name)
        return value


def _hints_for(chapter: str, err: Exception, files: set[str],
               used: list[str]) -> tuple[tuple[str, str], ...]:
    """(function, level-2 hint) pairs for a failed check: the unwritten stub alone when it was
    one, else every function (or every method of a class) the check used, in order of first use."""
    raising = _raising_function(err, files) if isinstance(err, NotImplementedError) else ""
    names = [raising] if raising else used
    table = FULL_HINTS.get(chapter, {})
    picked = [key for name in names for key in table if key == name or key.startswith(f"{name}.")]
    return tuple((key, table[key]) for key in dict.fromkeys(picked))


def run_checks(chapter: str | int, solutions: bool = False,
               module: ModuleType | None = None) -> list[CheckResult]:
    """Run every check of a chapter against your module, the reference (solutions=True), or any
    object with the right functions (module=...). A check that raises anything fails; the rest
    still run. An error raised inside the module's code names its file and line in the reason;
    a failed check carries the level-2 hints of the functions it used (see `format_hints`)."""
    name = _chapter_name(chapter)
    target = module if module is not None else load_module(name, solutions)
    files = _source_files(target)
    results = []
    for claim, check in load_checks(name):
        recorder = _NameRecorder(target)
        try:
            check(recorder)
        except Exception as err:  # noqa: BLE001 - any error in the student's code is a failed check
            hints = _hints_for(name, err, files, recorder._recorded_names)
            results.append(CheckResult(claim, False, _failure_reason(err, files), hints))
        else:
            results.append(CheckResult(claim, True))
    return results


def _wrap(text: str, indent: int, width: int) -> list[str]:
    """`text` wrapped at word boundaries (a long word or path stays whole), each of its own lines
    on its own, every line indented by `indent` spaces."""
    pad = " " * indent
    lines = []
    for line in text.splitlines() or [""]:
        lines += textwrap.wrap(line, width, initial_indent=pad, subsequent_indent=pad,
                               break_long_words=False, break_on_hyphens=False) or [pad]
    return lines


def format_results(results: list[CheckResult], width: int = TABLE_WIDTH) -> str:
    """The results as text: one line per check (PASS or FAIL and its claim), a failed check's
    reason under it, wrapped at word boundaries to `width` columns (never cut mid-word). A reason
    equal to the one above (a stub's hint, failing several checks) is not repeated.

        FAIL  top_p_keeps_the_boundary_token
              not implemented yet (top_p_filter): in probabilities sorted from most to least
              likely, where does the running total first reach p? ...
        PASS  top_p_of_one_keeps_every_token
    """
    lines, previous = [], None
    for r in results:
        lines.append(f"{'PASS' if r.passed else 'FAIL'}  {r.name}")
        if r.reason:
            reason = SAME_AS_ABOVE if r.reason == previous else r.reason
            lines += _wrap(reason, REASON_INDENT, width)
        previous = r.reason
    return "\n".join(lines)


def format_hints(results: list[CheckResult], width: int = TABLE_WIDTH) -> str:
    """The level-2 hint of each function the failed checks used, once each, in order; "" when
    none of them has one (every check passed, or the module has no hinted functions)."""
    seen = dict(pair for r in results if not r.passed for pair in r.hints)
    blocks = [[function, *_wrap(hint, REASON_INDENT, width)] for function, hint in seen.items()]
    return "\n".join(line for block in blocks for line in block)

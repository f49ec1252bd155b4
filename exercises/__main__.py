"""`python -m exercises list` and `python -m exercises check chNN [--hint] [--solutions]`.

`check` prints one line per check, a failed check's reason under it (for a stub not written yet,
the stub's question: the level-1 hint), and exits with status 1 if any check failed:

    PASS  temperature_divides_the_logits
    FAIL  top_p_keeps_the_boundary_token
          not implemented yet (top_p_filter): in probabilities sorted from most to least likely,
          where does the running total first reach p? ...

`--hint` adds, under the table, the level-2 hint (exercises/hints.py) of each function a failing
check used.
"""

from __future__ import annotations

import argparse
import sys

from exercises import (
    PACKAGE_DIR,
    exercise_path,
    format_hints,
    format_results,
    list_chapters,
    run_checks,
)


def check(chapter: str, solutions: bool, hint: bool = False) -> int:
    path = exercise_path(chapter, solutions).relative_to(PACKAGE_DIR.parent)
    print(f"checking {path}\n")
    results = run_checks(chapter, solutions=solutions)
    print(format_results(results))
    passed = sum(r.passed for r in results)
    print(f"\n{passed}/{len(results)} checks passed.")
    hints = format_hints(results)
    if hint and hints:
        print(f"\nThe fuller hints, for the functions the failing checks used:\n\n{hints}")
    if passed < len(results) and not solutions:
        print(f"Edit {path} and run this command again.")
        if hints and not hint:
            print(f"Stuck? `python -m exercises check {chapter} --hint` adds a fuller hint\n"
                  "for each function a failing check used.")
    return 0 if passed == len(results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exercises",
                                     description="Check the chapter exercises.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the chapters that have exercises")
    run = commands.add_parser("check", help="run a chapter's checks and print a table")
    run.add_argument("chapter", help="e.g. ch01 (or 1)")
    run.add_argument("--solutions", action="store_true",
                     help="check the reference solutions instead")
    run.add_argument("--hint", action="store_true",
                     help="also print the fuller hint of each function a failing check used")
    args = parser.parse_args(argv)
    if args.command == "list":
        for chapter in list_chapters():
            print(f"{chapter}  {exercise_path(chapter).name}")
        return 0
    try:
        return check(args.chapter, args.solutions, args.hint)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`python -m exercises list` and `python -m exercises check chNN [--solutions]`.

`check` prints one row per check and exits with status 1 if any check failed:

    check                              result  reason
    temperature_divides_the_logits     PASS
    top_p_keeps_the_boundary_token     FAIL    not implemented yet: sort the probabilities ...
"""

from __future__ import annotations

import argparse
import sys

from exercises import PACKAGE_DIR, CheckResult, exercise_path, list_chapters, run_checks

RESULT_COLUMN = 8  # wide enough for "result" plus a gap
# a stub's hint is shown once, not once per check of that function
SAME_AS_ABOVE = '" (same as above)'


def format_table(results: list[CheckResult]) -> str:
    """The results as aligned text; a multi-line reason continues under the reason column."""
    width = max([len("check"), *(len(r.name) for r in results)]) + 2
    lines = ["check".ljust(width) + "result".ljust(RESULT_COLUMN) + "reason"]
    previous = None
    for r in results:
        reason = SAME_AS_ABOVE if r.reason and r.reason == previous else r.reason
        previous = r.reason
        first, *rest = reason.splitlines() or [""]
        verdict = "PASS" if r.passed else "FAIL"
        lines.append((r.name.ljust(width) + verdict.ljust(RESULT_COLUMN) + first).rstrip())
        lines += [" " * (width + RESULT_COLUMN) + more for more in rest]
    return "\n".join(lines)


def check(chapter: str, solutions: bool) -> int:
    path = exercise_path(chapter, solutions).relative_to(PACKAGE_DIR.parent)
    print(f"checking {path}\n")
    results = run_checks(chapter, solutions=solutions)
    print(format_table(results))
    passed = sum(r.passed for r in results)
    print(f"\n{passed}/{len(results)} checks passed.")
    if passed < len(results) and not solutions:
        print(f"Edit {path} and run this command again.")
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
    args = parser.parse_args(argv)
    if args.command == "list":
        for chapter in list_chapters():
            print(f"{chapter}  {exercise_path(chapter).name}")
        return 0
    try:
        return check(args.chapter, args.solutions)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

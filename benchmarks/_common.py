"""Helpers every benchmark shares: describe the machine, write rows as JSON and markdown.

A number without the machine it was measured on means little, so each result file starts with
``describe_machine()``. Results go to ``benchmarks/results/<name>.json`` and ``<name>.md``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

if str(REPO_ROOT) not in sys.path:  # `python benchmarks/x.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(REPO_ROOT))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> dict:
    """CPU model and cores, OS, Python, torch, and the GPU if there is one."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": gpu,
    }


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def write_results(name: str, rows: list[dict], settings: dict, notes: str = "") -> tuple[Path, Path]:
    """Write ``results/<name>.json`` (machine, settings, rows) and ``results/<name>.md``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    json_path, md_path = RESULTS_DIR / f"{name}.json", RESULTS_DIR / f"{name}.md"
    payload = {"benchmark": name, "machine": machine, "settings": settings, "rows": rows}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    header = f"# {name}\n\n" + (f"{notes.strip()}\n\n" if notes else "")
    machine_line = "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if v is not None)
    settings_line = "Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items())
    md_path.write_text(f"{header}{machine_line}\n\n{settings_line}\n\n{markdown_table(rows)}")
    return json_path, md_path


if __name__ == "__main__":  # `make bench` runs every file here; this one only says where it runs
    print(json.dumps(describe_machine(), indent=2))

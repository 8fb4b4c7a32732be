#!/usr/bin/env bash
# Create (or update) a virtual environment with everything this repository needs
# on a CPU machine: the pinned CPU torch (first), the core, the first-party
# plugins (each its own distribution), example plugins, the dev tools and the
# TorchTitan 0.2.2 reference for the numerics tests.
#
#   scripts/bootstrap.sh [VENV]        (default: .venv)      PYTHON=python3.11 to choose the interpreter
#
# One line per stage, with its time; pip's own output goes to $VENV/bootstrap.log (this
# run's, stage after stage). A stage that fails prints the log's last lines and its
# path, and the script exits with the stage's status.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
TAIL_LINES=30

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

now_us() {  # wall clock in microseconds (bash 5's EPOCHREALTIME; whole seconds on older bash)
    local t="${EPOCHREALTIME:-}"
    if [ -n "$t" ]; then echo "${t/[.,]/}"; else echo $((SECONDS * 1000000)); fi
}

# stage LABEL COMMAND...: run COMMAND with its output appended to $LOG, print
# "==> LABEL ... 12.3 s"; on failure the log's tail, its path, and exit with the status.
stage() {
    local label="$1" start elapsed status=0
    shift
    printf '==> %s ... ' "$label"
    printf '\n==> %s: %s\n' "$label" "$*" >>"$LOG"
    start="$(now_us)"
    "$@" >>"$LOG" 2>&1 || status=$?
    elapsed=$(($(now_us) - start))
    elapsed="$((elapsed / 1000000)).$((elapsed % 1000000 / 100000)) s"
    if [ "$status" -eq 0 ]; then
        echo "$elapsed"
        return 0
    fi
    echo "failed after $elapsed (exit $status)"
    {
        echo "---- the last $TAIL_LINES lines of $LOG:"
        tail -n "$TAIL_LINES" "$LOG"
        echo "----"
        echo "error: bootstrap stage '$label' failed; its whole output is in $LOG"
    } >&2
    exit "$status"
}

mkdir -p "$VENV"
LOG="$VENV/bootstrap.log"
echo "# scripts/bootstrap.sh $VENV, $(date -u '+%Y-%m-%d %H:%M:%S UTC')" >"$LOG"
echo "==> setting up $VENV (pip's output: $LOG)"

if [ ! -x "$VENV/bin/python" ]; then
    PY="$(pick_python)"
    stage "virtual environment ($PY)" "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
CONSTRAINT=(-c "$ROOT/requirements/constraints.txt")

# torch first, so nothing pulls a CUDA build. Few retries: where the PyTorch CPU index
# is unreachable (a closed network with a local wheel store), pip falls back to the
# local wheel instead of waiting minutes.
stage "torch (CPU build, pinned)" pip install --retries 1 --timeout 10 -r "$ROOT/requirements/torch-cpu.txt"
stage "dev tools" pip install "${CONSTRAINT[@]}" -r "$ROOT/requirements/dev.txt"
stage "the core (titan-plugins)" pip install "${CONSTRAINT[@]}" -e "$ROOT"

for dir in "$ROOT"/plugins/*/ "$ROOT"/examples/*/; do
    dir="${dir%/}"
    if [ -f "$dir/pyproject.toml" ]; then
        stage "plugin ${dir#"$ROOT"/}" pip install "${CONSTRAINT[@]}" -e "$dir"
    fi
done

torchtitan_reference() {  # its import deps, then the package itself without its pins
    pip install "${CONSTRAINT[@]}" -r "$ROOT/requirements/torchtitan-ref.txt" &&
        pip install "${CONSTRAINT[@]}" --no-deps torchtitan==0.2.2
}
stage "TorchTitan 0.2.2 (numerics reference; --no-deps) and its import deps" torchtitan_reference

"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch 2.13.0, got {torch.__version__}"
assert not torch.version.cuda, "a CUDA torch was installed"
print(f"==> ready: torch {torch.__version__}")
PY

"""scripts/bootstrap.sh (``make venv``, CI's .ci/run) prints one line per stage with
its time and keeps pip's output in ``$VENV/bootstrap.log``; a failing stage prints the
log's last lines and its path and stops with the stage's status.

The real script runs against a virtual environment whose ``bin/python`` is a stub: pip
calls print a wall of output (and fail where told), so nothing is installed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/usr/bin/env bash
if [ "$1" = "-m" ]; then  # python -m pip ...: a wall of output, failing where FAIL_ON matches
    for i in $(seq 1 200); do echo "pip noise $i"; done
    case "$*" in *"$FAIL_ON"*) echo "ERROR: No matching distribution found for bogus" >&2; exit 3;; esac
    exit 0
fi
cat >/dev/null  # the final check's script on stdin
echo "==> ready: torch stub"
"""
STAGE = re.compile(r"^==> (.+) \.\.\. \d+\.\d s$")


def _bootstrap(tmp_path: Path, fail_on: str) -> tuple[subprocess.CompletedProcess, Path]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(STUB)
    (venv / "bin" / "python").chmod(0o755)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap.sh"), str(venv)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "FAIL_ON": fail_on})
    return result, venv / "bootstrap.log"


def test_one_line_per_stage_and_pip_output_in_the_log(tmp_path):
    result, log = _bootstrap(tmp_path, fail_on="no stage has this")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"==> setting up {tmp_path / 'venv'} (pip's output: {log})"
    assert lines[-1] == "==> ready: torch stub"
    stages = [STAGE.match(line) for line in lines[1:-1]]
    assert all(stages), lines
    names = [m.group(1) for m in stages]
    assert names[:3] == ["torch (CPU build, pinned)", "dev tools", "the core (titan-plugins)"]
    assert "plugin plugins/qwen3" in names and names[-1].startswith("TorchTitan 0.2.2")
    assert "pip noise" not in result.stdout + result.stderr
    text = log.read_text()
    assert text.count("pip noise 200") == len(names) + 1  # the TorchTitan stage: two pip calls
    assert "==> dev tools: pip install -c " in text


def test_a_failing_stage_prints_the_logs_tail_and_its_path(tmp_path):
    result, log = _bootstrap(tmp_path, fail_on="dev.txt")
    assert result.returncode == 3
    lines = result.stdout.splitlines()
    assert STAGE.match(lines[1]) and lines[1].startswith("==> torch (CPU build, pinned) ... ")
    assert re.fullmatch(r"==> dev tools \.\.\. failed after \d+\.\d s \(exit 3\)", lines[2]), lines
    assert len(lines) == 3  # nothing after the failing stage
    err = result.stderr.splitlines()
    tail = err[err.index(f"---- the last 30 lines of {log}:") + 1:err.index("----")]
    assert tail == [f"pip noise {i}" for i in range(172, 201)] + ["ERROR: No matching distribution found for bogus"]
    assert err[-1] == f"error: bootstrap stage 'dev tools' failed; its whole output is in {log}"

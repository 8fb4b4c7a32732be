"""fault_tolerance=torchft without processes: what titan-run refuses before launch (one
line, exit 2, nothing written), how the live participants share a global batch, and the
run summary's line."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from titan_plugins.distributed.fault_tolerance import share
from titan_plugins.distributed.ft_supervisor import steps_by_participants, summary_line
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.train.api import _patched_env, prepare_job, rank_env

BASE = ["model=tiny", "training.seq_len=32", "fault_tolerance=torchft"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("overrides, message", [
    (["fault_tolerance.min_replicas=3"],
     "fault_tolerance.min_replicas=3 is more than fault_tolerance.replica_groups=2: no step could ever commit"),
    (["fault_tolerance.replica_groups=0"], "fault_tolerance.replica_groups=0 must be"),
    (["parallelism=hsdp2_fsdp2"],
     "fault_tolerance=torchft with parallelism.dp_replicate=2: the replica groups are the replicate dimension"),
    (["parallelism=pp2"], "fault_tolerance=torchft with parallelism.pp=2: pipeline stages inside a replica "
                          "group are not supported yet"),
    (["parallelism=fsdp2", "fault_tolerance.group_size=4"], "fault_tolerance.group_size=4 but parallelism="),
    (["objective=dpo", "data=preference_sample"], "fault_tolerance=torchft with objective=dpo: only"),
    (["fault_tolerance.lighthouse=localhost:PORT"], "fault_tolerance.lighthouse=localhost:PORT: no lighthouse "
                                                    "answers there"),
])
def test_bad_combinations_are_one_line_before_launch(overrides, message):
    port = str(_closed_port())
    overrides = [o.replace("PORT", port) for o in overrides]
    with _patched_env(rank_env(["tiny_plugin"])):
        with pytest.raises(ConfigError) as info:
            prepare_job([*BASE, *overrides], get_plugin_manager(strict=True))
    text = str(info.value)
    assert "\n" not in text and text.startswith(message.replace("PORT", port)), text


def test_titan_run_refuses_with_exit_2_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    env = {**__import__("os").environ, **rank_env(["tiny_plugin"])}
    proc = subprocess.run([sys.executable, "-m", "titan_plugins.cli.run", *BASE, "fault_tolerance.min_replicas=5",
                           f"hydra.run.dir={run_dir}"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: fault_tolerance.min_replicas=5 is more than fault_tolerance.replica_groups=2: no step could ever "
        "commit"]
    assert not run_dir.exists()


def test_torchft_missing_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with _patched_env(rank_env(["tiny_plugin"])):
        with pytest.raises(ConfigError, match=r"needs torchft, which is not installed: pip install "
                                              r"'titan-plugins\[ft\]'$"):
            prepare_job(BASE, get_plugin_manager(strict=True))


@pytest.mark.parametrize("groups, participants, dp", [(2, 2, 1), (2, 1, 1), (3, 2, 1), (3, 2, 2), (4, 3, 2)])
def test_the_live_participants_share_every_row_once(groups, participants, dp):
    global_batch = list(range(2 * groups * dp))  # microbatches: 2 per data-parallel rank of every group
    parts = [share(global_batch, p, participants, d, dp) for p in range(participants) for d in range(dp)]
    assert sorted(x for part in parts for x in part) == global_batch
    assert all(part for part in parts)  # every live rank trains something


def test_the_summary_counts_each_committed_step_once():
    records = [{"step": 1, "participants": 2, "committed": True}, {"step": 1, "participants": 2, "committed": True},
               {"step": 2, "participants": 2, "committed": False}, {"step": 2, "participants": 1, "committed": True},
               {"event": "healed", "step": 3, "replica": 1, "from": 0},
               {"step": 3, "participants": 2, "committed": True}]
    counts = steps_by_participants(records)
    assert counts == {2: 2, 1: 1}
    assert summary_line(counts, 2) == "steps trained with 2 of 2 replicas: 2, with 1 of 2: 1"

"""A run directory is claimed before anything is written into it, on every launch path
(titan-run, ``train.api.run``, a rank under srun/torchrun), and the ranks import what the
launching process imports (issue 24, items 2 and 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.errors import ConfigError

TESTS = str(Path(__file__).parent)
TINY = ["model=tiny", "training.seq_len=32", "training.steps=1", "metrics.tensorboard=false"]
HOLD = ("import sys, time\nfrom titan_plugins.run_dir import hold\n"
        "with hold(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n")


@pytest.fixture
def live_run(tmp_path):
    """A run directory with a live job's files, its lock held by another process."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    files = {run / "config.yaml": "live job's config\n", run / ".hydra" / "config.yaml": "live\n",
             run / "metrics.jsonl": '{"step": 1, "loss": 1.0, "grad_norm": 0.5, "tokens_per_s": 100.0}\n'}
    for path, text in files.items():
        path.write_text(text)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run, files
    proc.kill()
    proc.wait()


def _untouched(run: Path, files: dict[Path, str]) -> None:
    for path, text in files.items():
        assert path.read_text() == text, f"{path.name} was rewritten"
    written = sorted(p.name for p in run.rglob("*") if p not in files and p.name != ".titan.lock")
    assert written == [".hydra"], f"written into the live run directory: {written}"


def test_titan_run_refuses_a_live_run_directory_before_writing(live_run, monkeypatch, capsys):
    from titan_plugins.cli.run import main

    run, files = live_run
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    assert main([*TINY, f"hydra.run.dir={run}"]) == 2
    _untouched(run, files)  # no .hydra/ rewrite, no config.yaml, no run.log, no result.json
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: hydra.run.dir={run}: run directory")
    assert "in use by another live job (pid" in err[0]


def test_api_run_refuses_a_live_run_directory_before_writing(live_run):
    from titan_plugins.train.api import run as api_run

    run, files = live_run
    with pytest.raises(ConfigError, match="in use by another live job"):
        api_run(TINY, run_dir=run, extra_plugins=["tiny_plugin"])
    _untouched(run, files)


def test_rank_0_under_srun_or_torchrun_refuses_before_writing(live_run, monkeypatch):
    from titan_plugins.distributed.external import run_external_rank

    run, files = live_run
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
                       "TITAN_LAUNCHED_BY": "slurm", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"^TITAN_RUN_DIR=.*in use by another live job"):
        run_external_rank(None, run, key="TITAN_RUN_DIR", overrides="", job_name="0")
    _untouched(run, files)


def test_a_launch_shares_its_claim_with_its_own_child(tmp_path):
    # train.api.run holds the directory and starts the launcher in a subprocess: the
    # child must not be refused by its parent's claim.
    from titan_plugins.run_dir import OWNER_ENV, child_env, owned

    code = "import sys\nfrom titan_plugins.run_dir import take\nprint(take(sys.argv[1]))\n"
    with owned(tmp_path):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                             env={**os.environ, **child_env(tmp_path)})
        assert out.stdout.strip() == "False", out.stderr
        other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                               env={k: v for k, v in os.environ.items() if k != OWNER_ENV})
        assert "in use by another live job" in other.stderr


@pytest.mark.slow
def test_ranks_import_what_the_launcher_imports(tmp_path):
    # A titan_plugins/ folder in the directory the user typed the command in: the
    # launching process (a console script: its sys.path has no current directory) never
    # sees it, so neither may the ranks, which fork from a server started with `python -c`.
    import titan_plugins

    fake = tmp_path / "titan_plugins"
    fake.mkdir()
    (fake / "__init__.py").write_text("SHADOW = True\n")
    config = tmp_path / "run" / "config.yaml"
    config.parent.mkdir()
    config.write_text("{}\n")
    script = tmp_path / "bin" / "launch.py"  # like the titan-run console script
    script.parent.mkdir()
    script.write_text("import sys\nfrom titan_plugins.distributed.launcher import launch\nimport rank_probe\n"
                      f"if __name__ == '__main__':\n    sys.exit(launch({str(config)!r}, 1, rank_probe.entry))\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}, "PYTHONPATH": TESTS}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads((config.parent / "probe-0.json").read_text())
    assert probe["titan_plugins"] == titan_plugins.__file__  # not tmp_path/titan_plugins
    assert "" not in probe["sys_path"] and str(tmp_path) not in probe["sys_path"]
    assert probe["pythonpath"] == TESTS and probe["safepath"] is None  # the user's environment


def _terminated_rank(_config_path):
    """A rank that Slurm stops (``srun --kill-on-bad-exit`` after a peer failed): SIGTERM
    arrives while it works."""
    import signal
    import time

    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # not reached: the handler raises first
    raise AssertionError("SIGTERM did not end the rank")


def test_rank_0_writes_its_result_when_slurm_terminates_it(tmp_path, monkeypatch):
    """``result.json`` "whatever happened": a SIGTERM to rank 0 ends it through the same
    report as a crash (exit 143, the error named), not by dying where it stands."""
    import signal

    from titan_plugins.distributed.external import RankSteps, run_external_rank
    from titan_plugins.train.run_files import write_result

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29999",
                       "TITAN_LAUNCHED_BY": "slurm", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(key, value)
    steps = RankSteps(write_config=lambda _job, run_dir: Path(run_dir) / "config.yaml",
                      run_rank=_terminated_rank, write_result=write_result)
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = run_external_rank(None, tmp_path / "run", key="TITAN_RUN_DIR", overrides="", job_name="0",
                                 steps=steps)
    finally:
        signal.signal(signal.SIGTERM, before)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert code == 143 and result["status"] == "failed" and result["returncode"] == 143, result
    assert result["error"].splitlines()[0] == "rank 0 crashed: Terminated: terminated by SIGTERM", result


def test_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """Ports from binding port 0 come from the ephemeral range, where other processes'
    outgoing connections can take them before the store binds (EADDRINUSE under srun)."""
    import socket

    from titan_plugins.distributed.external import _ephemeral_low, _free_port

    ports = {int(_free_port()) for _ in range(5)}
    assert all(1024 <= p < _ephemeral_low() for p in ports), ports
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))  # still free

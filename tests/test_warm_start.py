"""Warm launches (issue 49.5): ``train.api.run`` forks each job's launcher from one
zygote per process, and a process that launches several jobs keeps the ranks' fork
server; neither may hand a job anything of an earlier one (environment, working
directory, failure folder), a zygote started for other imports is replaced, a timed-out
launcher dies with its ranks, and a warm run trains bit for bit as a cold one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from titan_plugins.distributed import fork_server, launcher
from titan_plugins.train import zygote
from titan_plugins.train.api import run

pytestmark = [pytest.mark.slow,  # launched runs
              pytest.mark.skipif(not zygote.enabled(), reason="warm launches need Linux fork and fd passing")]

TINY = ["model=tiny", "training.seq_len=32", "training.steps=2", "metrics.tensorboard=false",
        "metrics.console=false"]


def _go(tmp_path: Path, name: str, *overrides: str, env: dict | None = None, timeout: float = 240,
        plugins: tuple[str, ...] = ()):
    probe = tmp_path / f"{name}-probe"
    probe.mkdir()
    result = run([*TINY, *overrides], run_dir=tmp_path / name, extra_plugins=["tiny_plugin", *plugins],
                 env={"TITAN_TINY_PROBE": str(probe), **(env or {})}, timeout=timeout)
    ranks = {p.stem: json.loads(p.read_text()) for p in probe.glob("rank*.json")}
    return result, ranks


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_jobs_share_the_zygote_and_each_starts_with_its_own_directory_and_environment(tmp_path, monkeypatch):
    first_dir, second_dir = tmp_path / "cwd1", tmp_path / "cwd2"
    first_dir.mkdir()
    second_dir.mkdir()
    monkeypatch.chdir(first_dir)
    first, first_ranks = _go(tmp_path, "first", "parallelism=fsdp2")
    zygote_pid = zygote._zygote[0].pid
    monkeypatch.chdir(second_dir)
    second, second_ranks = _go(tmp_path, "second", "parallelism=fsdp2", env={"TITAN_TINY_EXTRA": "x"})
    assert first.returncode == 0 and second.returncode == 0, (first.error, second.error)
    assert zygote._zygote[0].pid == zygote_pid  # the request's env is the job's, not a new zygote's
    assert {r["cwd"] for r in first_ranks.values()} == {str(first_dir)}
    assert {r["cwd"] for r in second_ranks.values()} == {str(second_dir)}
    # both ranks of a job fork from one server; each job's launcher forks its own
    assert len({r["server"] for r in first_ranks.values()}) == 1
    assert {r["server"] for r in first_ranks.values()}.isdisjoint(r["server"] for r in second_ranks.values())
    assert first.losses == second.losses


def test_a_folder_that_shadows_nothing_and_a_variable_set_by_imports_keep_the_zygote(tmp_path, monkeypatch):
    first, _ = _go(tmp_path, "first")
    pid = zygote._zygote[0].pid
    harmless = tmp_path / "harmless"
    (harmless / "titan_test_only_pkg").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(harmless))  # a test's own package: the zygote imported nothing from there
    set_by_imports = sorted(zygote._report["env"] - {"TITAN_PLUGINS_EXTRA"})
    for name in set_by_imports[:1]:  # as an import in this process would (transformers sets some)
        monkeypatch.setenv(name, "set here")
    second, _ = _go(tmp_path, "second")
    assert zygote._zygote[0].pid == pid
    assert first.returncode == second.returncode == 0, (first.error, second.error)
    # A folder named like a module the zygote imported: the next launch's key is not served
    # (the decision _request makes; a real restart here would cost two zygote starts, this
    # one and the next test's, for the same branch).
    started = zygote._zygote[2]
    assert zygote._serves(started, fork_server.import_key(zygote.PRELOAD))
    shadow = tmp_path / "shadow"
    (shadow / "omegaconf").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(shadow))
    assert not zygote._serves(started, fork_server.import_key(zygote.PRELOAD))


def test_a_warm_run_trains_bit_for_bit_as_a_cold_one(tmp_path, monkeypatch):
    warm, _ = _go(tmp_path, "warm")
    monkeypatch.setenv(zygote.WARM_START_ENV, "0")
    cold, _ = _go(tmp_path, "cold")
    assert warm.returncode == cold.returncode == 0, (warm.error, cold.error)
    assert len(warm.losses) == 2 and warm.losses == cold.losses


def test_a_timed_out_launcher_dies_with_its_ranks(tmp_path):
    # The rank waits after step 1 (fault_plugin) instead of training on: the 20 s it outlasts
    # cost the other tests running beside this one no CPU.
    result, ranks = _go(tmp_path, "slow", "training.steps=100000", timeout=20, plugins=("fault_plugin",),
                        env={"TITAN_TEST_PARK_AFTER": "1"})
    assert result.returncode == 124 and result.error == "timed out after 20 s"
    assert ranks, "the rank had started (its probe is there)"
    deadline = time.monotonic() + 10
    while any(_alive(r["pid"]) or _alive(r["server"]) for r in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(r["pid"]) or _alive(r["server"]) for r in ranks.values())


def test_an_installed_distribution_or_another_environment_changes_the_import_key(tmp_path, monkeypatch):
    site = tmp_path / "lib" / "site-packages"
    (site / "a-1.0.dist-info").mkdir(parents=True)
    source = tmp_path / "checkout"  # an editable install's source folder: its listing is not an input
    (source / "a.egg-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(source))
    monkeypatch.syspath_prepend(str(site))
    key = fork_server.import_key(zygote.PRELOAD)
    assert fork_server.import_key(zygote.PRELOAD) == key
    os.utime(source, ns=(1, 1))  # a tool wrote into the checkout
    assert fork_server.import_key(zygote.PRELOAD) == key
    os.utime(site, ns=(1, 1))  # as when a distribution is added or removed
    moved = fork_server.import_key(zygote.PRELOAD)
    assert moved != key
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # changes every test: not an import's input
    assert fork_server.import_key(zygote.PRELOAD) == moved
    monkeypatch.setenv("TITAN_RENDEZVOUS_TIMEOUT", "5")  # the project's own variables are read at run time
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")  # its modules load in each job, never preloaded
    assert fork_server.import_key(zygote.PRELOAD) == moved
    monkeypatch.setenv("TORCH_LOGS", "+dynamo")
    assert fork_server.import_key(zygote.PRELOAD) != moved


# --- the launcher's own fork server, kept between the launches of one process (multirun)


def probe_entry(config_path: str) -> None:
    """A rank that records what it started with next to ``config_path``."""
    record = {"cwd": os.getcwd(), "server": os.getppid(), "failure_dir": os.environ.get(launcher.FAILURE_DIR_ENV),
              "extra": os.environ.get("TITAN_WARM_TEST"), "other": os.environ.get("WARM_TEST_OTHER")}
    Path(config_path).with_name(f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


def test_launches_of_one_process_reuse_the_fork_server_unless_the_environment_changed(tmp_path, monkeypatch):
    def launch(name: str) -> list[dict]:
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        assert launcher.launch(folder / "config.yaml", 2, probe_entry) == 0
        return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]

    try:
        first = launch("one")
        monkeypatch.setenv("TITAN_WARM_TEST", "set")  # the project's own: read at run time, never at import
        second = launch("two")
        monkeypatch.setenv("WARM_TEST_OTHER", "set")  # anyone's: it might be read at import
        third = launch("three")
    finally:
        fork_server.stop_server()
    assert {r["server"] for r in first} == {r["server"] for r in second}  # kept
    assert {r["cwd"] for r in second} == {str(tmp_path / "two")}
    assert first[0]["failure_dir"] != second[0]["failure_dir"]  # each launch's own
    assert {r["extra"] for r in second} == {"set"} and {r["extra"] for r in first} == {None}
    assert {r["server"] for r in third}.isdisjoint(r["server"] for r in first)  # a new one
    assert {r["other"] for r in third} == {"set"} and {r["other"] for r in second} == {None}


def test_a_source_edited_after_the_zygote_started_gets_a_new_zygote(tmp_path):
    """A developer edits the trainer between two runs of a notebook: the zygote imported
    the old code, so it answers "stale" and exits, and the job runs on a new one."""
    first, _ = _go(tmp_path, "before")
    old = zygote._zygote[0]
    source = Path(zygote.__file__)  # imported by every zygote (it runs its loop)
    stat = source.stat()
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        second, _ = _go(tmp_path, "after")
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert first.returncode == second.returncode == 0, (first.error, second.error)
    assert zygote._zygote[0] is not old and old.wait(timeout=30) == 0  # the stale one ended
    assert first.losses == second.losses

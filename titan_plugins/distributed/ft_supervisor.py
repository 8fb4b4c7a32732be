"""``titan-run ... fault_tolerance=torchft``: the lighthouse and the replica groups.

``launch_replicas`` starts torchft's lighthouse (unless ``fault_tolerance.lighthouse``
names a shared one; its output in ``<run_dir>/lighthouse.log``), then each of the
``replica_groups`` groups as its own job (``python -m titan_plugins.train.worker``, or
a fork of a warm process that imported it, ``start_worker``: its own torch elastic
launch, rendezvous port and process tree) in ``<run_dir>/replica-<i>``.
It watches them: a group that dies is one line ("replica 1 lost at step 4 (killed by
SIGKILL); 1 of 2 replicas training; restarting it (1/3)") and is started again while its
``max_restarts`` last; a group that heals is one line (read from the quorum log the
groups append to, ``ft_quorums.jsonl``). At the end: "steps trained with 2 of 2
replicas: 8, with 1 of 2: 2" (also ``ft_summary.json``), the groups' metrics merged into
``<run_dir>/metrics.jsonl``, the lighthouse stopped, every process reaped. The console
shows the step lines of the lowest-numbered live group; every group's output is in
``replica-<i>/console.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_plugins.distributed.fault_tolerance import (
    QUORUM_LOG,
    QUORUM_LOG_ENV,
    START_ENV,
    reachable,
)
from titan_plugins.distributed.reaper import Reaper
from titan_plugins.errors import ConfigError
from titan_plugins.failures import INTERRUPTED, write_error_file

__all__ = ["launch_replicas", "steps_by_participants", "summary_line"]

LIGHTHOUSE_LOST_EXIT = 1
# (launcher argv, *, env, stdout fd, stderr fd) -> a Popen-like (pid, poll, wait, returncode)
StartWorker = Callable[..., Any]


def _popen_worker(argv: list[str], *, env: dict[str, str], stdout: int, stderr: int) -> subprocess.Popen:
    """A group's launcher as a new interpreter, in a session of its own."""
    return subprocess.Popen([sys.executable, "-m", "titan_plugins.train.worker", *argv], env=env,
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)


# ------------------------------------------------------------------ the quorum log
def read_quorums(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def steps_by_participants(records: list[dict[str, Any]]) -> dict[int, int]:
    """``{k: steps committed with k participating groups}``, each step once."""
    by_step = {r["step"]: r["participants"] for r in records if r.get("committed") and "event" not in r}
    counts: dict[int, int] = {}
    for k in by_step.values():
        counts[k] = counts.get(k, 0) + 1
    return counts


def summary_line(counts: dict[int, int], groups: int) -> str:
    if not counts:
        return "steps trained: none committed"
    parts = [f"with {k} of {groups}: {counts[k]}" for k in sorted(counts, reverse=True)]
    return f"steps trained {parts[0].replace(f' of {groups}', f' of {groups} replicas', 1)}" + (
        ", " + ", ".join(parts[1:]) if parts[1:] else "")


# ------------------------------------------------------------------ processes
class _Group:
    """One replica group's job: its process, its output, its restarts."""

    def __init__(self, replica: int, config: Path, nproc: int, env: dict[str, str],
                 start_worker: StartWorker | None = None) -> None:
        self.replica, self.config, self.nproc, self.env = replica, config, nproc, env
        self.start_worker = start_worker or _popen_worker
        self.restarts, self.proc, self.last_error = 0, None, ""
        self.finished = self.gone = False
        self.joined = True  # a restarted group: healed from, or trained with, a live peer
        self.log = config.parent / "console.log"

    def start(self, console: Callable[[int], bool]) -> None:
        argv, env = [str(self.config), str(self.nproc)], {**self.env, START_ENV: str(self.restarts)}
        pipes = [os.pipe(), os.pipe()]  # its stdout and stderr, read here line by line
        try:
            self.proc = self.start_worker(argv, env=env, stdout=pipes[0][1], stderr=pipes[1][1])
        except BaseException:
            for read, _ in pipes:
                os.close(read)
            raise
        finally:
            for _, write in pipes:
                os.close(write)
        streams = [open(read, buffering=1, errors="replace") for read, _ in pipes]  # noqa: SIM115 - read to EOF by the pumps
        log = open(self.log, "a")  # noqa: SIM115 - closed by the last pump
        log.write(f"--- replica {self.replica}, start {self.restarts + 1} ---\n")
        pumps = [threading.Thread(target=self._pump, args=(streams[0], log, console, False), daemon=True),
                 threading.Thread(target=self._pump, args=(streams[1], log, console, True), daemon=True)]
        self.pumps = pumps
        for t in pumps:
            t.start()

    def _pump(self, stream: Any, log: Any, console: Callable[[int], bool], errors: bool) -> None:
        for line in stream:
            log.write(line)
            log.flush()
            if errors:  # torchft's and torch's logs stay in the group's log; its error line names the cause
                if line.startswith("error: "):
                    self.last_error = line[len("error: "):].strip()
            elif console(self.replica):
                sys.stdout.write(line)
                sys.stdout.flush()
        with contextlib.suppress(OSError):
            log.flush()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def kill_tree(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def cause(self) -> str:
        found = re.search(r"killed by signal (\w+)", self.last_error)
        if found:
            return f"killed by {found.group(1)}"
        return self.last_error or f"exit code {self.proc.returncode}"

    def join_output(self) -> None:
        for t in getattr(self, "pumps", []):
            t.join(timeout=5)


def _lighthouse_command() -> str:
    here = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(here) if here.is_file() else shutil.which("torchft_lighthouse")
    if not found:
        raise ConfigError("fault_tolerance=torchft: the torchft_lighthouse command is not installed "
                          "(pip install 'titan-plugins[ft]')")
    return found


_LISTENING = re.compile(rb"Lighthouse listening on: \S+?:(\d+)")


def _start_lighthouse(ft: Any, run_dir: Path) -> tuple[subprocess.Popen, str]:
    """The lighthouse on a port the OS assigns (``--bind [::]:0``), read back from its log:
    a port picked here and bound by the child a moment later could be taken meanwhile, and
    the job would then talk to whatever listens there."""
    cmd = [_lighthouse_command(), "--min_replicas", str(ft.min_replicas), "--bind", "[::]:0",
           "--heartbeat_timeout_ms", str(int(float(ft.heartbeat_timeout_s) * 1000)),
           "--join_timeout_ms", str(int(float(ft.join_timeout_s) * 1000)), "--quorum_tick_ms", "50"]
    log_path = run_dir / "lighthouse.log"
    log = open(log_path, "ab")  # noqa: SIM115 - the child holds it
    start = log.tell()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 20
    address = None
    while address is None or not reachable(address, timeout=0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise ConfigError(f"fault_tolerance=torchft: the lighthouse did not start (see {log_path})")
        if address is None:
            with open(log_path, "rb") as f:
                f.seek(start)
                found = _LISTENING.search(f.read())
            address = f"localhost:{int(found.group(1))}" if found else None
        time.sleep(0.05)
    return proc, address


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_cause(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# ------------------------------------------------------------------ the job
class _Interrupted(Exception):
    def __init__(self, sig: int) -> None:
        self.sig = sig


def launch_replicas(job: Any, run_dir: Path, nproc: int, write_group_config: Callable[[Any, Path], Path],
                    start_worker: StartWorker | None = None) -> int:
    """Run the job as ``fault_tolerance.replica_groups`` groups of ``nproc`` ranks;
    returns its exit code (0: the last step was committed). ``start_worker(argv, *, env,
    stdout, stderr)`` starts a group's launcher (``train.zygote.popen_module``: forked from
    a warm process where one serves); without it, each group is a new interpreter."""
    from omegaconf import OmegaConf

    ft = job.fault_tolerance
    run_dir = Path(run_dir)
    quorum_log = run_dir / QUORUM_LOG  # a resumed run adds to its history
    reaper = Reaper()
    reaper.start_job()
    lighthouse, address = None, ft.lighthouse
    groups: list[_Group] = []
    handlers = {}
    try:
        if address is None:
            lighthouse, address = _start_lighthouse(ft, run_dir)
        env = {**os.environ, QUORUM_LOG_ENV: str(quorum_log)}
        env.setdefault("OMP_NUM_THREADS", "1")
        for i in range(int(ft.replica_groups)):
            group_job = OmegaConf.create(OmegaConf.to_container(job, resolve=True))
            group_job.run_dir = str(run_dir / f"replica-{i}")
            group_job.fault_tolerance.replica_id = i
            group_job.fault_tolerance.lighthouse = address
            groups.append(_Group(i, write_group_config(group_job, Path(group_job.run_dir)), nproc, env, start_worker))
        print(f"fault_tolerance=torchft: {len(groups)} replica groups x {nproc} rank{'s' * (nproc > 1)}, "
              f"min_replicas {ft.min_replicas}, lighthouse {address}"
              f"{' (started with the job)' if lighthouse else ''}; quorums in {quorum_log}", flush=True)

        def interrupt(signum: int, _frame: Any) -> None:
            raise _Interrupted(signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, interrupt)
        watch = _Watch(groups, quorum_log, int(ft.max_restarts), lighthouse, address)
        for g in groups:
            g.start(watch.console)
        code = watch.run()
    except _Interrupted as stop:
        for g in groups:
            g.signal(signal.SIGINT)  # each group's launcher stops its ranks
        _wait(groups, 10.0)
        text = INTERRUPTED if stop.sig == signal.SIGINT else f"terminated by signal {signal.Signals(stop.sig).name}"
        print(f"error: {text}", file=sys.stderr, flush=True)
        write_error_file(run_dir, text)
        code = 130 if stop.sig == signal.SIGINT else 128 + stop.sig
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for g in groups:
            g.kill_tree()
        _stop(lighthouse)
        for g in groups:
            with contextlib.suppress(Exception):
                if g.proc is not None:
                    g.proc.wait(timeout=5)
            g.join_output()
        reaper.end_job()
    _finish(run_dir, groups, int(ft.replica_groups))
    return code


def _wait(groups: list[_Group], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(g.running() for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)


class _Watch:
    """The supervisor's loop: restarts, the lost / healed lines, the lighthouse."""

    def __init__(self, groups: list[_Group], quorum_log: Path, max_restarts: int,
                 lighthouse: subprocess.Popen | None, address: str) -> None:
        self.groups, self.quorum_log, self.max_restarts = groups, quorum_log, max_restarts
        self.lighthouse, self.address = lighthouse, address
        self.read = quorum_log.stat().st_size if quorum_log.is_file() else 0  # bytes of the quorum log seen
        self.last_step: dict[int, int] = {}  # replica -> last step it committed

    def console(self, replica: int) -> bool:
        live = [g.replica for g in self.groups if g.running() or g.finished]
        return replica == (min(live) if live else 0)

    def _new_quorums(self) -> None:
        try:
            with open(self.quorum_log, "rb") as f:
                f.seek(self.read)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1
        self.read += end
        for line in chunk[:end].decode().splitlines():
            with contextlib.suppress(ValueError, KeyError, IndexError):
                r = json.loads(line)
                self.groups[r["replica"]].joined = True
                if r.get("event") == "healed":
                    print(f"replica {r['replica']} healed at step {r['step']} from replica {r['from']}", flush=True)
                elif r["committed"]:
                    self.last_step[r["replica"]] = max(self.last_step.get(r["replica"], 0), r["step"])

    def _at_step(self) -> int:
        return max(self.last_step.values(), default=0)

    def run(self) -> int:
        failure: int | None = None
        while True:
            self._new_quorums()
            if self.lighthouse is not None and self.lighthouse.poll() is not None:
                return self._lighthouse_lost(_exit_cause(self.lighthouse.returncode))
            for g in self.groups:
                if g.proc is None or g.finished or g.gone or g.running():
                    continue
                g.join_output()
                self._new_quorums()
                if g.proc.returncode == 0:
                    g.finished = True
                    continue
                if self.lighthouse is None and not reachable(self.address):
                    return self._lighthouse_lost("it no longer answers")
                failure = g.proc.returncode
                self._lost(g)
            if any(g.finished for g in self.groups):
                self._stop_unjoined()
            if all(g.finished or g.gone for g in self.groups):
                if any(g.finished for g in self.groups):
                    return 0
                print("error: every replica group was lost", file=sys.stderr, flush=True)
                return failure if failure and failure > 0 else 1
            time.sleep(0.05)

    def _lost(self, g: _Group) -> None:
        step = self.last_step.get(g.replica, 0) + 1
        # a group that finished meanwhile trained on to the end: it counts as training
        live = sum(other.running() or other.finished for other in self.groups)
        head = (f"replica {g.replica} lost at step {step} ({g.cause()}); {live} of {len(self.groups)} "
                "replicas training")
        if g.restarts >= self.max_restarts:
            g.gone = True
            print(f"{head}; not restarted (fault_tolerance.max_restarts={self.max_restarts} used)", flush=True)
        elif any(other.finished for other in self.groups):
            g.gone = True
            print(f"{head}; not restarted: the others have finished", flush=True)
        else:
            g.restarts += 1
            g.joined = False
            print(f"{head}; restarting it ({g.restarts}/{self.max_restarts})", flush=True)
            g.start(self.console)

    def _stop_unjoined(self) -> None:
        """A restarted group still waiting for a peer when the others have finished."""
        for g in self.groups:
            if g.running() and not g.joined:
                g.gone = True
                print(f"replica {g.replica} stopped: the others finished at step {self._at_step()} before it "
                      "rejoined", flush=True)
                g.signal(signal.SIGTERM)

    def _lighthouse_lost(self, why: str) -> int:
        print(f"error: the torchft lighthouse at {self.address} was lost at step {self._at_step() + 1} ({why}): "
              "the replica groups cannot form a quorum; stopping them (checkpoints up to the last saved step "
              "are kept)", file=sys.stderr, flush=True)
        for g in self.groups:
            g.signal(signal.SIGTERM)
        _wait(self.groups, 10.0)
        return LIGHTHOUSE_LOST_EXIT


def _finish(run_dir: Path, groups: list[_Group], count: int) -> None:
    """The summary line and ``ft_summary.json``; the groups' metrics merged by step."""
    records = read_quorums(run_dir / QUORUM_LOG)
    counts = steps_by_participants(records)
    print(summary_line(counts, count), flush=True)
    summary = {"replica_groups": count, "steps_by_participants": {str(k): v for k, v in counts.items()},
               "restarts": {str(g.replica): g.restarts for g in groups},
               "finished": [g.replica for g in groups if g.finished]}
    (run_dir / "ft_summary.json").write_text(json.dumps(summary) + "\n")
    merged: dict[int, str] = {}
    for g in sorted(groups, key=lambda g: -g.replica):  # the lowest group's record of a step wins
        path = g.config.parent / "metrics.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else ():
            with contextlib.suppress(ValueError, KeyError):
                merged[int(json.loads(line)["step"])] = line
    if merged:
        (run_dir / "metrics.jsonl").write_text("".join(merged[s] + "\n" for s in sorted(merged)))

"""titan-export under faults (titan_plugins/export/out_dir.py): a kill midway never leaves
an ``--out`` that looks complete and the next run completes it; two exports into one
``--out``: one writes, the other refuses in one line; a full or read-only disk is one
line with the earlier export intact; the files are on disk before the marker.

A real ``titan-export`` process is paused midway without sleeping and hoping: it runs
the CLI's ``main`` with ``safetensors.torch.save_file`` wrapped to write its file, say
so (a flag file) and wait (for a go file), so the test kills or races it at a known
point: weights written, the rest of the folder and its marker not yet."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from titan_plugins.errors import ConfigError
from titan_plugins.export.out_dir import (
    MARKER,
    claim_out_dir,
    export_kind,
    publish_dir,
    staging_dir,
    write_export,
)

PAUSED = """
import os, sys, time
import safetensors.torch as st

real, paused = st.save_file, []

def save_file(*args, **kwargs):
    real(*args, **kwargs)
    if not paused:
        paused.append(1)
        open(os.environ["EXPORT_PAUSED"], "w").close()
        deadline = time.monotonic() + 120  # the test kills or resumes it long before
        while not os.path.exists(os.environ["EXPORT_GO"]) and time.monotonic() < deadline:
            time.sleep(0.02)

st.save_file = save_file
from titan_plugins.cli.export import main
sys.exit(main(sys.argv[1:]))
"""


def _save_run(run_dir: Path, overrides: list[str], state_dict) -> Path:
    """A run directory: its config.yaml and one DCP checkpoint holding ``state_dict``."""
    import torch.distributed.checkpoint as dcp

    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job, write_config

    _, job, _ = prepare_job(overrides, get_plugin_manager(), run_dir=run_dir)
    write_config(job, run_dir)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state_dict(job)}, checkpoint_id=str(run_dir / "checkpoints" / "step-1"))
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with one DCP checkpoint of a one-layer qwen3, made in this process."""
    import torch

    from titan_plugins.model.lifecycle import build_meta_model
    from titan_plugins.plugins import get_plugin_manager

    def weights(job):
        model = build_meta_model(get_plugin_manager().get_model("qwen3"), job)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        return model.state_dict()

    overrides = ["model=qwen3", "model.n_layers=1", "training.seq_len=16"]
    return _save_run(tmp_path_factory.mktemp("export-faults") / "run", overrides, weights)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run (adapter-only checkpoint) on a tiny Hugging Face Qwen3 base (``model.hf``)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from titan_plugins.peft.lora import is_adapter_key
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.testing.model_parts import one_process_model

    root = tmp_path_factory.mktemp("export-faults-lora")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )).save_pretrained(root / "base")

    def adapters(job):
        model = one_process_model(get_plugin_manager().get_model("qwen3"), job, str(root / "base"))
        return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}

    overrides = ["model=qwen3", f"model.hf={root / 'base'}", "data.name=synthetic", "data.vocab_size=96",
                 "training.seq_len=16", "peft=lora", "peft.target_modules=[wq,wv]"]
    return _save_run(root / "run", overrides, adapters)


def _export(capsys, *argv: str) -> tuple[int, list[str]]:
    from titan_plugins.cli.export import main

    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _beside(out: Path) -> list[str]:
    """What an export left next to ``out`` (staging folders, lock files)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _paused_export(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen, Path]:
    """``titan-export ARGV`` in its own process, returned once it is paused midway
    (``PAUSED``); creating the returned go file lets it go on."""
    flag, go = tmp_path / "paused", tmp_path / "go"
    flag.unlink(missing_ok=True)
    go.unlink(missing_ok=True)
    env = {**os.environ, "EXPORT_PAUSED": str(flag), "EXPORT_GO": str(go)}
    proc = subprocess.Popen([sys.executable, "-c", PAUSED, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not flag.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the export never paused (exit {proc.returncode}): {err[-2000:]}")
        time.sleep(0.02)
    return proc, go


@pytest.mark.parametrize("how", ["full", pytest.param("adapter", marks=pytest.mark.extended),
                                 pytest.param("merge", marks=pytest.mark.extended)])
def test_a_killed_export_leaves_no_complete_out_and_the_next_run_completes_it(how, request, tmp_path, capsys):
    """SIGKILL midway: ``--out`` is the earlier export, whole (``--overwrite``), or absent
    (a new folder: in the extended variants, one process fewer in the default suite); the
    killed one's staging folder is left; the next run writes the export and removes what
    the killed one left."""
    run_dir = request.getfixturevalue("run" if how == "full" else "lora_run")
    flags = [] if how == "full" else [f"--{how}"]
    earlier = tmp_path / "earlier"  # --overwrite over an earlier export
    new = tmp_path / "new"  # a folder that did not exist
    cases = [(earlier, ["--overwrite"])] + ([(new, [])] if how != "full" else [])
    assert _export(capsys, str(run_dir), *flags, "--out", str(earlier))[0] == 0
    before = _files(earlier)
    for out, extra in cases:
        proc, _ = _paused_export(tmp_path, str(run_dir), *flags, "--out", str(out), *extra)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        left = _beside(out)
        assert any(name.endswith(".tmp") for name in left), left  # killed while writing its staging folder
    assert _files(earlier) == before and not new.exists()

    for out, extra in cases:
        code, err = _export(capsys, str(run_dir), *flags, "--out", str(out), *extra)
        assert code == 0, err
        assert _beside(out) == []  # the killed export's staging folder and lock file are gone
        assert export_kind(out) == {"full": "full", "adapter": "peft-adapter", "merge": "merged"}[how]
        assert _files(out).keys() == before.keys()
    assert _files(earlier)[MARKER] != before[MARKER]  # a new export, whole


def test_two_exports_at_once_one_writes_the_other_refuses_in_one_line(run, tmp_path, capsys):
    """A's export is paused midway holding ``--out``: B refuses in one line; a claim B
    made while A wrote is refused when B comes to write after A published; A's
    export is the one left, whole."""
    out = tmp_path / "out"
    proc, go = _paused_export(tmp_path, str(run), "--out", str(out))
    try:
        code, err = _export(capsys, str(run), "--out", str(out))
        assert code == 2 and err == [f"error: --out {out}: another export (pid {proc.pid}) is writing it now; "
                                     "wait for it to end or choose another folder"], err
        target = claim_out_dir(out, "full")  # a third one, started while A writes
        go.touch()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and stdout.strip() == f"wrote {out}", stderr
    written = _files(out)
    with pytest.raises(ConfigError, match=rf"^--out {out}: another export was written there while this one ran"):
        write_export(target, "full", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert _files(out) == written and _beside(out) == []


def test_every_file_is_on_disk_before_the_marker(run, tmp_path, capsys, monkeypatch):
    """fsync of every file, then the marker (fsynced), then the folder, then the swap."""
    out = tmp_path / "out"
    synced: list[tuple[str, bool]] = []  # (path fsynced, did the marker exist beside it then)
    real = os.fsync

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((str(path), (path.parent / MARKER).exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert _export(capsys, str(run), "--out", str(out))[0] == 0
    staging = {Path(p).parent for p, _ in synced if Path(p).name == MARKER}
    assert len(staging) == 1, synced
    tmp = staging.pop()
    order = [p for p, _ in synced]
    marker = order.index(str(tmp / MARKER))
    for name in _files(out):
        if name != MARKER:  # each file: synced, with no marker beside it yet, before the marker
            assert (str(tmp / name), False) in synced[:marker], name
    assert str(tmp) in order[marker + 1:] and order[-1] == str(out.parent.resolve())  # the folder, then the swap's parent


# the real message of a full disk under safetensors' writer (Rust: no OSError)
SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.mark.parametrize("fault", ["safetensors ENOSPC", "fsync ENOSPC", "read-only EROFS", "no access EACCES"])
def test_a_full_or_read_only_disk_is_one_line_and_the_earlier_export_stays(fault, run, tmp_path, capsys,
                                                                          monkeypatch):
    import tempfile

    import safetensors
    import safetensors.torch

    out = tmp_path / "out"
    assert _export(capsys, str(run), "--out", str(out))[0] == 0
    before = _files(out)
    code = {"ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS, "EACCES": errno.EACCES}[fault.split()[-1]]

    def fail(*args, **kwargs):
        if fault.startswith("safetensors"):
            raise safetensors.SafetensorError(SAFETENSORS_ENOSPC)
        raise OSError(code, os.strerror(code), str(args[0]) if args else None)

    where = {"safetensors": (safetensors.torch, "save_file"), "fsync": (os, "fsync"),
             "read-only": (tempfile, "mkdtemp"), "no access": (tempfile, "mkdtemp")}[fault.rsplit(" ", 1)[0]]
    monkeypatch.setattr(*where, fail)
    code_, err = _export(capsys, str(run), "--out", str(out), "--overwrite")
    name = errno.errorcode[code]
    assert code_ == 2 and err == [f"error: --out {out}: cannot write the export: {os.strerror(code)} ({name}); "
                                  f"{out} is as it was"], err
    assert _files(out) == before and _beside(out) == []


def _mount_tmpfs(folder: Path, size: int) -> None:
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a tmpfs mount needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no tmpfs mount here: {done.stderr.strip()}")


def test_a_really_full_then_read_only_disk(run, tmp_path, capsys):
    """The same on a real small tmpfs (skipped where mounting is not allowed): the second
    export does not fit (ENOSPC from safetensors' writer), then the disk is read-only."""
    first = tmp_path / "first"
    assert _export(capsys, str(run), "--out", str(first))[0] == 0
    size = sum(p.stat().st_size for p in first.iterdir())
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, size * 3 // 2 + 64 * 1024)  # one export fits, a second beside it does not
    try:
        out = disk / "out"
        assert _export(capsys, str(run), "--out", str(out))[0] == 0
        before = _files(out)
        for remount, reason in ((False, "No space left on device (ENOSPC)"), (True, "Read-only file system (EROFS)")):
            if remount:
                subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            code, err = _export(capsys, str(run), "--out", str(out), "--overwrite")
            assert code == 2 and err == [f"error: --out {out}: cannot write the export: {reason}; "
                                         f"{out} is as it was"], err
            assert _files(out) == before and _beside(out) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_stale_staging_folder_is_removed_only_when_it_is_ours_and_its_writer_is_gone(tmp_path):
    out = tmp_path / "model"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ours_dead = tmp_path / f".model.titan-export.{dead.pid}.abcd1234.tmp"
    ours_live = tmp_path / f".model.titan-export.{os.getppid()}.abcd1234.tmp"
    theirs = [tmp_path / ".model.abcd1234.tmp", tmp_path / f".other.titan-export.{dead.pid}.abcd1234.tmp",
              tmp_path / "model.tmp"]
    for folder in (ours_dead, ours_live, *theirs):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    write_export(out, "full", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert not ours_dead.exists() and ours_live.exists() and all(p.exists() for p in theirs)
    assert json.loads((out / MARKER).read_text())["kind"] == "full"


def test_publish_keeps_out_whole_when_the_swap_fails(tmp_path, monkeypatch):
    """Without an atomic exchange (two renames), a failed second rename puts the earlier
    export back."""
    from titan_plugins.export import out_dir

    out = tmp_path / "model"
    publish_dir(staging_dir(out), out, "full")
    before = _files(out)
    monkeypatch.setattr(out_dir, "_exchange", lambda a, b: False, raising=False)
    real = os.replace

    def replace(src, dst):
        if Path(src).name.endswith(".tmp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    tmp = staging_dir(out)
    with pytest.raises(OSError):
        publish_dir(tmp, out, "full")
    assert _files(out) == before

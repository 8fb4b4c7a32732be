"""Faults injected for real into one small 2-rank job (tiny model, fsdp2, 6 steps,
a checkpoint every 2 steps), in this order:

A  the reference run (checkpoints step-2, -4, -6);
B  a run parked after step 3 whose rank 1 gets SIGKILL: one line naming it, exit 137;
D  the next run in B's folder resumes from step-2 and hits a full disk (a tmpfs of
   1.5 checkpoints) saving step-4: one line, the partial save gone, step-2 intact;
C  the next run finds step-6 (truncated .metadata) and step-4 (truncated and missing
   shards) next to step-2: one warning naming both, resumes from step-2, trains
   bit for bit like A, and a Ctrl-C to its process group ends it with exit 130.

The next tests reuse A: SIGINT to a launcher in the background of a script, preemption
on checkpoint.on_signal and its resume; then non-finite steps (stop and skip). Last, the
faults on fine-tuning runs (a tiny qwen3): LoRA on chat data (adapter-only checkpoints,
data-loader workers), GRPO (kills during the rollout's generation and during the update,
a SIGTERM preemption with checkpoint.on_signal, too) and, extended,
DPO, context parallelism and model=hf on an architecture outside its tested nine
(Granite), each against one reference run of its kind (FAULTS). After every job: no
process of its session is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_plugins.plugins import get_plugin_manager
from titan_plugins.testing.sessions import finish
from titan_plugins.train import zygote
from titan_plugins.train.api import _patched_env, prepare_job, rank_env, read_result, write_config

pytestmark = pytest.mark.slow
BASE = ["model=tiny", "training.seq_len=32", "metrics.tensorboard=false", "metrics.console=false",
        "parallelism=fsdp2", "training.steps=6", "checkpoint=periodic", "checkpoint.interval=2",
        "checkpoint.keep_last=3"]
EXTRA = ["tiny_plugin", "fault_plugin"]
TIMEOUT = 240


def _start(run_dir: Path, *overrides: str, env: dict | None = None, background: bool = False,
           base: list[str] = BASE) -> subprocess.Popen:
    """The launcher in a session of its own, forked from the zygote (what ``titan-run``
    runs after composing); ``background``: a new interpreter as ``launcher &`` in a shell
    script (it and its ranks inherit SIGINT ignored); the launcher's pid is then the
    first line of stderr."""
    added = rank_env(EXTRA, env)
    with _patched_env(added):
        pm = get_plugin_manager(strict=True)
        _, job, dims = prepare_job([*base, *overrides], pm, run_dir=run_dir)
    config = write_config(job, run_dir)
    argv = [str(config), str(dims.world_size)]
    warm = None if background else zygote.start_worker(argv, {**os.environ, **added})
    if warm is not None:  # the same launcher, forked from the zygote
        return warm
    cmd = [sys.executable, "-m", "titan_plugins.train.worker", *argv]
    if background:
        cmd = ["sh", "-c", '"$@" & echo $! >&2; wait $!', "sh", *cmd]
    return subprocess.Popen(cmd, env={**os.environ, **added}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _left_behind(proc: subprocess.Popen, wait: float = 3.0) -> list[str]:
    """The processes of ``proc``'s session still alive ``wait`` s after it exited
    (a process re-parented to init keeps its session; ``_finish`` noted the exit).
    Looked at until none is left or the ``wait`` is over (once none is left, none of the
    session can start another)."""
    while (left := _session_alive(proc)) and time.monotonic() < proc.ended + wait:
        time.sleep(0.05)
    return left


def _session_alive(proc: subprocess.Popen) -> list[str]:
    left = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == proc.pid and fields[0] != "Z":
                left.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except (OSError, ValueError, IndexError):
            continue
    return left


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    return finish(proc, TIMEOUT)


def _rank_pid(run_dir: Path, rank: int) -> int:
    return int((run_dir / f"parked-{rank}").read_text())  # written by fault_plugin


def _wait_parked(run_dir: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not all((run_dir / f"parked-{r}").exists() for r in (0, 1)):
        assert proc.poll() is None, _finish(proc)[2][-3000:]
        assert time.monotonic() < deadline, "the ranks never parked"
        time.sleep(0.1)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A: the reference run (checkpoints step-2, -4, -6), shared by the tests here."""
    ref_dir = tmp_path_factory.mktemp("faults") / "ref"
    code, _, err = _finish(_start(ref_dir))
    assert code == 0, err[-3000:]
    return ref_dir


@pytest.fixture
def tmpfs(tmp_path):
    """A 4 MiB-granular tmpfs (root only), or None."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_dead_rank_full_disk_and_damaged_checkpoints(tmp_path, tmpfs, reference):
    ref_dir = reference
    ref = read_result(ref_dir).losses
    step2 = ref_dir / "checkpoints" / "step-2"
    size = sum(p.stat().st_size for p in step2.iterdir())
    kib = (size * 3 // 2) // 1024 + 1
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(tmpfs)],
                             capture_output=True).returncode == 0
    folder = (tmpfs if mounted else tmp_path / "disk") / "ckpt"
    run_dir = tmp_path / "job"
    over = f"checkpoint.folder={folder}"

    # B: SIGKILL rank 1 while both ranks are parked after step 3 (step-2 saved).
    proc = _start(run_dir, over, env={"TITAN_TEST_PARK_AFTER": "3"})
    _wait_parked(run_dir, proc)
    t0 = time.monotonic()
    os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
    code, _, err = _finish(proc)
    took = time.monotonic() - t0
    assert _error_lines(err) == ["error: rank 1 was killed by signal SIGKILL"], err[-3000:]
    assert code == 137 and took < 15, (code, took)
    assert _left_behind(proc) == []  # no worker, fork server or resource tracker outlives the job
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]

    if mounted:
        # D: resumes from step-2, trains 3-4 like A, the disk fills saving step-4.
        for p in run_dir.glob("parked-*"):
            p.unlink()
        code, out, err = _finish(_start(run_dir, over))
        assert f"resumed from checkpoint {folder / 'step-2'} (step 2)" in out
        assert _error_lines(err) == [f"error: no space left writing checkpoint step-4 to {folder}"], err[-3000:]
        assert code == 2
        assert sorted(p.name for p in folder.iterdir()) == ["step-2"]  # the partial save removed
        assert read_result(run_dir).losses[2:4] == ref[2:4]

    # C: damaged newer checkpoints next to step-2 (their real files truncated or gone).
    step6, step4 = folder / "step-6", folder / "step-4"
    for damaged in (step6, step4):
        damaged.mkdir()
        shutil.copy(folder / "step-2" / "manifest.json", damaged)
    meta = (folder / "step-2" / ".metadata").read_bytes()
    (step6 / ".metadata").write_bytes(meta[: len(meta) // 2])
    shutil.copy(folder / "step-2" / ".metadata", step4)
    (step4 / "__0_0.distcp").write_bytes((folder / "step-2" / "__0_0.distcp").read_bytes()[:1000])
    proc = _start(run_dir, over, "checkpoint.interval=100", "checkpoint.save_final=false",
                  env={"TITAN_TEST_PARK_AFTER": "6"})
    _wait_parked(run_dir, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    code, out, err = _finish(proc)
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step-6: .metadata has" in warnings[0] and "step-4: __0_0.distcp has 1000 of" in warnings[0]
    assert f"resumed from checkpoint {folder / 'step-2'} (step 2)" in out
    assert _error_lines(err) == ["error: interrupted (Ctrl-C)"], err[-3000:]
    assert code == 130
    assert _left_behind(proc, wait=0.5) == []
    assert read_result(run_dir).losses == ref  # steps 3-6 bit for bit (the last record of a step wins)


def test_sigint_in_a_script_preemption_and_resume(tmp_path, reference):
    """Issue 40.1/1b/2: a launcher in the background of a shell script (SIGINT ignored,
    inherited by every rank) stops on SIGINT within seconds; on checkpoint.on_signal=USR1
    the ranks save at the next step boundary and the job exits 75; the next run resumes
    bit for bit; no process outlives any of the three jobs."""
    ref = read_result(reference).losses
    run_dir = tmp_path / "job"
    folder = run_dir / "checkpoints"

    # SIGINT to the launcher of `titan-run ... &` while the ranks are parked after step 3.
    proc = _start(run_dir, background=True, env={"TITAN_TEST_PARK_AFTER": "3"})
    launcher = int(proc.stderr.readline())
    _wait_parked(run_dir, proc)
    t0 = time.monotonic()
    os.kill(launcher, signal.SIGINT)
    code, _, err = _finish(proc)
    took = time.monotonic() - t0
    assert _error_lines(err) == ["error: interrupted (Ctrl-C)"], err[-3000:]
    assert code == 130 and took < 10, (code, took)  # the ranks ignored SIGINT: 30 s, then SIGKILL
    assert _left_behind(proc) == []
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]

    # checkpoint.on_signal=USR1: resumes from step-2, parked after step 3, USR1 to the launcher.
    for p in run_dir.glob("parked-*"):
        p.unlink()
    proc = _start(run_dir, "checkpoint.on_signal=USR1", env={"TITAN_TEST_PARK_AFTER": "3"})
    _wait_parked(run_dir, proc)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out, err = _finish(proc)
    assert f"resumed from checkpoint {folder / 'step-2'} (step 2)" in out
    assert _error_lines(err) == [f"preempted: SIGUSR1 at step 3: checkpoint {folder / 'step-3'} saved; exit 75: "
                                 "run the same command again to resume"], err[-3000:]
    assert code == 75
    assert _left_behind(proc) == []
    assert "step-3" in [p.name for p in folder.iterdir()]

    # The requeued job: resumes from step-3 and trains 4-6 as the reference did.
    proc = _start(run_dir, "checkpoint.on_signal=USR1")
    code, out, err = _finish(proc)
    assert code == 0, err[-3000:]
    assert f"resumed from checkpoint {folder / 'step-3'} (step 3)" in out
    assert _left_behind(proc) == []
    assert read_result(run_dir).losses == ref  # steps 1-6 bit for bit


def test_nonfinite_steps_stop_or_are_skipped(tmp_path):
    """Issue 40.3: NaN logits on rank 1 at step 3. stop (default): one line naming the
    step and the rank, nothing saved over step-2. skip: no rank applies the update
    (every later loss stays finite; an applied NaN update would poison every shard),
    the step is listed in the summary."""
    run_dir = tmp_path / "stop"
    code, _, err = _finish(_start(run_dir, env={"TITAN_TEST_NAN": "3:1"}))
    assert _error_lines(err) == ["error: step 3: the loss is not finite on rank 1; training.nonfinite=stop ended "
                                 "the run before the optimizer step (nothing of it applied or saved; "
                                 "training.nonfinite=skip drops such steps)"], err[-3000:]
    assert code == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]

    run_dir = tmp_path / "skip"
    code, out, err = _finish(_start(run_dir, "training.nonfinite=skip", "metrics.console=true",
                                    env={"TITAN_TEST_NAN": "3:1"}))
    assert code == 0, err[-3000:]
    losses = read_result(run_dir).losses
    assert len(losses) == 6 and all(x == x for i, x in enumerate(losses) if i != 2), losses
    assert "warning: step 3: the loss is not finite on rank 1: optimizer step skipped" in out
    assert "non-finite  1 skipped (steps 3)" in out


# ------------------------------------------------ the same faults on fine-tuning runs
# Issue 40.4: a tiny qwen3 (the debug flavor, smaller) on 2 ranks, fsdp2, 6 steps, a
# checkpoint every 2 steps, on each fine-tuning path: LoRA on chat data (adapter-only
# checkpoints: the adapters, their optimizer state, the chat loader's position, data-loader
# workers) and, extended, DPO on preference pairs (full fine-tuning: the policy and its
# optimizer state). Issue 49.6: GRPO (rollout=native on the shipped arithmetic prompts:
# the completions sampled anew after a resume, seeded per prompt and step, must be the
# same tokens), and, extended, context parallelism (cp2: chat rows packed with block-causal
# masks, the sequence split over the 2 ranks) and model=hf on a tiny random Granite folder
# (outside the nine families the plugin is tested on; its scaled embeddings and logits).
FT_BASE = ["model=qwen3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
           "model.head_dim=16", "model.hidden_dim=128", "model.enable_weight_tying=false",
           *(o for o in BASE if not o.startswith(("model=", "training.seq_len=")))]
# model=hf: the folder (model.hf=DIR) is written by the fixture; random tokens over its vocabulary.
HF_BASE = ["model=hf", "data=synthetic", "data.vocab_size=256", "training.seq_len=32",
           *(o for o in BASE if not o.startswith(("model=", "training.seq_len=")))]
HF_ARCHITECTURE = "granite"
FINE_TUNING = {
    "lora_chat": ["peft=lora", "data=chat_sample", "training.seq_len=64"],
    "dpo": ["objective=dpo", "data=preference_sample", "training.seq_len=128"],
    # 1 prompt a rank, 4 completions of at most 6 tokens each; a reward the random policy
    # earns about half the time (the advantages are not all 0: every step trains)
    "grpo": ["objective=grpo", "data=prompts", "training.seq_len=64", "objective.max_completion_length=6",
             "objective.num_generations=4", "training.local_batch_size=1", "training.warmup_steps=0",
             "training.lr=0.01", "objective.reward_funcs=[format]",
             "+objective.reward_options.format.pattern='(?s)[a-z].*'"],
    "cp": ["parallelism=cp2", "data=chat_sample", "training.seq_len=64"],  # block_causal: chat_sample sets it
    "hf": [],
}


def _steps(run_dir: Path, first: int = 1, last: int = 6) -> list[tuple[float, float] | None]:
    """(loss, grad norm) of steps ``first``..``last`` (the last record of a step wins)."""
    result = read_result(run_dir)
    by_step = dict(zip(result.steps, zip(result.losses, result.grad_norms)))
    return [by_step.get(s) for s in range(first, last + 1)]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _completions(run_dir: Path, skip: int = 0) -> tuple[dict[int, list[dict]], int]:
    """GRPO's sampled completions by step, from the records after the first ``skip`` of
    ``completions.jsonl`` (rank 0 appends each step's: a launch's are the records it
    added), and the number of records."""
    import json

    path = run_dir / "completions.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    out: dict[int, list[dict]] = {}
    for record in records[skip:]:
        out.setdefault(record["step"], []).append(record)
    return out, len(records)


@pytest.fixture(scope="module", params=["lora_chat", "grpo", *(pytest.param(kind, marks=pytest.mark.extended)
                                                               for kind in ("dpo", "cp", "hf"))])
def fine_tuning(request, tmp_path_factory) -> tuple[str, Path, list[str]]:
    """The uninterrupted reference run of one fine-tuning kind (checkpoints step-2, -4, -6)
    and the overrides of its every launch."""
    kind = request.param
    work = tmp_path_factory.mktemp(kind)
    argv = [*FT_BASE, *FINE_TUNING[kind]]
    if kind == "hf":
        pytest.importorskip("titan_hf")
        from titan_hf.matrix_folders import tiny_folder

        argv = [*HF_BASE, f"model.hf={tiny_folder(HF_ARCHITECTURE, work / HF_ARCHITECTURE)}"]
    code, _, err = _finish(_start(work / "ref", base=argv))
    assert code == 0, err[-3000:]
    return kind, work / "ref", argv


# What each kind's job goes through after its reference run, each launch resuming the one
# before: (what, whom, where the ranks park, the step it resumes from, the checkpoint
# folder after it). "kill": SIGKILL of rank `whom`; "term": SIGTERM to the launcher (no
# checkpoint.on_signal); "preempt": checkpoint.on_signal=`whom` and that signal to every
# process of the job, as Slurm sends it (data-loader workers and the fork server too);
# "end": on to step 6. In a save: every rank parked inside the save of step-4, DCP has
# written all of it, the manifest and the rename have not happened.
# In a rollout: every rank parked inside rollout=native's generation of step 4, its prompts'
# forward done, no token sampled (step 4 not trained).
AFTER_3, IN_SAVE_4, AFTER_5 = ({"TITAN_TEST_PARK_AFTER": "3"}, {"TITAN_TEST_PARK_IN_SAVE": "4"},
                               {"TITAN_TEST_PARK_AFTER": "5"})
IN_ROLLOUT_4, IN_UPDATE_4 = {"TITAN_TEST_PARK_IN_ROLLOUT": "4"}, {"TITAN_TEST_PARK_IN_UPDATE": "4"}
FAULTS = {
    "lora_chat": [("kill", 0, IN_SAVE_4, 0, ["step-2", "step-4.tmp"]),  # rank 0 writes the manifest, renames
                  ("term", None, AFTER_5, 2, ["step-2", "step-4"]),  # the unfinished save pruned by the next
                  ("preempt", signal.SIGTERM, AFTER_5, 4, ["step-2", "step-4", "step-5"]),
                  ("end", None, {}, 5, ["step-4", "step-5", "step-6"])],  # keep_last=3
    "dpo": [("kill", 1, AFTER_3, 0, ["step-2"]),
            ("kill", 1, IN_SAVE_4, 2, ["step-2", "step-4.tmp"]),
            ("preempt", signal.SIGUSR1, AFTER_5, 2, ["step-2", "step-4", "step-5"]),
            ("end", None, {}, 5, ["step-4", "step-5", "step-6"])],
    "grpo": [("kill", 1, AFTER_3, 0, ["step-2"]),
             ("kill", 0, IN_ROLLOUT_4, 2, ["step-2"]),
             ("kill", 1, IN_UPDATE_4, 2, ["step-2"]),  # sampled and scored, backward done, no update
             ("kill", 1, IN_SAVE_4, 2, ["step-2", "step-4.tmp"]),
             ("preempt", signal.SIGTERM, AFTER_5, 2, ["step-2", "step-4", "step-5"]),
             ("end", None, {}, 5, ["step-4", "step-5", "step-6"])],
    "cp": [("kill", 0, AFTER_3, 0, ["step-2"]),
           ("kill", 1, IN_SAVE_4, 2, ["step-2", "step-4.tmp"]),
           ("end", None, {}, 2, ["step-2", "step-4", "step-6"])],
    "hf": [("kill", 1, AFTER_3, 0, ["step-2"]),
           ("kill", 0, IN_SAVE_4, 2, ["step-2", "step-4.tmp"]),
           ("end", None, {}, 2, ["step-2", "step-4", "step-6"])],
}


def _trained_to(park: dict[str, str]) -> int:
    """The last step a launch parked at ``park`` (or run to the end) trained."""
    if not park:
        return 6
    ((what, step),) = park.items()
    return int(step) - (what in ("TITAN_TEST_PARK_IN_ROLLOUT", "TITAN_TEST_PARK_IN_UPDATE"))


def _sampled_to(park: dict[str, str]) -> int:
    """The last step whose completions a launch parked at ``park`` wrote (an update parks
    after its step's rollout)."""
    return _trained_to(park) + ("TITAN_TEST_PARK_IN_UPDATE" in park)


def test_fine_tuning_faults_resume_bit_for_bit(tmp_path, fine_tuning):
    """The faults of FAULTS, one launch each. Every stop ends in one line and leaves no
    process 3 s after; every launch resumes from the newest complete checkpoint and trains
    each of its steps bit for bit like the uninterrupted run (loss and gradient norm;
    GRPO: the very completions, sampled anew); the last ends at step 6 with the
    reference's steps 1-6."""
    kind, ref_dir, argv = fine_tuning
    ref = _steps(ref_dir)
    assert None not in ref, ref
    sampled, seen = _completions(ref_dir)[0], 0
    if kind == "grpo":  # 2 ranks x 1 prompt x 4 completions a step, every step
        assert sorted(sampled) == [1, 2, 3, 4, 5, 6] and {len(v) for v in sampled.values()} == {8}, sampled.keys()
    if kind == "lora_chat":  # adapter-only checkpoints: no frozen base weight in them
        import torch.distributed.checkpoint as dcp

        keys = dcp.FileSystemReader(str(ref_dir / "checkpoints" / "step-2")).read_metadata().state_dict_metadata
        weights = [k for k in keys if k.startswith("model.")]
        assert weights and all(".lora_" in k for k in weights), sorted(keys)
    run_dir, folder = tmp_path / "job", tmp_path / "job" / "checkpoints"
    before: subprocess.Popen | None = None
    for what, whom, park, start, after in FAULTS[kind]:
        for p in run_dir.glob("parked-*"):
            p.unlink()
        on_signal = [f"checkpoint.on_signal={whom.name[3:]}"] if what == "preempt" else []
        proc = _start(run_dir, *on_signal, env=park, base=argv)
        if park:
            _wait_parked(run_dir, proc)
        if before is not None:  # meanwhile (each launch has a session of its own)
            assert _left_behind(before) == [], what
        if what == "kill":
            os.kill(_rank_pid(run_dir, whom), signal.SIGKILL)
            lines, want = [f"error: rank {whom} was killed by signal SIGKILL"], 137
        elif what == "term":
            os.kill(proc.pid, signal.SIGTERM)
            lines, want = ["error: terminated by signal SIGTERM"], 128 + signal.SIGTERM
        elif what == "preempt":
            os.killpg(proc.pid, whom)
            lines, want = [f"preempted: {whom.name} at step 5: checkpoint {folder / 'step-5'} saved; exit 75: "
                           "run the same command again to resume"], 75
        else:
            lines, want = [], 0
        code, out, err = _finish(proc)
        assert (_error_lines(err), code) == (lines, want), (what, err[-3000:])
        assert (f"resumed from checkpoint {folder / f'step-{start}'} (step {start})" in out) == bool(start), what
        last = _trained_to(park)
        assert _steps(run_dir, start + 1, last) == ref[start:last], what  # what this launch trained
        if kind == "grpo":  # the completions it sampled (none of a step parked in its rollout): the reference's
            new, seen = _completions(run_dir, seen)  # tokens, rewards and advantages
            assert new == {s: sampled[s] for s in range(start + 1, _sampled_to(park) + 1)}, (what, park)
        assert _names(folder) == after, what
        before = proc
    assert _left_behind(before) == []
    assert _steps(run_dir) == ref

"""Preemption (``checkpoint.on_signal``): on the chosen signal every rank saves a
checkpoint at the next step boundary and the job exits ``PREEMPTED_EXIT`` (75,
"preempted, resume me"); the same command run again resumes from that checkpoint.

The signal reaches a rank from the launcher (``launcher.launch(forward=...)``, which
passes it to the ranks alone), from Slurm (``srun`` forwards ``scancel --signal``
and ``--signal=USR1@T`` to the tasks) or from a user's ``kill``. Its handler only
raises a flag (``rank_signals``). At each step boundary the ranks all-reduce
(MAX) the signal number they saw, so that they all stop after the same step even
when the signal reached them at different times.

``check_on_signal`` (before launch): the option needs checkpoints on.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from titan_plugins.distributed.rank_signals import (
    PREEMPTED_EXIT,
    PREEMPTED_FILE,
    install_preemption,
    preemption_requested,
)
from titan_plugins.errors import ConfigError, TitanError

__all__ = ["Preempted", "Preemption", "check_on_signal", "signal_of"]


class Preempted(TitanError):
    """The ranks saved on the preemption signal and stop; the job exits 75."""

    exit_code = PREEMPTED_EXIT


def signal_of(value: Any) -> signal.Signals | None:
    """``checkpoint.on_signal`` (``USR1``, an Enum member, ``None``) as a signal."""
    if value is None:
        return None
    return signal.Signals[f"SIG{getattr(value, 'value', value)}"]


def check_on_signal(job: Any) -> None:
    value = job.checkpoint.get("on_signal")
    if value is not None and not job.checkpoint.enabled:
        raise ConfigError(f"checkpoint.on_signal={getattr(value, 'value', value)} needs checkpoints: set "
                          "checkpoint.enabled=true (or checkpoint=periodic)")


def _spare_data_workers(sig: signal.Signals) -> None:
    """This rank's data-loader workers live through ``sig`` from anyone but their parent.

    Slurm signals every process of a step (``scancel --signal``, SIGTERM at the time
    limit), and torch's workers end on a SIGTERM that does not come from their parent:
    the rank then failed with "DataLoader worker ... is killed by signal" instead of
    saving. A worker has nothing to save, but it must still end when its parent
    terminates it (the loader's and multiprocessing's shutdown), so it does not simply
    ignore the signal: a thread takes it (``sigwaitinfo`` names the sender) and ends the
    worker only when the parent sent it, the rule torch's own handler applies. Set where
    the workers (torch's and torchdata's) install their handlers, after them."""
    from torch.utils.data._utils import signal_handling

    original = signal_handling._set_worker_signal_handlers
    if getattr(original, "titan_spares", None) == sig:
        return

    def set_worker_signal_handlers(*args: Any) -> None:
        original(*args)
        parent = os.getppid()
        signal.pthread_sigmask(signal.SIG_BLOCK, {sig})  # this thread and every later one

        def take() -> None:
            while True:
                if signal.sigwaitinfo({sig}).si_pid == parent:
                    os._exit(0)  # as torch's handler does on its parent's SIGTERM

        threading.Thread(target=take, name="titan-spare-signal", daemon=True).start()

    set_worker_signal_handlers.titan_spares = sig  # type: ignore[attr-defined]
    signal_handling._set_worker_signal_handlers = set_worker_signal_handlers


class Preemption:
    """Installed on every rank when ``checkpoint.on_signal`` is set."""

    def __init__(self, job: Any, device: torch.device) -> None:
        self.signal = signal_of(job.checkpoint.get("on_signal"))
        self.device = device
        if self.signal is not None:
            _spare_data_workers(self.signal)
            install_preemption(self.signal)

    def due(self) -> signal.Signals | None:
        """The signal when any rank has seen it (a collective: every rank calls it per step)."""
        if self.signal is None:
            return None
        seen = preemption_requested()
        code = int(seen) if seen is not None else 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return signal.Signals(code) if code else None

    def stop(self, sig: signal.Signals, step: int, saved: os.PathLike | str, rank: int) -> Preempted:
        """The error that ends the rank (exit 75); rank 0 also leaves the line for the launcher."""
        line = (f"preempted: {sig.name} at step {step}: checkpoint {saved} saved; exit {PREEMPTED_EXIT}: "
                "run the same command again to resume")
        from titan_plugins.failures import FAILURE_DIR_ENV

        # Saved: what is left is to exit 75. Under `srun --kill-on-bad-exit` the first rank
        # to exit makes Slurm SIGTERM the others, and Python's shutdown puts the default
        # action back on signals it handles: a rank still shutting down died of it and
        # the step ended 143, not 75. Ignored signals stay ignored through shutdown
        # (SIGKILL after Slurm's KillWait still ends a rank that hangs).
        for ignored in {signal.SIGTERM, self.signal or sig}:
            signal.signal(ignored, signal.SIG_IGN)
        folder = os.environ.get(FAILURE_DIR_ENV)
        if rank == 0 and folder:
            path = os.path.join(folder, PREEMPTED_FILE)
            with open(f"{path}.tmp", "w") as f:
                f.write(line + "\n")
            os.replace(f"{path}.tmp", path)
        return Preempted(line)

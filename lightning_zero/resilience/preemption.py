"""A checkpoint when the scheduler announces the end: SIGTERM, or SLURM's requeue signal (SIGUSR1).

[Note: preemption]
A signal arrives at one rank or at all of them, at any instruction: in the middle of a backward, inside a
collective. Nothing may happen there. Lightning's own handlers do too much there for a sharded run: the
SIGTERM one broadcasts a tensor from inside the handler (a collective at a point the other ranks do not
share), and SLURM's SIGUSR1 one saves the whole checkpoint from inside it. ``PreemptionCheckpoint``
replaces them when training starts with a handler that only notes the signal (outside training, in the
sanity check and in validate/test/predict runs, the strategy has a signal end the process at once). At the end of every
optimizer step (``on_train_batch_end`` of a step's last micro-batch: the event where ModelCheckpoint saves,
from which Lightning resumes exactly) the ranks agree with one 4-byte all-reduce (MAX) whether any of them
was signalled, so all of them stop at the same step even when only one got the signal. Then every rank
writes the sharded checkpoint, rank 0 asks SLURM to requeue the job (under SLURM with auto-requeue), and
every rank raises ``Preempted``, a ``SystemExit`` with code 128 + the signal's number (143 for SIGTERM,
138 for SIGUSR1: what a shell reports for a process the signal ended, so launchers count the run as not
finished and restart it). The next launch resumes with ``ckpt_path="last"`` (or
``lightning_zero.checkpoint.format.latest(dirpath)``; under SLURM, Lightning's own hpc resume finds it).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightning_zero.sharding import collectives

log = logging.getLogger(__name__)

SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint (``PreemptionCheckpoint``); ``code`` is the process's
    exit status (128 + the signal's number by default), so a launcher counts the run as not finished. A
    ``SystemExit``: ``except Exception`` does not catch it, and the interpreter exits with that status."""


def _signal_number(name: str | int) -> int:
    if isinstance(name, int):
        return name
    number = getattr(signal, str(name).upper(), None)
    if not isinstance(number, signal.Signals):
        raise ValueError(f"unknown signal {name!r}: name one like 'SIGTERM' or 'SIGUSR1'")
    return int(number)


class PreemptionCheckpoint(Callback):
    """On any of ``signals``, every rank finishes its optimizer step, writes ``dirpath/filename.ckpt`` and
    exits with ``exit_code`` (default 128 + the signal's number); see [Note: preemption].

    ``dirpath`` defaults to the trainer's ModelCheckpoint directory (so ``ckpt_path="last"`` finds the
    checkpoint), else ``default_root_dir/checkpoints``. Under SLURM with auto-requeue (Lightning's
    ``SLURMEnvironment``) the checkpoint goes where Lightning's requeued job looks for it
    (``default_root_dir/hpc_ckpt_N.ckpt``, whichever signal came), and on the requeue signal rank 0
    requeues the job. ``save=False`` stops the same way
    without writing. The ZeRO strategies add one with the defaults when the trainer has none
    (``save=ZeroConfig.checkpoint_on_signal``); pass your own in ``callbacks`` to choose where or how it stops.

    The ranks agree whether any of them was signalled at the end of every optimizer step (one 4-byte all-reduce),
    so all of them stop at the same step even when only one got the signal. The next launch resumes with
    ``ckpt_path="last"`` (under SLURM, Lightning's own requeued-job resume finds the checkpoint).

    Args:
        dirpath: the directory of the checkpoint; None: the trainer's ModelCheckpoint directory, else
            ``default_root_dir/checkpoints``.
        filename: the checkpoint's name, without ``.ckpt``.
        signals: the signals that stop the run, by name (``"SIGTERM"``) or number.
        exit_code: the exit status of every rank; None: 128 + the signal's number (143 for SIGTERM).
        save: write the checkpoint before stopping (False: stop at the same step boundary without writing).

    Raises:
        ValueError: a name in ``signals`` that is no signal's.
        Preempted: (a SystemExit) on every rank at the step boundary after a signal (with ``save``: once saved).

    Example:
        ```python
        trainer = Trainer(strategy="zero2", callbacks=[lightning_zero.PreemptionCheckpoint(dirpath="ckpts")])
        ```
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str = "last",
        signals: tuple[str | int, ...] = SIGNALS,
        exit_code: int | None = None,
        save: bool = True,
    ) -> None:
        self.dirpath, self.filename, self.exit_code, self.save = dirpath, filename, exit_code, save
        self.signals = tuple(_signal_number(s) for s in signals)
        self.received = 0  # the first signal this rank got; written by the handler, nothing else there
        self._previous: dict[int, Any] = {}
        self._step = -1
        self._group = None  # the world's group for the flag, a host tensor (see _host_world)
        self.saved_path: str | None = None

    # --- the handler: notes the signal, nothing more ----------------------------------------------
    def _note_signal(self, signum: int, frame: Any) -> None:
        if not self.received:
            self.received = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning registered its handlers just before the run; these replace them until the run ends."""
        self.received, self._step = 0, trainer.global_step
        self._group = _host_world(trainer)
        environment = _slurm_requeue(trainer)
        signals = {*self.signals, *([int(environment.requeue_signal)] if environment is not None else [])}
        for signum in sorted(signals):
            try:
                self._previous[signum] = signal.signal(signum, self._note_signal)
            except ValueError:  # not the main thread: Lightning's own handlers were not set either
                break

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    # --- the step boundary: agree, save, stop -----------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._step:  # inside an accumulation window: no optimizer step yet
            return
        self._step = trainer.global_step
        signum = self._agree(self.received, self._group)
        if not signum:
            return
        name = signal.Signals(signum).name
        if self.save:
            self.saved_path = self._path(trainer)
            if not _saved_already(trainer, self.saved_path):  # ModelCheckpoint's last.ckpt of this very step
                trainer.save_checkpoint(self.saved_path)
            finish = getattr(trainer.strategy, "finish_saves", None)
            if finish is not None:  # a save finishing in the background is done before the exit
                finish()
            if trainer.is_global_zero:
                log.warning(f"{name}: saved {self.saved_path} at step {trainer.global_step}; exiting")
        environment = _slurm_requeue(trainer)
        if environment is not None and signum == int(environment.requeue_signal) and trainer.is_global_zero:
            _requeue_slurm_job()
        code = self.exit_code if self.exit_code is not None else 128 + signum
        raise Preempted(code)

    @staticmethod
    def _agree(received: int, group) -> int:
        """The largest signal number any rank received (0: none); one collective per optimizer step."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return received
        flag = torch.tensor([received], dtype=torch.int32)
        return int(collectives.all_reduce(flag, dist.ReduceOp.MAX, group=group).item())

    def _path(self, trainer: pl.Trainer) -> str:
        if _slurm_requeue(trainer) is not None and self.dirpath is None:  # where a requeued job looks, any signal
            return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        dirpath = self.dirpath
        if dirpath is None:
            checkpoint = trainer.checkpoint_callback
            dirpath = checkpoint.dirpath if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath else None
        if dirpath is None:
            dirpath = Path(trainer.default_root_dir) / "checkpoints"
        return str(Path(dirpath) / f"{self.filename}.ckpt")


def _host_world(trainer: pl.Trainer):
    """A group of every rank that takes CPU tensors: the ZeRO strategies' (topology.py), the world under gloo,
    else one made now (collective: every rank starts training together)."""
    topology = getattr(trainer.strategy, "topology", None)
    if topology is not None:
        return topology.host_world
    if not (dist.is_available() and dist.is_initialized()) or "gloo" in str(dist.get_backend()):
        return None
    return dist.new_group(backend="gloo")


def _saved_already(trainer: pl.Trainer, path: str) -> bool:
    """ModelCheckpoint wrote ``path`` at this global step (the same on every rank): no second save."""
    checkpoint = trainer.checkpoint_callback
    return (
        isinstance(checkpoint, ModelCheckpoint)
        and bool(checkpoint.last_model_path)
        and os.path.abspath(checkpoint.last_model_path) == os.path.abspath(path)
        and getattr(checkpoint, "_last_global_step_saved", None) == trainer.global_step
    )


def _slurm_requeue(trainer: pl.Trainer) -> SLURMEnvironment | None:
    """Lightning's SLURM environment when it requeues jobs (auto-requeue), else None."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return environment
    return None


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` for this job (or array task), as Lightning's SLURM handler does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job):
        log.warning(f"not requeueing: SLURM job id {job!r} is not a job id")
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], check=False, timeout=60).returncode
    except (FileNotFoundError, subprocess.TimeoutExpired) as error:
        log.warning(f"cannot requeue SLURM job {job}: {error}")
        return
    if result == 0:
        log.warning(f"requeued SLURM job {job}")
    else:
        log.warning(f"requeueing SLURM job {job} failed: scontrol exited with {result}")


def end_on_signal_outside_training(trainer: pl.Trainer) -> None:
    """Sanity check, validate, test, predict: Lightning's handlers would still run a collective inside the
    handler. Here a signal ends the process at once instead, as it would with no handler at all: there is
    nothing to save, and the other ranks leave through peer_failure.py."""
    if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
        return  # training's own validation: PreemptionCheckpoint's handler stays, acted on after the next step
    for name in SIGNALS:
        try:
            signal.signal(_signal_number(name), _end_now)
        except ValueError:  # not the main thread: Lightning set no handlers either
            return


def _end_now(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def ensure_preemption_callback(trainer: pl.Trainer, *, save: bool) -> None:
    """Adds a ``PreemptionCheckpoint`` with the defaults unless the trainer has one (ZeRO strategies' set-up)."""
    if not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
        trainer.callbacks.append(PreemptionCheckpoint(save=save))

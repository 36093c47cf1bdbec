"""The Trainer's checkpoints under ZeroStrategy: what its checkpoint hooks keep between Lightning's calls
(the checkpoint opened for a restore, the random generators to set again) and the work they delegate
(``lightning_zero.checkpoint`` and the engine do the rest).

[Note: generators across a resume]
Besides the shards, a save records every rank's random generators (checkpoint/rng.py). A run resumed on as
many ranks sets them again as its first training batch starts. Validation draws from them (a plain
validation loader's iterator takes its base seed from torch's generator), and under ddp it moves training's
random stream: so it does here, and a run equals ddp's draw for draw. But a checkpoint saved at the end of a
training batch (``every_n_train_steps``) is followed by a validation that the resumed run skips
(Lightning fast-forwards it): the resumed run needs the generators as that validation left them. So the
checkpoints saved between a training step and the validation after it are remembered, and when that
validation ends every rank's generators are gathered and rank 0 writes them into each of those checkpoints
(``rng_after_validation.pt``, one atomic write, after the checkpoint's save has succeeded), which a resume
takes instead of the states saved in it. A run killed during that validation resumes with the states saved
before it (its draws then differ from the uninterrupted run's from there; nothing else does).

[Note: a last.ckpt that names nothing]
ModelCheckpoint(save_last="link") links last.ckpt to the checkpoint it has just saved; the link resolves to a
complete checkpoint at every instant (a removal first points it at the newest other one, save.py's ``remove``; a
background save's name stands in for the newest complete checkpoint until it is published, save.py's [Note: a
background save's name]). What remains is Lightning's own relinking (unlink, then link: microseconds), after
which a missing or dangling ``last*.ckpt`` given as the path resumes from the newest complete checkpoint beside
it (``complete_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module

from lightning_zero.checkpoint import rng
from lightning_zero.checkpoint import save as checkpoint_save
from lightning_zero.checkpoint.format import CheckpointError, latest
from lightning_zero.checkpoint.restore import Restore
from lightning_zero.checkpoint.save import Observer
from lightning_zero.engine import ZeroEngine
from lightning_zero.sharding import collectives
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


def complete_checkpoint(path: Any) -> Any:
    """What to resume when ``path`` names nothing because a save or a link was interrupted: the newest complete
    checkpoint beside it. Lightning's SLURM resume takes the highest N among names containing ``hpc_ckpt_``, hidden
    ones included: after a save killed mid-way (``.hpc_ckpt_3.ckpt.partial``) it names one that does not exist
    (then the newest ``hpc_ckpt_N.ckpt``); a ``last*.ckpt`` link killed while relinked is missing or dangling
    (see [Note: a last.ckpt that names nothing])."""
    path = Path(path)
    hpc = re.fullmatch(r"hpc_ckpt_\d+\.ckpt", path.name)
    last = re.fullmatch(r"last.*\.ckpt", path.name)
    if path.exists() or not (hpc or last) or not path.parent.is_dir():
        return path
    newest = latest(path.parent)
    if newest is None or (hpc and not newest.name.startswith("hpc_ckpt_")):
        return path
    if hpc:
        rank_zero_info(f"{path.name} does not exist (an interrupted save); resuming from {newest}, the newest complete")
    else:
        rank_zero_warn(f"{path} names no checkpoint (an interrupted link); resuming from {newest}, the newest complete")
    return newest


def _write_after_validation(paths: list[Path], record: dict[str, Any]) -> None:
    """Rank 0, in the training thread: never raises (a checkpoint without the file resumes as before)."""
    for path in paths:
        try:
            rng.write_after_validation(path, record)
        except (OSError, CheckpointError) as error:
            rank_zero_warn(f"lightning_zero: {path}: the generators after validation were not recorded: {error}")


def zero_optimizers(optimizers: list) -> list[ZeroOptimizer]:
    """The ZeroOptimizers among ``optimizers``, in order."""
    return [o for o in optimizers if isinstance(o, ZeroOptimizer)]


class TrainerCheckpoints:
    """Between Lightning's checkpoint calls: the checkpoint opened for a restore (``open`` to the loads), the
    generators (see [Note: generators across a resume]) and ``on_phase``, told of each point a save or removal
    reaches (checkpoint/save.py's [Note: observing a save])."""

    def __init__(self, on_phase: Observer | None = None) -> None:
        self.on_phase = on_phase
        self.restore: Restore | None = None  # between open and load_optimizers
        self.pending_rng: dict[str, Any] | None = None  # resumed: set as the first training batch starts
        self.before_validation: list[Path] = []  # saved since the last training step, before any validation
        self.step_ended = False  # fitting: a training step ended and no training batch started since
        self.validating = False  # a validation while fitting

    def save(
        self,
        engine: ZeroEngine,
        checkpoint: dict[str, Any],
        path: Any,
        *,
        module: Module,
        optimizers: list,
        world_size: int,
    ) -> None:
        """Writes the checkpoint directory: each rank its own shards, rank 0 Lightning's state and every rank's
        generators (collective; checkpoint/format.py)."""
        engine.settle()
        mine = rng.capture()
        states = collectives.gather_object(mine) if world_size > 1 else [mine]
        checkpoint = {**checkpoint, rng.KEY: {"world_size": world_size, "states": states}}
        engine.save(checkpoint, path, module=module, optimizers=zero_optimizers(optimizers), on_phase=self.on_phase)
        if self.step_ended and not self.validating:  # a validation may follow (see the Note)
            self.before_validation.append(Path(path))

    def remove(self, engine: ZeroEngine | None, path: Any, *, rank: int) -> None:
        """ModelCheckpoint's top-k (checkpoint/save.py's ``remove``); after the save that replaces it has succeeded,
        when saves finish in the background."""
        removal = functools.partial(checkpoint_save.remove, path, rank=rank, on_phase=self.on_phase)
        if engine is not None:
            engine.after_saves(removal)
        else:
            removal()

    def open(
        self, engine: ZeroEngine, path: Any, *, module: pl.LightningModule, optimizers: list, trusted: bool
    ) -> dict:
        """Checks a sharded checkpoint directory (any world size and stage) on every rank, or reads a plain
        Lightning checkpoint file (ddp's or one device's) or a torch.distributed.checkpoint directory (FSDP2's,
        torchtitan's), once a save of ours in flight has finished; returns Lightning's part of it."""
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        rank, world_size = engine.rank, engine.topology.shard_size * engine.topology.replicas  # (Lightning's)
        engine.finish_saves()
        path = complete_checkpoint(path)
        with torch.serialization.safe_globals(hyperparameter_types(module)):
            self.restore = engine.load(path, module=module, optimizers=zero_optimizers(optimizers), trusted=trusted)
        lightning = self.restore.lightning
        saved = lightning.pop(rng.KEY, None)
        if fitting and saved is not None:  # (a directory of ours: see the Note)
            saved = rng.read_after_validation(Path(path)) or saved
        self.pending_rng = None
        if not fitting:
            pass  # validate/test/predict from a checkpoint: the generators are the run's own
        elif saved is not None and saved["world_size"] == world_size:
            self.pending_rng = saved["states"][rank]
        elif saved is not None:
            rank_zero_info(
                f"random generator states not restored: saved on {saved['world_size']} ranks, resuming on"
                f" {world_size} (dropout and other draws continue from the seeded state)"
            )
        return lightning

    def training_batch_starts(self) -> None:
        """As a training batch starts: a resumed run's generators are set (the first time), and the checkpoints
        saved since the last training step are forgotten: no validation followed them (see the Note)."""
        if self.pending_rng is not None:
            rng.restore(self.pending_rng)
            self.pending_rng = None
        self.step_ended, self.before_validation = False, []

    def training_step_ended(self) -> None:
        """After a training step: a checkpoint saved from now may be followed by a validation (see the Note)."""
        self.step_ended = True

    def fit_validation_starts(self) -> None:
        """As a validation while fitting starts: checkpoints saved during it are not remembered (see the Note)."""
        self.validating = True

    def fit_validation_ended(self, engine: ZeroEngine, world_size: int) -> None:
        """The generators as validation left them go into the checkpoints saved before it (collective; see the
        Note)."""
        paths, self.before_validation, self.validating = self.before_validation, [], False
        if not paths:
            return
        mine = rng.capture()
        states = collectives.gather_object(mine) if world_size > 1 else [mine]
        if engine.rank == 0:
            record = {"world_size": world_size, "states": states}
            engine.after_saves(functools.partial(_write_after_validation, paths, record))

    def load_model(self, module: Module) -> None:
        """The weights, and a weight average where the checkpoint has one: into the averaging callback's while
        fitting with one; else, where it is what the checkpoint presents as the weights (WeightAveraging's), into
        the model, as ddp's checkpoint holds it as its state_dict (see checkpoint/format.py)."""
        self.restore.model(module, exported_average_as_weights=True)

    def load_optimizers(self, optimizers: list) -> None:
        """The optimizer state of ``optimizers``' ZeroOptimizers from the opened checkpoint, which is then let go."""
        self.restore.optimizers(zero_optimizers(optimizers))
        self.restore = None

    def clear(self) -> None:
        """Forgets everything kept between calls (at teardown): the opened checkpoint, generators, saves."""
        self.restore = self.pending_rng = None
        self.before_validation = []
        self.step_ended = self.validating = False


def hyperparameter_types(module: pl.LightningModule) -> list[type]:
    """The dataclasses among ``module``'s own hyper-parameters (a ``GPTConfig``), which its checkpoints hold: safe
    loading may rebuild those, and only those, since this module builds them itself. (Lightning does not hand
    ``trainer.fit``'s ``weights_only`` to a strategy that restores after set-up, so without this a module whose
    hyper-parameters are a dataclass could not resume safely from the Trainer at all.)"""
    values = module.hparams.values() if hasattr(module, "hparams") else ()
    return list(dict.fromkeys(type(v) for v in values if dataclasses.is_dataclass(v) and not isinstance(v, type)))

"""The Trainer's checkpoints under ZeroStrategy: what its checkpoint hooks keep between Lightning's calls
(the checkpoint opened for a restore, the random generators to set again) and the work they delegate
(``lightning_zero.checkpoint`` and the engine do the rest).

[Note: generators across a resume]
Besides the shards, a save records every rank's random generators (checkpoint/rng.py). A run resumed on as
many ranks sets them again as its first training batch starts. What runs between a training batch and the
next one in the uninterrupted run but not in the resumed one is validation (ModelCheckpoint saves before
it), and validation draws: a plain validation loader's iterator takes its base seed from torch's generator.
So while fitting, torch's (CPU and CUDA) and Python's generators as the last training step left them are
put back when validation ends: validation never moves training's random stream, and the two runs draw the
same dropout masks. (NumPy's global generator is saved and resumed but not put back after validation: it
costs 10x the others to copy at every step, and validation rarely draws from it.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.checkpoint import rng
from lightning_zero.checkpoint.format import latest
from lightning_zero.engine import ZeroEngine
from lightning_zero.sharding import collectives
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


def complete_hpc_checkpoint(path: Any) -> Any:
    """Lightning's SLURM resume takes the highest N among names containing ``hpc_ckpt_``, hidden ones
    included: after a save killed mid-way (``.hpc_ckpt_3.ckpt.partial``) it names a checkpoint that does not
    exist. Then the newest complete ``hpc_ckpt_N.ckpt`` beside it is the one to resume."""
    path = Path(path)
    if path.exists() or not re.fullmatch(r"hpc_ckpt_\d+\.ckpt", path.name) or not path.parent.is_dir():
        return path
    newest = latest(path.parent)
    if newest is None or not newest.name.startswith("hpc_ckpt_"):
        return path
    rank_zero_info(f"{path.name} does not exist (an interrupted save); resuming from {newest}, the newest complete")
    return newest


def zero_optimizers(optimizers: list) -> list[ZeroOptimizer]:
    return [o for o in optimizers if isinstance(o, ZeroOptimizer)]


class TrainerCheckpoints:
    """Between Lightning's checkpoint calls: the opened checkpoint (``open`` to the restores) and the
    generators (see [Note: generators across a resume])."""

    def __init__(self) -> None:
        self.loaded: checkpoint_io.LoadedCheckpoint | None = None  # between open and load_optimizers
        self.pending_rng: dict[str, Any] | None = None  # resumed: set as the first training batch starts
        self.rng_after_step: tuple | None = None  # fitting: the generators as the last training step left them

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
        engine.save(checkpoint, path, module=module, optimizers=zero_optimizers(optimizers))

    def open(
        self, path: Any, *, rank: int, world_size: int, module: Module, optimizers: list, fitting: bool, trusted: bool
    ) -> dict:
        """Checks a sharded checkpoint directory (any world size and stage) on every rank, or reads a plain
        Lightning checkpoint file (ddp's or one device's) or a torch.distributed.checkpoint directory (FSDP2's,
        torchtitan's); returns Lightning's part of it."""
        self.loaded = checkpoint_io.open_checkpoint(
            complete_hpc_checkpoint(path),
            rank=rank,
            world_size=world_size,
            optimizer_names=[o.param_names() for o in zero_optimizers(optimizers)],
            model_names=list(module.state_dict(keep_vars=True)),
            weights_only=not trusted,
        )
        lightning = self.loaded.lightning
        saved = lightning.pop(rng.KEY, None)
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
        if self.pending_rng is not None:
            rng.restore(self.pending_rng)
            self.pending_rng = None

    def training_step_ended(self) -> None:
        self.rng_after_step = rng.snapshot()

    def fit_validation_ended(self) -> None:
        if self.rng_after_step:
            rng.put_back(self.rng_after_step)

    def load_model(self, engine: ZeroEngine, module: Module) -> None:
        """The weights, and a weight average where the checkpoint has one: into the averaging callback's while
        fitting with one; else, where it is what the checkpoint presents as the weights (WeightAveraging's), into
        the model, as ddp's checkpoint holds it as its state_dict (see checkpoint/format.py)."""
        engine.settle()
        saved, average = self.loaded.average, engine.average
        as_weights = average is None and saved is not None and saved["exported"]
        group = engine.topology.shard_group
        checkpoint_io.load_model(self.loaded, module, engine.units, group=group, averaged=as_weights)
        if average is not None and saved is not None:
            checkpoint_io.load_average(self.loaded, average)
        elif average is not None:  # as Lightning's callbacks do: the average starts from the loaded weights
            average.restart()

    def load_optimizers(self, optimizers: list) -> None:
        # Like Lightning's own restore (a zip): a checkpoint saved outside fit has no optimizers to restore.
        for index, optimizer in enumerate(zero_optimizers(optimizers)[: len(self.loaded.meta.optimizers)]):
            checkpoint_io.load_optimizer(self.loaded, index, optimizer)
        self.loaded = None

    def clear(self) -> None:
        self.loaded = self.pending_rng = self.rng_after_step = None

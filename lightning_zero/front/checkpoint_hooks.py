"""The ZeRO strategy's checkpoint hooks: Lightning calls them, ``lightning_zero.checkpoint`` does the work.

A mixin of ``ZeroStrategy`` (strategy.py), kept apart so that the strategy file holds set-up and steps.

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
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.checkpoint import rng
from lightning_zero.checkpoint import save as checkpoint_save
from lightning_zero.checkpoint.format import latest
from lightning_zero.sharding import collectives
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


def _complete_hpc_checkpoint(path: Any) -> Any:
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


class CheckpointHooks:
    """Lightning's checkpoint hooks for ``ZeroStrategy`` (uses its units, optimizers and topology)."""

    _pending_rng: dict[str, Any] | None = None  # resumed: generators to set as the first training batch starts
    _rng_after_step: tuple | None = None  # fitting: the generators as the last training step left them

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a sharded checkpoint is loaded into the units, which exist after set-up

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # sharded: each rank writes its own part in save_checkpoint; nothing is gathered

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Writes the checkpoint as a directory: each rank its own shards (collective; see checkpoint/format.py)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        self._settle()
        mine = rng.capture()  # rank 0 writes Lightning's state, so only it holds every rank's generators
        states = collectives.gather_object(mine) if self.world_size > 1 else [mine]
        checkpoint = {**checkpoint, rng.KEY: {"world_size": self.world_size, "states": states}}
        optimizers = [o for o in self.optimizers if isinstance(o, ZeroOptimizer)]
        self.engine.save(checkpoint, filepath, module=self.lightning_module, optimizers=optimizers)

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k: hidden first, then deleted, so a half-removed one is never visible."""
        checkpoint_save.remove(filepath, rank=self.global_rank)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Checks a sharded checkpoint directory (saved at any world size and stage) on every rank, or
        reads a plain Lightning checkpoint file (from ``ddp`` or one device: migration in).

        Pickled state is loaded with ``weights_only=True`` unless ``trainer.fit(..., weights_only=False)``
        says the file is trusted."""
        self._loaded = checkpoint_io.open_checkpoint(
            _complete_hpc_checkpoint(checkpoint_path),
            rank=self.global_rank,
            world_size=self.world_size,
            optimizer_names=[o.param_names() for o in self.optimizers if isinstance(o, ZeroOptimizer)],
            weights_only=weights_only is not False,
        )
        lightning = self._loaded.lightning
        saved = lightning.pop(rng.KEY, None)
        self._pending_rng = None
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            pass  # validate/test/predict from a checkpoint: the generators are the run's own
        elif saved is not None and saved["world_size"] == self.world_size:
            self._pending_rng = saved["states"][self.global_rank]
        elif saved is not None:
            rank_zero_info(
                f"random generator states not restored: saved on {saved['world_size']} ranks, resuming on"
                f" {self.world_size} (dropout and other draws continue from the seeded state)"
            )
        return lightning

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._pending_rng is not None:  # see [Note: generators across a resume]
            rng.restore(self._pending_rng)
            self._pending_rng = None

    def on_validation_end(self) -> None:
        super().on_validation_end()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self._rng_after_step:
            rng.put_back(self._rng_after_step)  # see [Note: generators across a resume]

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The weights, and a weight average where the checkpoint has one: into the averaging callback's while
        fitting with one; else, where it is what the checkpoint presents as the weights (WeightAveraging's), into
        the model, as ddp's checkpoint holds it as its state_dict (see checkpoint/format.py)."""
        self._settle()
        saved, average = self._loaded.average, self._average
        as_weights = average is None and saved is not None and saved["exported"]
        group = self.topology.shard_group
        checkpoint_io.load_model(self._loaded, self.lightning_module, self._units, group=group, averaged=as_weights)
        if average is not None and saved is not None:
            checkpoint_io.load_average(self._loaded, average)
        elif average is not None:  # as Lightning's callbacks do: the average starts from the loaded weights
            average.restart()

    def parameter_norms(self, norm_type: float = 2.0) -> dict[str, Any]:
        """Each parameter's norm and the total, from the shards: nothing is gathered (sharding/full_state.py).
        Collective: call it on every rank, anywhere (between steps and after ``fit`` too)."""
        return self.engine.parameter_norms(self.lightning_module, norm_type)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        zero_optimizers = [o for o in self.optimizers if isinstance(o, ZeroOptimizer)]
        # Like Lightning's own restore (a zip): a checkpoint saved outside fit has no optimizers to restore.
        for index, optimizer in enumerate(zero_optimizers[: len(self._loaded.meta.optimizers)]):
            checkpoint_io.load_optimizer(self._loaded, index, optimizer)
        self._loaded = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full, unsharded state dict on every rank, in fp32 where training is mixed (the masters; see
        sharding/full_state.py), on the CPU (collective: call it on every rank). For Lightning's own checkpoint
        dump nothing is gathered: the sharded checkpoint writes each rank's shards (see ``save_checkpoint``)."""
        module = self.lightning_module
        if sys._getframe(1).f_code.co_name == "_get_lightning_module_state_dict":  # Trainer.save_checkpoint
            return self.engine.sharded_state_dict(module)  # (references: nothing copied)
        return self.engine.full_state_dict(module)

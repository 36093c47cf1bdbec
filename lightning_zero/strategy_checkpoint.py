"""The ZeRO strategy's checkpoint hooks: Lightning calls them, ``lightning_zero.checkpoint`` does the work.

A mixin of ``ZeroStrategy`` (strategy.py), kept apart so that the strategy file holds set-up and steps.
Besides the shards, a save records every rank's random generators (checkpoint/rng.py), restored when
training starts after a resume on as many ranks, so a resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.checkpoint import rng
from lightning_zero.checkpoint import save as checkpoint_save
from lightning_zero.sharding import collectives
from lightning_zero.sharding.stage3_setup import full_state_dict
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


class CheckpointHooks:
    """Lightning's checkpoint hooks for ``ZeroStrategy`` (uses its units, optimizers and topology)."""

    _resume_rng: dict[str, Any] | None = None  # this rank's saved generators, set when training starts

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
        states = collectives.all_gather_object(rng.capture()) if self.world_size > 1 else [rng.capture()]
        checkpoint = {**checkpoint, rng.KEY: {"world_size": self.world_size, "states": states}}
        checkpoint_save.save(
            checkpoint,
            filepath,
            model=self.lightning_module,
            units=self._units,
            optimizers=[o for o in self.optimizers if isinstance(o, ZeroOptimizer)],
            stage=self.config.stage,
            rank=self.global_rank,
            world_size=self.topology.shard_size,
            shard_rank=self.topology.shard_rank,
            writes_shards=self.topology.writes_checkpoint_shards,
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k: hidden first, then deleted, so a half-removed one is never visible."""
        checkpoint_save.remove(filepath, rank=self.global_rank)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Checks a sharded checkpoint directory (saved at any world size and stage) on every rank, or
        reads a plain Lightning checkpoint file (from ``ddp`` or one device: migration in).

        Pickled state is loaded with ``weights_only=True`` unless ``trainer.fit(..., weights_only=False)``
        says the file is trusted."""
        self._loaded = checkpoint_io.open_checkpoint(
            checkpoint_path,
            rank=self.global_rank,
            world_size=self.world_size,
            optimizer_names=[o.param_names() for o in self.optimizers if isinstance(o, ZeroOptimizer)],
            weights_only=weights_only is not False,
        )
        lightning = self._loaded.lightning
        saved = lightning.pop(rng.KEY, None)
        self._resume_rng = None
        if saved is not None and saved["world_size"] == self.world_size:
            self._resume_rng = saved["states"][self.global_rank]
        elif saved is not None:
            rank_zero_info(
                f"random generator states not restored: saved on {saved['world_size']} ranks, resuming on"
                f" {self.world_size} (dropout and other draws continue from the seeded state)"
            )
        return lightning

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._resume_rng is not None:
            rng.restore(self._resume_rng)
            self._resume_rng = None

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._settle()
        checkpoint_io.load_model(self._loaded, self.lightning_module, self._units, group=self.topology.shard_group)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        zero_optimizers = [o for o in self.optimizers if isinstance(o, ZeroOptimizer)]
        # Like Lightning's own restore (a zip): a checkpoint saved outside fit has no optimizers to restore.
        for index, optimizer in enumerate(zero_optimizers[: len(self._loaded.meta.optimizers)]):
            checkpoint_io.load_optimizer(self._loaded, index, optimizer)
        self._loaded = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full, unsharded state dict on every rank; stage 3 gathers it unit by unit, on the CPU
        (collective: call it on every rank). For Lightning's own checkpoint dump nothing is gathered: the
        sharded checkpoint writes each rank's shards (see ``save_checkpoint``)."""
        self._settle()
        if self._stage3 is None:
            return super().lightning_module_state_dict()
        module = self.lightning_module
        if sys._getframe(1).f_code.co_name == "_get_lightning_module_state_dict":  # Trainer.save_checkpoint
            sharded = {id(p) for u in self._units for p in u.params}
            return {k: v for k, v in module.state_dict(keep_vars=True).items() if id(v) not in sharded}
        return full_state_dict(module, self._stage3)

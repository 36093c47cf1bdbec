"""Migration in: a plain Lightning checkpoint written by ``ddp`` (or one device) resumes under every ZeRO
stage, with its weights, optimizer state, LR schedule and loops; the resumed run matches resuming the
same file under ddp. A checkpoint saved outside ``fit`` (after ``validate``) resumes too."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero.checkpoint.format import CheckpointError
from tests.support.compare import relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

HALF = 5  # optimizer steps per epoch (accumulate 2): the plain checkpoint is taken at the epoch boundary


class Validated(EquivalenceModule):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def val_dataloader(self):
        return self.train_dataloader()


def _fit(strategy, world: int, *, ckpt=None, steps=2 * HALF, module=None) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = make_trainer(strategy, world, steps=steps)
    trainer.fit(module or EquivalenceModule("blocks", steps=HALF), ckpt_path=ckpt)
    return trainer


def _state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    module = trainer.strategy.gather_module() if hasattr(trainer.strategy, "gather_module") else trainer.model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _migration_worker(rank: int, world: int, root) -> None:
    plain = root / "ddp.ckpt"
    ddp = _fit(DDPStrategy(find_unused_parameters=True), world, steps=HALF)
    ddp.save_checkpoint(plain)  # a single file, as ddp writes it
    resumed_ddp = _fit(DDPStrategy(find_unused_parameters=True), world, ckpt=plain)
    reference, reference_lr = _state(resumed_ddp), resumed_ddp.optimizers[0].param_groups[0]["lr"]
    assert reference_lr < ddp.optimizers[0].param_groups[0]["lr"]  # the schedule stepped after the save
    for stage in (1, 2, 3):
        trainer = _fit(zero_strategy(stage, param_persistence_threshold=0), world, ckpt=plain)
        assert trainer.global_step == 2 * HALF
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        assert lr == reference_lr, f"stage {stage}: the LR schedule was not restored ({lr} vs {reference_lr})"
        for name, value in _state(trainer).items():
            err = relative_error(value, reference[name])
            assert err <= 1e-5, f"stage {stage}: {name} differs from resuming under ddp by {err:.2e}"

    # The optimizer state is matched by position: param groups of other sizes are refused, on every rank.
    class OneGroup(EquivalenceModule):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    with pytest.raises(
        CheckpointError, match=r"optimizer 0 has param groups of \[\d+\] parameters here and \[\d+, \d+\]"
    ):
        _fit(zero_strategy(2), world, ckpt=plain, module=OneGroup("blocks", steps=HALF))

    # A checkpoint saved after validate (no optimizer exists then) resumes with a fresh optimizer, as under ddp.
    for stage in (1, 2, 3):
        pl.seed_everything(0)
        trainer = make_trainer(zero_strategy(stage), world, steps=2)
        trainer.validate(Validated("blocks", steps=HALF), verbose=False)
        trainer.save_checkpoint(root / f"validated-z{stage}")
        resumed = _fit(zero_strategy(stage), world, ckpt=root / f"validated-z{stage}", steps=2)
        assert resumed.global_step == 2


def test_plain_lightning_checkpoints_resume_under_every_stage(ranks, tmp_path):
    ranks(_migration_worker, 2, tmp_path)

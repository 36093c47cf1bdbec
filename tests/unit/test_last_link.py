"""``ckpt_path="last"`` always finds a complete checkpoint with ModelCheckpoint(save_last="link"), in one process:
while a background save is still being written (its publication held), its name, which Lightning links last.ckpt to,
stands in for the newest complete checkpoint, so "last" resolves to that, never to a link that names nothing;
removing the top-k checkpoint that last.ckpt names first points the link at the newest other one; a last.ckpt that
names nothing, given as the path, resumes from the newest complete checkpoint beside it."""

from __future__ import annotations

import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.checkpoint.save import remove
from lightning_zero.front.trainer_checkpoints import complete_checkpoint
from tests.support.helpers import COLLECTIVE_TIMEOUT_S, make_trainer, verify_checkpoint, world_of_one
from tests.unit.test_checkpoint_files import _fake_checkpoint


class Tiny(pl.LightningModule):
    """``at_step_2(trainer)`` runs after ModelCheckpoint's save and link of step 2 (the module's hook comes after
    the callbacks')."""

    def __init__(self, at_step_2) -> None:
        super().__init__()
        self.layer, self.at_step_2 = nn.Linear(4, 4), at_step_2

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 2:
            self.at_step_2(self.trainer)


def test_last_names_a_complete_checkpoint_while_a_background_save_is_written(tmp_path):
    held, release = [], threading.Event()

    def publish_step_2_when_released(phase, path):  # (save.py's [Note: observing a save])
        if phase != "complete":
            return
        held.append(path.name)
        if len(held) == 2:  # step 2's checkpoint: written, not yet in place
            assert release.wait(60)

    resolved = []

    def resolve_last(trainer):
        connector = trainer._checkpoint_connector
        path = connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True, model_connected=True)
        resolved.append(None if path is None else verify_checkpoint(Path(path)))  # (raises unless complete)
        # Lightning linked last.ckpt to step 2's name as soon as the save returned: that name has resolved to a
        # complete checkpoint since before then (a stand-in for step 1's), so no instant found it naming nothing
        resolved.append(verify_checkpoint(tmp_path / "epoch=0-step=2.ckpt"))
        release.set()

    every_step = ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=1, save_last="link")
    config = ZeroConfig(stage=2, async_save=True, timeout=COLLECTIVE_TIMEOUT_S)
    strategy = ZeroStrategy(config, on_save_phase=publish_step_2_when_released)
    trainer = make_trainer(strategy, 1, steps=3, accumulate=1, callbacks=[every_step], enable_checkpointing=True)
    with world_of_one():
        trainer.fit(Tiny(resolve_last))
    assert held == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    assert resolved != [None], "ckpt_path='last' found no checkpoint: the run would start from scratch"
    assert resolved == [1, 1]  # the newest complete checkpoint then
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert verify_checkpoint(tmp_path / "last.ckpt") == 3  # and, once published, the newest


def test_removing_the_checkpoint_last_names_points_last_at_the_newest_other(tmp_path):
    """A synchronous save: ModelCheckpoint removes the old top-k checkpoint before it relinks last.ckpt."""
    for step in (1, 2):
        _fake_checkpoint(tmp_path / f"step{step}.ckpt", step)
    (tmp_path / "last.ckpt").symlink_to("step1.ckpt")
    remove(tmp_path / "step1.ckpt", rank=0)
    assert (tmp_path / "last.ckpt").is_symlink() and verify_checkpoint(tmp_path / "last.ckpt") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step2.ckpt"]


def test_a_last_link_that_names_nothing_resumes_from_the_newest_complete(tmp_path):
    _fake_checkpoint(tmp_path / "step1.ckpt", 1)
    (tmp_path / "last.ckpt").symlink_to("step2.ckpt")  # killed before step 2's checkpoint was published
    with pytest.warns(UserWarning, match=r"last\.ckpt names no checkpoint .*resuming from .*step1\.ckpt"):
        assert complete_checkpoint(tmp_path / "last.ckpt") == tmp_path / "step1.ckpt"
    (tmp_path / "last.ckpt").unlink()  # killed inside Lightning's relinking (unlink, then link)
    with pytest.warns(UserWarning, match="names no checkpoint"):
        assert complete_checkpoint(tmp_path / "last.ckpt") == tmp_path / "step1.ckpt"
    assert complete_checkpoint(tmp_path / "best.ckpt") == tmp_path / "best.ckpt"  # not ours to guess

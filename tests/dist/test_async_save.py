"""Checkpoints saved in the background (``ZeroConfig(async_save=True)``) on 2 ranks:

- with ModelCheckpoint saving every step (top-k and last.ckpt), every checkpoint holds exactly what the same run
  saving synchronously holds (the state when it was saved, not what training changed after, even with the copy
  started late, beside the next step's optimizer step or, at the end, an EMA average copied into the model),
  verified and complete, and a run resumed from the last one goes on as the
  synchronous run's resume does;
- a full disk on rank 1 during a background save raises the same one-line CheckpointError on every rank at the
  same step, and leaves nothing behind;
- Fabric's save takes the same path.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.format import CheckpointError
from tests.support.compare import full_state
from tests.support.helpers import EquivalenceModule, file_size_limit, make_trainer, verify_checkpoint, zero_strategy

STEPS = 4


class Step(EquivalenceModule):
    def training_step(self, batch, batch_idx):
        self.log("step", float(self.global_step))
        return super().training_step(batch, batch_idx)


def _slow_snapshot(copy):
    """The background copy started late: the next step's optimizer step must wait for it (else it would copy
    what that step changed)."""

    def late(self, snapshot, queued):
        time.sleep(0.2)
        return copy(self, snapshot, queued)

    return late


def _equal_worker(rank: int, world: int, root: Path) -> None:
    copy = BackgroundSaves._copy
    BackgroundSaves._copy = _slow_snapshot(copy)
    try:
        _save_both_ways(rank, world, root)
    finally:
        BackgroundSaves._copy = copy


def _save_both_ways(rank: int, world: int, root: Path) -> None:
    for stage in (2, 3):
        for background in (False, True):
            pl.seed_everything(0)
            every_step = ModelCheckpoint(
                root / f"{stage}-{background}", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                # stage 2: two saves per step (the second waits for the first); stage 3: one, linked as last.ckpt,
                # whose copy meets the next step's optimizer step, or at the end the average copied into the model
                save_last=True if stage == 2 else "link",
            )  # fmt: skip
            averaging = [EMAWeightAveraging(decay=0.9)] if stage == 3 else []
            strategy = zero_strategy(stage, async_save=background)
            callbacks = [every_step, *averaging]
            trainer = make_trainer(strategy, world, steps=STEPS, callbacks=callbacks, enable_checkpointing=True)
            trainer.fit(Step("gpt", steps=STEPS + 2, n_layer=2))
            assert trainer.strategy.engine.background is None or not trainer.strategy.engine.background.in_flight
            resumed = make_trainer(zero_strategy(stage), world, steps=STEPS + 1)
            resumed.fit(Step("gpt", steps=STEPS + 2, n_layer=2), ckpt_path=root / f"{stage}-{background}" / "last.ckpt")
            torch.save(full_state(resumed.strategy), root / f"resumed-{stage}-{background}-{rank}.pt")


def test_background_saves_hold_what_synchronous_ones_do(ranks, tmp_path):
    ranks(_equal_worker, 2, tmp_path)
    for stage in (2, 3):
        sync, background = tmp_path / f"{stage}-False", tmp_path / f"{stage}-True"
        names = sorted(p.name for p in sync.iterdir() if not p.name.startswith("."))
        assert names == sorted(p.name for p in background.iterdir())  # nothing hidden left either
        assert len(names) == 3  # top-2 and last
        for name in names:
            assert verify_checkpoint(sync / name) == verify_checkpoint(background / name)
            a = torch.load(consolidate(sync / name, tmp_path / f"a-{stage}-{name}.pt"), weights_only=True)
            b = torch.load(consolidate(background / name, tmp_path / f"b-{stage}-{name}.pt"), weights_only=True)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (stage, name)
            for shard in sorted(p.name for p in (sync / name).glob("rank-*.pt")):  # the masters and Adam's state too
                load = [torch.load(c / name / shard, weights_only=True) for c in (sync, background)]
                assert _same(*load), (stage, name, shard)
        for rank in range(2):
            a = torch.load(tmp_path / f"resumed-{stage}-False-{rank}.pt", weights_only=True)
            b = torch.load(tmp_path / f"resumed-{stage}-True-{rank}.pt", weights_only=True)
            assert all(torch.equal(a[k], b[k]) for k in a)


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


class SaveOnAFullDisk(pl.Callback):
    def __init__(self, target: Path) -> None:
        self.target, self.raised_at = target, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and batch_idx % 2 == 1:
            trainer.save_checkpoint(self.target)  # returns: the shards are written in the background

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step


def _full_disk_worker(rank: int, world: int, root: Path) -> None:
    watch = SaveOnAFullDisk(root / "full.ckpt")
    trainer = make_trainer(zero_strategy(2, async_save=True), world, steps=6, callbacks=[watch])
    with file_size_limit(4096 if rank == 1 else resource.RLIM_INFINITY):
        with pytest.raises(
            CheckpointError, match=r"cannot save checkpoint .*full\.ckpt: .*rank-00001\.pt: File too large"
        ):
            trainer.fit(EquivalenceModule("blocks", steps=6))
    steps = [None] * world
    dist.all_gather_object(steps, watch.step)
    assert steps == [steps[0]] * world and steps[0] >= 2  # the same step on every rank
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_a_full_disk_in_a_background_save_fails_on_every_rank_at_one_step(ranks, tmp_path):
    ranks(_full_disk_worker, 2, tmp_path)


def _fabric_worker(rank: int, world: int, root: Path) -> None:
    from tests.dist.test_fabric import ACCUMULATE, _batches, _fabric, _setup, _train

    fabric = _fabric(3, world, async_save=True)
    model, optimizer = _setup(fabric)
    batches = list(_batches(model, rank, world))
    _train(fabric, model, optimizer, batches[: 2 * ACCUMULATE], [])
    saved = {k: v.clone() for k, v in fabric.strategy.get_module_state_dict(model).items()}
    fabric.save(root / "fabric", {"model": model, "optimizer": optimizer, "step": 2})  # returns before the files
    _train(fabric, model, optimizer, batches[2 * ACCUMULATE :], [])
    assert fabric.load(root / "fabric", {"model": model, "optimizer": optimizer}) == {"step": 2}  # waits for it
    loaded = fabric.strategy.get_module_state_dict(model)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())  # what it held when saved


def test_fabric_saves_in_the_background_too(ranks, tmp_path):
    ranks(_fabric_worker, 2, tmp_path)

"""Sharded checkpoints: exact resume, resharding to other world sizes and stages, and clear errors.

Checkpoints are taken by ModelCheckpoint at an epoch boundary (step HALF of 2 * HALF): that is where
Lightning itself resumes exactly with a plain DataLoader (mid-epoch it replays the epoch's start).
"""

from __future__ import annotations

import json
import shutil

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.checkpoint.format import CheckpointError
from tests.support.compare import relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

HALF = 5  # optimizer steps per epoch


def _trainer(world: int, stage: int, dirpath=None):
    callbacks = [ModelCheckpoint(dirpath, every_n_train_steps=HALF, save_top_k=-1)] if dirpath else []
    strategy = zero_strategy(stage, reduce_bucket_size=40, param_persistence_threshold=0)
    return make_trainer(strategy, world, steps=2 * HALF, callbacks=callbacks, enable_checkpointing=bool(dirpath))


def _fit(world: int, stage: int, *, dirpath=None, ckpt=None) -> EquivalenceModule:
    pl.seed_everything(0)
    module = EquivalenceModule("blocks", steps=HALF)
    trainer = _trainer(world, stage, dirpath)
    trainer.fit(module, ckpt_path=ckpt)
    return trainer.strategy.gather_module()  # stage 3 leaves fit sharded


def _ckpt(dirpath) -> str:
    return str(dirpath / f"epoch=0-step={HALF}.ckpt")


def _exact_worker(rank: int, world: int, root) -> None:
    for stage in (1, 2, 3):
        dirpath = root / f"stage{stage}"
        whole = _fit(world, stage, dirpath=dirpath)
        resumed = _fit(world, stage, ckpt=_ckpt(dirpath))
        n = len(resumed.losses)
        assert n == HALF * 2, n  # the second epoch's micro-batches
        assert resumed.losses == whole.losses[-n:], f"stage {stage}: losses after resuming differ"
        for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
            assert torch.equal(a, b), f"stage {stage}: {name} differs after resuming"


def test_resume_is_exact(ranks, tmp_path):
    ranks(_exact_worker, 2, tmp_path)


def _save_worker(rank: int, world: int, root, stages) -> None:
    for stage in stages:
        _fit(world, stage, dirpath=root / f"w{world}-z{stage}")


def _resume_worker(rank: int, world: int, root, plan) -> None:
    for source, stage in plan:
        module = _fit(world, stage, ckpt=_ckpt(root / source))
        if rank == 0:
            torch.save(module.state_dict(), root / f"{source}-to-w{world}-z{stage}.pt")


def test_reshard_to_other_world_sizes_and_stages(ranks, tmp_path):
    ranks(_save_worker, 2, tmp_path, (2, 3))
    ranks(_save_worker, 4, tmp_path, (2,))
    ranks(_resume_worker, 4, tmp_path, [("w2-z2", 1)])  # 2 -> 4, zero2 -> zero1
    ranks(_resume_worker, 1, tmp_path, [("w2-z2", 2)])  # 2 -> 1
    ranks(_resume_worker, 2, tmp_path, [("w4-z2", 2), ("w2-z2", 3), ("w2-z3", 1)])  # 4 -> 2, z2 -> z3, z3 -> z1
    pl.seed_everything(0)
    reference = EquivalenceModule("blocks", steps=HALF)
    make_trainer("auto", 1, steps=2 * HALF).fit(reference)
    results = sorted(tmp_path.glob("*-to-*.pt"))
    assert len(results) == 5
    for path in results:
        resumed = torch.load(path)
        for name, value in reference.state_dict().items():
            err = relative_error(resumed[name], value)
            assert err <= 1e-5, f"{path.stem}: {name} differs from the uninterrupted run by {err:.2e}"


def _break(ckpt, how: str, tmp) -> str:
    """A damaged copy of the checkpoint directory ``ckpt``."""
    broken = tmp / f"broken-{how}.ckpt"
    shutil.copytree(ckpt, broken)
    rank1 = broken / "rank-00001.pt"
    if how == "missing":
        rank1.unlink()
    elif how == "truncated":
        rank1.write_bytes(rank1.read_bytes()[:-100])
    elif how == "corrupted":
        data = bytearray(rank1.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rank1.write_bytes(bytes(data))
    elif how == "version":
        meta = json.loads((broken / "metadata.json").read_text())
        meta["version"] = 99
        (broken / "metadata.json").write_text(json.dumps(meta))
    elif how == "incomplete":
        (broken / "COMPLETE").unlink()
    return str(broken)


class OtherModel(EquivalenceModule):
    """BlocksNet with the embedding one row larger."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.net.emb = torch.nn.Embedding(14, 9)
        self.net.head.weight = self.net.emb.weight


ERRORS = {
    "missing": r"rank-00001.pt: missing from the checkpoint",
    "truncated": r"rank-00001.pt: truncated or changed: \d+ bytes, the metadata says \d+",
    "corrupted": r"rank-00001.pt: corrupted: its xxh3_128 checksum does not match the metadata",
    "version": r"checkpoint format version 99 is not supported \(this lightning_zero reads versions 1, 2\)",
    "incomplete": r"incomplete checkpoint \(no COMPLETE marker\): its save was interrupted",
}


def _error_worker(rank: int, world: int, root) -> None:
    _fit(world, 2, dirpath=root / "good")
    ckpt = _ckpt(root / "good")
    for how, message in ERRORS.items():
        broken = _break(ckpt, how, root / f"rank{rank}") if rank == 0 else None
        broken = [broken] if rank == 0 else [None]
        torch.distributed.broadcast_object_list(broken, 0)
        with pytest.raises(CheckpointError, match=message):
            _trainer(world, 2).fit(EquivalenceModule("blocks", steps=HALF), ckpt_path=broken[0])
    pl.seed_everything(0)
    with pytest.raises(
        CheckpointError, match=r"different model.*shapes differ: \['net.emb.weight: saved \(13, 9\), model \(14, 9\)'\]"
    ):
        _trainer(world, 2).fit(OtherModel("blocks", steps=HALF), ckpt_path=ckpt)


def test_damaged_checkpoints_fail_clearly_on_every_rank(ranks, tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    ranks(_error_worker, 2, tmp_path)

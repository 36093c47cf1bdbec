"""Saving never deletes what it did not write and fails as one line on every rank, leaving nothing behind:
onto a user's directory or file, a full disk (a file-size limit on one rank), a directory that is not
writable, a directory another node cannot see. Loading never runs code from a pickle."""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_zero.checkpoint.format import (
    CheckpointError,
)
from lightning_zero.checkpoint.shards import ShardReader
from tests.support.helpers import (
    EquivalenceModule,
    Poison,
    file_size_limit,
    make_trainer,
    poison_checkpoint,
    verify_checkpoint,
    zero_strategy,
)


def _listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@contextmanager
def _as_nobody(active: bool):
    """Drops the effective uid (the tests run as root, whom permissions do not stop)."""
    if active:
        os.seteuid(65534)
    try:
        yield
    finally:
        if active:
            os.seteuid(0)


def _raises_everywhere(message: str, action, *args, **kwargs) -> None:
    with pytest.raises(CheckpointError, match=message):
        action(*args, **kwargs)
    dist.barrier()


def _resume(world: int, ckpt) -> None:
    make_trainer(zero_strategy(2), world, steps=3).fit(EquivalenceModule("blocks", steps=2), ckpt_path=ckpt)


def _safety_worker(rank: int, world: int, root: Path) -> None:
    pl.seed_everything(0)
    trainer = make_trainer(zero_strategy(2), world, steps=2)
    trainer.fit(EquivalenceModule("blocks", steps=2))
    good = root / "good.ckpt"
    trainer.save_checkpoint(good)
    step = verify_checkpoint(good)
    if rank == 0:
        (root / "results").mkdir()
        (root / "results" / "notes.txt").write_text("a week of results")
        (root / "notes.txt").write_text("mine")
    dist.barrier()
    before = _listing(root)

    # A directory or file that is not a lightning_zero checkpoint is refused, never deleted.
    for target, kind in ((root / "results", "directory"), (root / "notes.txt", "file")):
        message = rf"{target}: exists and is a {kind} that is not a lightning_zero checkpoint; nothing was overwritten"
        _raises_everywhere(message, trainer.save_checkpoint, target)

    # A full disk on rank 1, for a new name and over the existing checkpoint: nothing is left behind.
    for target in (root / "full.ckpt", good):
        with file_size_limit(4096 if rank == 1 else resource.RLIM_INFINITY):
            message = rf"cannot save checkpoint {target}: .*rank-00001.pt: File too large"
            _raises_everywhere(message, trainer.save_checkpoint, target)
    assert _listing(root) == before and verify_checkpoint(good) == step

    # A directory this user may not write to.
    readonly = Path(tempfile.mkdtemp(prefix="readonly")) if rank == 0 else None  # in /tmp: others may enter
    readonly = [readonly]
    dist.broadcast_object_list(readonly)
    readonly = readonly[0]
    if rank == 0:
        readonly.chmod(0o555)
    with _as_nobody(rank == 0):
        _raises_everywhere(rf"{readonly}/.ckpt.partial: Permission denied", trainer.save_checkpoint, readonly / "ckpt")
    assert not list(readonly.iterdir())
    dist.barrier()
    if rank == 0:
        readonly.rmdir()

    # A directory only rank 0 sees (each rank's working directory stands for a node's filesystem).
    node = root / f"node{rank}"
    node.mkdir()
    cwd = os.getcwd()
    os.chdir(node)
    try:
        message = r"rank-00001.pt: No such file or directory \(checkpoints are written to a filesystem every node"
        _raises_everywhere(message, trainer.save_checkpoint, "shared.ckpt")
        assert not list(node.iterdir())
        if rank == 0:
            shutil.copytree(good, node / "only-on-0.ckpt")
        dist.barrier()
        message = r"rank 1: only-on-0.ckpt: no such checkpoint \(on a multi-node run: is it on a filesystem every"
        _raises_everywhere(message, _resume, world, "only-on-0.ckpt")
    finally:
        os.chdir(cwd)

    # A poisoned pickle, in a sharded checkpoint and in a plain Lightning file: refused, nothing runs.
    marker = root / "pwned"
    if rank == 0:
        shutil.copytree(good, root / "poisoned.ckpt")
        poison_checkpoint(root / "poisoned.ckpt", marker)
        torch.save({"state_dict": {}, "poison": Poison(marker)}, root / "poisoned-plain.ckpt")
    dist.barrier()
    for poisoned in (root / "poisoned.ckpt", root / "poisoned-plain.ckpt"):
        message = r"holds objects that safe loading refuses .* only if you trust where it came from: load it with"
        _raises_everywhere(message + r" weights_only=False \(fabric.load.*add_safe_globals", _resume, world, poisoned)
    assert not marker.exists()

    # One rank failing to read its part of a good checkpoint (a file it cannot map, say): the ranks agree
    # before the all-gathers that follow, so every rank raises instead of the others waiting in them.
    read = ShardReader.read
    if rank == 1:
        ShardReader.read = _unreadable
    try:
        _raises_everywhere(r"rank 1: .*good.ckpt: cannot read this rank's part: simulated", _resume, world, good)
    finally:
        ShardReader.read = read


def _unreadable(*args, **kwargs):
    raise OSError("simulated: the file cannot be mapped here")


def test_saves_fail_safely_and_loads_run_no_code(ranks, tmp_path):
    ranks(_safety_worker, 2, tmp_path)

"""Saving never deletes what it did not write and fails as one line on every rank, leaving nothing behind:
onto a user's directory or file, a full disk (a file-size limit on one rank), a directory that is not
writable, a directory another node cannot see. Loading never runs code from a pickle."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from tests.support.helpers import (
    EquivalenceModule,
    Poison,
    make_trainer,
    poison_checkpoint,
    verify_checkpoint,
    zero_strategy,
)

from lightning_zero.checkpoint.format import (
    CheckpointError,
    Metadata,
    latest,
    read_metadata,
    write_atomically,
)
from lightning_zero.checkpoint.save import OURS, remove
from lightning_zero.checkpoint.save import _prepare as prepare
from lightning_zero.checkpoint.save import _publish as publish
from lightning_zero.checkpoint.shards import ShardReader


def _listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@contextmanager
def _file_size_limit(limit: int):
    """A full disk on this rank: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


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
        with _file_size_limit(4096 if rank == 1 else resource.RLIM_INFINITY):
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
        message = (
            r"holds objects that safe loading refuses .* weights_only=False \(trainer.fit\(..., weights_only=False"
        )
        _raises_everywhere(message + r"\)\) only if you trust where it came from", _resume, world, poisoned)
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


def _fake_checkpoint(path: Path, step: int) -> None:
    """A complete one-rank checkpoint with no units, written the way a save writes its files."""
    path.mkdir()
    files = {
        name: write_atomically(path / name, lambda f: torch.save({"state_dict": {}}, f))
        for name in ("lightning.pt", "rank-00000.pt")
    }
    meta = Metadata(
        stage=2,
        world_size=1,
        global_step=step,
        epoch=0,
        units=[],
        optimizers=[],
        state_dict_keys=[],
        weights_only=False,
        files=files,
    )
    (path / "metadata.json").write_text(meta.to_json())
    (path / "COMPLETE").write_text("")


def test_latest_skips_checkpoints_whose_files_are_missing_or_resized(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path / f"step{step}", step)
    _fake_checkpoint(tmp_path / ".step9.partial", 9)  # hidden: a save in progress, or one moved aside
    assert latest(tmp_path) == tmp_path / "step3"
    (tmp_path / "step3" / "rank-00000.pt").unlink()
    assert latest(tmp_path) == tmp_path / "step2"
    with open(tmp_path / "step2" / "lightning.pt", "ab") as f:
        f.write(b"x")
    assert latest(tmp_path) == tmp_path / "step1"


def test_leftovers_of_killed_saves_and_removals_are_recognised(tmp_path):
    """What a kill can leave, as the next save into the directory finds it (rank 0's preparation)."""
    half_deleted = tmp_path / ".old.ckpt.removing"  # a removal killed mid-delete: COMPLETE already gone
    _fake_checkpoint(half_deleted, 1)
    (half_deleted / OURS).touch()  # what a deletion marks first
    (half_deleted / "COMPLETE").unlink()
    _fake_checkpoint(tmp_path / ".gone.ckpt.replaced", 2)  # killed between the two renames of a replacement
    (tmp_path / ".new.ckpt.partial").mkdir()  # killed before its directory was marked
    prepare(tmp_path / "new.ckpt", tmp_path / ".new.ckpt.partial")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new.ckpt.partial", "gone.ckpt"]
    assert latest(tmp_path) == tmp_path / "gone.ckpt"  # the old checkpoint is back under its name

    foreign = tmp_path / ".mine.partial"  # a hidden directory of the user's: never touched
    foreign.mkdir()
    (foreign / "data.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"\.mine\.partial: exists and was not made by lightning_zero"):
        prepare(tmp_path / "mine", foreign)
    assert (foreign / "data.txt").read_text() == "mine"


def test_a_linked_last_checkpoint_is_replaced_and_removed_as_a_link(tmp_path):
    """ModelCheckpoint(save_last="link") makes last.ckpt a link to the newest checkpoint."""
    _fake_checkpoint(tmp_path / "step1.ckpt", 1)
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "step1.ckpt")
    partial = tmp_path / ".last.ckpt.partial"
    prepare(tmp_path / "last.ckpt", partial)
    _fake_checkpoint(tmp_path / "new", 2)
    for f in (tmp_path / "new").iterdir():
        f.rename(partial / f.name)
    publish(partial, tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink() and read_metadata(tmp_path / "last.ckpt").global_step == 2
    assert verify_checkpoint(tmp_path / "step1.ckpt") == 1  # the link's target is untouched
    (tmp_path / "link.ckpt").symlink_to(tmp_path / "step1.ckpt")
    remove(tmp_path / "link.ckpt", rank=0)
    assert not (tmp_path / "link.ckpt").exists() and verify_checkpoint(tmp_path / "step1.ckpt") == 1

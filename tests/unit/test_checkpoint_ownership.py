"""A save deletes only what a save wrote, and a write that fails says why, in one process:

- a user's file inside a checkpoint's directory survives the save that replaces the checkpoint, ModelCheckpoint's
  top-k removal and the clean-up of a removal that was killed, each naming it in a warning;
- the OS's error that stopped a write inside torch.save (a file-size limit: EFBIG; EIO, EROFS) is what a save
  reports, not torch's zip writer's complaint about its stream position, for synchronous and background saves.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zero.checkpoint.atomic import write_atomically
from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.checkpoint.save import OURS, SaveJob, remove
from lightning_zero.checkpoint.save import _prepare as prepare
from lightning_zero.checkpoint.save import _publish as publish
from lightning_zero.checkpoint.save_state import SaveSpec
from tests.support.helpers import file_size_limit, verify_checkpoint, world_of_one
from tests.unit.test_checkpoint_files import _fake_checkpoint

pytestmark = pytest.mark.unit


def _with_results(ckpt: Path, step: int) -> None:
    """A checkpoint, and a user's evaluation results put beside its files."""
    _fake_checkpoint(ckpt, step)
    (ckpt / "eval.json").write_text('{"accuracy": 0.9}')


def test_replacing_a_checkpoint_keeps_a_users_file_in_it(tmp_path):
    last = tmp_path / "last.ckpt"
    _with_results(last, 1)
    partial = tmp_path / ".last.ckpt.partial"
    prepare(last, partial)
    _fake_checkpoint(tmp_path / "new", 2)
    for f in (tmp_path / "new").iterdir():
        f.rename(partial / f.name)
    (tmp_path / "new").rmdir()
    with pytest.warns(UserWarning, match=r"kept eval\.json in .*last\.ckpt\.kept-1: not written by lightning_zero"):
        publish(partial, last)
    assert verify_checkpoint(last) == 2 and not (last / "eval.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.kept-1"]  # nothing hidden left behind
    assert os.listdir(tmp_path / "last.ckpt.kept-1") == ["eval.json"]  # only what was not ours


def test_removing_a_checkpoint_keeps_a_users_file_where_it_was(tmp_path):
    _with_results(tmp_path / "step1.ckpt", 1)
    with pytest.warns(UserWarning, match=r"kept eval\.json in .*step1\.ckpt: .*the directory stays"):
        remove(tmp_path / "step1.ckpt", rank=0)
    assert os.listdir(tmp_path) == ["step1.ckpt"]
    assert os.listdir(tmp_path / "step1.ckpt") == ["eval.json"]  # no longer a checkpoint: the user's file alone

    # A removal killed after its rename (its files half deleted): the next save into the directory finishes it.
    _with_results(tmp_path / ".step2.ckpt.removing", 2)
    (tmp_path / ".step2.ckpt.removing" / "rank-00000.pt").unlink()
    with pytest.warns(UserWarning, match=r"kept eval\.json in .*step2\.ckpt"):
        prepare(tmp_path / "step3.ckpt", tmp_path / ".step3.ckpt.partial")
    assert os.listdir(tmp_path / "step2.ckpt") == ["eval.json"]


def test_a_save_killed_while_writing_is_removed_whole_and_silently(tmp_path):
    partial = tmp_path / ".x.ckpt.partial"
    _fake_checkpoint(partial, 1)
    (partial / "COMPLETE").unlink()
    (partial / ".COMPLETE.0a1b2c3d.tmp").touch()  # killed inside its last write
    (partial / OURS).touch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of the user's to name
        prepare(tmp_path / "x.ckpt", partial)
    assert os.listdir(tmp_path) == [".x.ckpt.partial"] and os.listdir(partial) == [OURS]  # the new save's


def _save_over_a_size_limit(path: Path, background: BackgroundSaves | None) -> None:
    """Saves a model whose weights (in lightning.pt, one 40 kB record) pass a 16 kB file-size limit: the write
    fails inside torch.save, not when the file is flushed."""
    with world_of_one(), file_size_limit(16384):
        spec = SaveSpec(model=nn.Linear(100, 100), units=[], optimizers=[], stage=2, rank=0)
        SaveJob({"global_step": 0, "epoch": 0}, path, spec, background=background).run()
        if background is not None:
            background.wait()


@pytest.mark.parametrize("background", [False, True])
def test_a_file_size_limit_inside_torch_save_is_named(tmp_path, background):
    with pytest.raises(CheckpointError, match=r"cannot save checkpoint .*x\.ckpt: .*x\.ckpt: File too large$"):
        _save_over_a_size_limit(tmp_path / "x.ckpt", BackgroundSaves() if background else None)
    assert os.listdir(tmp_path) == []  # nothing left behind


class _FailingDevice:
    """A file whose writes fail with ``code`` after 4 kB (a disk error, a filesystem remounted read-only)."""

    def __init__(self, file, code: int) -> None:
        self.file, self.code, self.written = file, code, 0

    def write(self, data) -> int:
        self.written += len(data)
        if self.written > 4096:
            raise OSError(self.code, os.strerror(self.code))
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


@pytest.mark.parametrize("code", [errno.EIO, errno.EROFS])
def test_the_os_error_that_stopped_a_write_is_the_cause(tmp_path, code):
    def write(hashing) -> None:
        hashing.file = _FailingDevice(hashing.file, code)  # under the hashing wrapper torch.save writes to
        torch.save({"weight": torch.zeros(10_000)}, hashing)

    with pytest.raises(OSError) as raised:
        write_atomically(tmp_path / "x.pt", write)
    assert raised.value.errno == code and os.listdir(tmp_path) == []

"""The checkpoint directory's own rules, in one process: latest() skips what is incomplete or changed, leftovers of
killed saves and removals are recognised (a user's hidden directory never touched), a linked last.ckpt is
replaced and removed as a link, and a checkpoint of the format's version 1 (sha256 checksums) still reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint.atomic import write_atomically
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.format import CheckpointError, Metadata, file_digest, latest, read_metadata
from lightning_zero.checkpoint.save import OURS, remove
from lightning_zero.checkpoint.save import _prepare as prepare
from lightning_zero.checkpoint.save import _publish as publish
from tests.support.helpers import (
    verify_checkpoint,
)


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


@pytest.fixture
def tiny_device(tmp_path):
    """A 64 KiB tmpfs: a device that fills up (mounting needs root, which these machines and CI give)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a full tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_device_is_named_with_the_bytes_written_and_free(tiny_device):
    """torch's zip writer reports a full disk as "unexpected pos 768 vs 662": the error says what happened."""
    message = (
        r"tiny/x\.pt: no space left on device \(No space left on device\): [\d,]+ bytes of it were written when"
        r" the device filled, [\d,]+ bytes are free in .*tiny; free space or save elsewhere"
    )
    with pytest.raises(CheckpointError, match=message):
        write_atomically(tiny_device / "x.pt", lambda f: torch.save({"a": torch.zeros(100_000)}, f))
    assert list(tiny_device.iterdir()) == []  # the temporary file is gone


def test_a_version_1_checkpoint_with_sha256_checksums_still_reads(stage2_checkpoint, tmp_path):
    """Version 2 checksums files with xxh3-128; a version-1 checkpoint's sha256 entries are still checked."""
    old = tmp_path / "v1.ckpt"
    shutil.copytree(stage2_checkpoint, old)
    meta = json.loads((old / "metadata.json").read_text())
    assert meta["version"] == 2 and all(set(e) == {"bytes", "xxh3_128"} for e in meta["files"].values())
    meta["version"] = 1
    meta["files"] = {
        name: {"bytes": entry["bytes"], "sha256": file_digest(old / name, "sha256")}
        for name, entry in meta["files"].items()
    }
    (old / "metadata.json").write_text(json.dumps(meta))
    current = torch.load(consolidate(stage2_checkpoint, tmp_path / "v2.pt"), weights_only=True)
    before = torch.load(consolidate(old, tmp_path / "v1.pt"), weights_only=True)
    assert current.keys() == before.keys() and all(torch.equal(current[k], before[k]) for k in current)
    data = bytearray((old / "rank-00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (old / "rank-00000.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-00000.pt: corrupted: its sha256 checksum does not match"):
        consolidate(old, tmp_path / "bad.pt")


def test_a_synchronous_save_writes_no_zip_crc_and_leaves_torch_as_it_was(stage2_checkpoint):
    import zipfile

    records = zipfile.ZipFile(stage2_checkpoint / "rank-00000.pt").infolist()
    assert any("/data/" in r.filename for r in records)
    assert all(r.CRC == 0 for r in records if "/data/" in r.filename)  # (our checksum covers these bytes)
    assert torch.serialization.get_crc32_options()


def test_another_kind_of_optimizer_is_told_from_its_param_groups():
    from lightning_zero.checkpoint.io import lacking_keys

    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).defaults
    deepspeed_fused_adam = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0}
    older_torch_adamw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False}
    sgd = {"lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 0, "nesterov": False}
    assert lacking_keys([deepspeed_fused_adam], adamw) == []  # the same kind: its state loads
    assert lacking_keys([older_torch_adamw], adamw) == []
    assert lacking_keys([sgd], adamw) == ["betas", "eps"]
    assert lacking_keys([older_torch_adamw], torch.optim.SGD([torch.nn.Parameter(torch.ones(2))]).defaults) == [
        "dampening", "momentum", "nesterov"
    ]  # fmt: skip

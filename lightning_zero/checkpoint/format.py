"""The sharded checkpoint format: what is in the directory, its metadata, and how it is checked.

A checkpoint is a directory::

    <name>.ckpt/
        metadata.json        format and version; for every sharded parameter its name, state-dict
                             keys, shape and dtype, grouped by unit with the unit's bucket bounds, so
                             that the owner of any element at the saved world size can be recomputed
                             (``layout.py``); the optimizers' param groups by parameter name; the
                             size and sha256 of every other file
        lightning.pt         Lightning's own state (epoch, step, loops, callbacks, LR schedulers,
                             precision plugin / loss scaler, hyper-parameters) and the parameters and
                             buffers that are not sharded
        rank-00000.pt ...    what each rank owns: per unit its fp32 master partition and the
                             optimizer state of its pieces (elementwise state as partition-sized
                             tensors, scalars such as Adam's step per piece)
        COMPLETE             written last: a directory without it is not a checkpoint

[Note: atomic saves]
Every file is written under a temporary name, fsynced and renamed. The directory is assembled under a
hidden name (``.<name>.partial``), rank 0 writes ``COMPLETE`` once every rank's file is in, and only
then renames the directory to its final name. A process killed at any point leaves at most a hidden
partial directory, which nothing loads, and the previous checkpoints untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "lightning_zero.sharded"
VERSION = 1
METADATA = "metadata.json"
LIGHTNING = "lightning.pt"
COMPLETE = "COMPLETE"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or parameter."""


@dataclass
class ParamEntry:
    name: str  # the first name under which the module registers it
    keys: list[str]  # every state-dict key that holds it (tied parameters have several)
    shape: list[int]
    dtype: str


@dataclass
class UnitEntry:
    params: list[ParamEntry]
    buckets: list[list[int]]  # [first_param, end_param) of each bucket


@dataclass
class Metadata:
    stage: int
    world_size: int
    global_step: int
    epoch: int
    units: list[UnitEntry]
    optimizers: list[list[dict[str, Any]]]  # per optimizer, per group: hyper-parameters and "params" (names)
    state_dict_keys: list[str]  # the LightningModule's state-dict keys, in order
    weights_only: bool
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"bytes", "sha256"}
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Metadata:
        raw = json.loads(text)
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a lightning_zero checkpoint (format {raw.get('format')!r})")
        if raw.get("version") != VERSION:
            raise CheckpointError(
                f"{where}: checkpoint format version {raw.get('version')!r} is not supported"
                f" (this lightning_zero reads version {VERSION})"
            )
        raw["units"] = [
            UnitEntry([ParamEntry(**p) for p in u["params"]], [list(b) for b in u["buckets"]]) for u in raw["units"]
        ]
        return cls(**raw)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[Path], None]) -> dict[str, Any]:
    """``write(tmp)``, fsync, rename to ``path``; returns the file's size and sha256."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def check_file(directory: Path, name: str, expected: dict[str, Any], *, checksum: bool) -> None:
    """Raises CheckpointError if the file is missing, truncated or (with ``checksum``) corrupted."""
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path}: truncated or changed: {size} bytes, the metadata says {expected['bytes']}")
    if checksum and sha256_file(path) != expected["sha256"]:
        raise CheckpointError(f"{path}: corrupted: its sha256 does not match the metadata")


def read_metadata(directory: Path) -> Metadata:
    if not directory.is_dir() or not any((directory / n).exists() for n in (METADATA, COMPLETE)):
        raise CheckpointError(f"{directory}: not a lightning_zero checkpoint (a directory with {METADATA})")
    if not (directory / COMPLETE).is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint (no {COMPLETE} marker): its save was interrupted")
    if not (directory / METADATA).is_file():
        raise CheckpointError(f"{directory / METADATA}: missing from the checkpoint")
    return Metadata.from_json((directory / METADATA).read_text(), directory / METADATA)


def latest(dirpath: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest global step under ``dirpath`` (partial saves ignored)."""
    best: tuple[int, float, Path] | None = None
    for child in Path(dirpath).iterdir():
        if child.name.startswith(".") or not (child / COMPLETE).is_file():
            continue
        try:
            meta = read_metadata(child)
        except (CheckpointError, ValueError, KeyError, TypeError):
            continue
        key = (meta.global_step, child.stat().st_mtime, child)
        best = key if best is None or key[:2] > best[:2] else best
    return None if best is None else best[2]

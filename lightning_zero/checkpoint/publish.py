"""A new output directory written whole or not at all: the exports (Hugging Face, DCP) write into a hidden
``.<name>.partial`` beside it, marked as ours, and rename it into place once every file is synced."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from lightning_zero.checkpoint.atomic import check_not_a_link, fsync_dir
from lightning_zero.checkpoint.format import CheckpointError

OURS = ".lightning_zero_export"  # marks a hidden directory as one an export of ours created


def check_new_directory(out_dir: Path) -> None:
    """One line, before any work, if ``out_dir`` cannot be created as a new directory."""
    check_not_a_link(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: exists (nothing is overwritten: remove it or choose another name)")
    if not out_dir.parent.is_dir():
        raise CheckpointError(f"{out_dir.parent}: no such directory to write {out_dir.name} into")


def write_new_directory(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Runs ``write(directory)`` into the hidden partial directory, then publishes it as ``out_dir``
    atomically; on any failure nothing is left behind (and nothing that is not ours is removed)."""
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    if partial.exists() or partial.is_symlink():
        if not (partial.is_dir() and (partial / OURS).exists()):
            raise CheckpointError(f"{partial}: exists and was not made by lightning_zero; nothing was overwritten")
        shutil.rmtree(partial)  # left by an export that was killed
    partial.mkdir()
    (partial / OURS).touch()
    try:
        write(partial)
        (partial / OURS).unlink()
        fsync_dir(partial)
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # nothing is left behind
        raise
    fsync_dir(out_dir.parent)
    return out_dir

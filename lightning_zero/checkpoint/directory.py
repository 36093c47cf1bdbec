"""Beside the save protocol (save.py): deleting what a save of ours wrote and nothing else, and keeping the links
that name checkpoints (ModelCheckpoint's ``save_last="link"`` makes ``last.ckpt`` one) on complete ones.

[Note: what a deletion removes]
A user may put files of their own into a checkpoint's directory (an evaluation's results beside the shards).
Deleting a checkpoint of ours (one replaced by a save of the same name, or removed by ModelCheckpoint's top-k)
unlinks only the files a save wrote: those its metadata lists (validated first), the metadata and ``COMPLETE``, the
mark ``OURS`` and the temporaries of writes killed before their rename; in a directory without readable metadata (a
save killed before writing it) the names a save gives its files. ``COMPLETE`` goes first, so that a deletion killed
half-way leaves no checkpoint, and the metadata last, so that a second attempt still reads what is ours. Anything
else stays, named in a warning, and so does the directory: it is moved back to the checkpoint's name, or beside it
(``<name>.kept-N``) when a newer checkpoint holds the name, never left under a hidden name a later save would
stumble on.
"""

from __future__ import annotations

import itertools
import os
import re
import warnings
from pathlib import Path

from lightning_zero.checkpoint.atomic import fsync_dir
from lightning_zero.checkpoint.format import (
    AFTER_VALIDATION,
    COMPLETE,
    CONSOLIDATED,
    LIGHTNING,
    METADATA,
    CheckpointError,
    Metadata,
    is_checkpoint,
    latest,
)

OURS = ".lightning_zero_partial"  # marks a hidden directory as one a save of ours created
_NAMES = rf"rank-\d{{5,}}\.pt|{re.escape(LIGHTNING)}|{re.escape(CONSOLIDATED)}|{re.escape(METADATA)}|{COMPLETE}"
_NAMES += rf"|{re.escape(AFTER_VALIDATION)}"  # (written after publication: no metadata lists it)
_TEMPORARY = re.compile(rf"\.({_NAMES})\..*tmp")  # atomic.py's atomic_file writes them under such names


def written_files(directory: Path) -> list[str]:
    """The files in ``directory`` a save of ours wrote, in the order a deletion unlinks them (see the Note)."""
    present = os.listdir(directory)
    try:
        listed = set(Metadata.from_json((directory / METADATA).read_text(), directory / METADATA).files)
    except (OSError, UnicodeDecodeError, CheckpointError):
        listed = {n for n in present if re.fullmatch(_NAMES, n)}
    listed |= {n for n in present if _TEMPORARY.fullmatch(n) or n == AFTER_VALIDATION}  # (temporaries: killed writes)
    return [COMPLETE, *sorted(listed - {COMPLETE, METADATA}), METADATA]


def delete(directory: Path, home: Path) -> None:
    """Deletes a directory of ours under a hidden name (the checkpoint of ``home`` moved aside, or a save's unfinished
    one), only what a save wrote (see the Note), marking it first: a deletion killed half-way leaves a directory
    still recognised as ours. Best effort: a failure is a warning."""
    if directory.is_symlink():  # a link that stood in the checkpoint's place (save_last="link")
        directory.unlink(missing_ok=True)
        return
    try:
        (directory / OURS).touch()
        for name in written_files(directory):
            (directory / name).unlink(missing_ok=True)
        (directory / OURS).unlink()
        kept = sorted(os.listdir(directory))
        if not kept:
            directory.rmdir()
            return
        moved = next(p for p in _names_for(home) if not os.path.lexists(p))
        os.replace(directory, moved)
    except OSError as error:
        warnings.warn(f"lightning_zero: could not delete {directory}: {error.strerror or error}", stacklevel=2)
        return
    warnings.warn(
        f"lightning_zero: kept {', '.join(kept)} in {moved}: not written by lightning_zero, so a save does not delete"
        f" it; the checkpoint's own files were deleted, the directory stays for what is left",
        stacklevel=2,
    )


def _names_for(home: Path):
    """Where what is left of ``home``'s old directory goes: its own name, else ``<name>.kept-1``, ``-2``, ..."""
    yield home
    for n in itertools.count(1):
        yield home.with_name(f"{home.name}.kept-{n}")


def remove_ours(directory: Path, home: Path) -> None:
    """Deletes a hidden directory a save of ours left (marked, a complete checkpoint moved aside, an empty directory
    killed before its mark, or a link); anything else stays."""
    ours = directory.is_symlink() or (
        directory.is_dir() and ((directory / OURS).exists() or is_checkpoint(directory) or not any(directory.iterdir()))
    )
    if ours:
        delete(directory, home)


# --- links that name checkpoints ---------------------------------------------------------------------------
def links_to(path: Path) -> list[Path]:
    """The symbolic links beside ``path`` that name it, existing or not (ModelCheckpoint links ``last.ckpt``)."""
    target = os.path.realpath(path)
    return [p for p in path.parent.iterdir() if p.is_symlink() and os.path.realpath(p) == target]


def point_link(link: Path, target: Path) -> None:
    """Makes ``link`` name ``target`` (relative, as Lightning makes it) with one rename: at every instant it names the
    old target or the new one, never nothing."""
    temporary = link.with_name(f".{link.name}.link")
    if temporary.is_symlink():  # left by a re-pointing that was killed
        temporary.unlink()
    os.symlink(os.path.relpath(target, link.parent), temporary)  # (fails on anything else of that name)
    os.replace(temporary, link)
    fsync_dir(link.parent)


def stand_in(path: Path) -> bool:
    """Before a background save writes the new checkpoint ``path``: ``path`` names the newest complete checkpoint
    beside it until the save publishes the real one over it (see save.py's [Note: a background save's name]).
    Returns whether it did (nothing stands where something exists, or where no checkpoint is complete)."""
    newest = latest(path.parent, excluding=path) if path.parent.is_dir() else None
    if newest is None or os.path.lexists(path):
        return False
    try:
        point_link(path, newest)
    except OSError:  # (a filesystem without symbolic links: ModelCheckpoint could not link either)
        return False
    return True


def point_links_away(path: Path) -> None:
    """Before ``path`` is removed: the links that name it name the newest other complete checkpoint beside it."""
    links = links_to(path)
    newest = latest(path.parent, excluding=path) if links else None
    for link in links if newest is not None else ():
        point_link(link, newest)

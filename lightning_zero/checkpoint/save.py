"""Writing a sharded checkpoint directory, replacing one of the same name, and removing one: collectively,
atomically, and never touching what lightning_zero did not write.

[Note: the save protocol]
Three phases, each ending with every rank agreeing on one verdict (an all-gather of the problems, if
any), so a failure on one rank (a full disk, a read-only or missing directory, a node that does not
see the shared filesystem) is the same one-line ``CheckpointError`` on every rank, with nothing left
behind and earlier checkpoints untouched:
1. rank 0 checks the target (a path that exists must be a lightning_zero checkpoint, or an empty
   directory: anything else is refused, never deleted) and creates the hidden ``.<name>.partial``
   directory, marked as ours;
2. every rank writes its shard into it (fsynced, hashed as it is written);
3. rank 0 writes Lightning's state, the metadata and ``COMPLETE``, then publishes: the partial
   directory is renamed to the name, or, over an existing checkpoint of that name, exchanged with it
   in one ``renameat2(RENAME_EXCHANGE)`` so that at every instant the name holds either the old or the
   new checkpoint; the old one (now under the hidden name) is then deleted: the files a save wrote, nothing
   else (directory.py's [Note: what a deletion removes]).
A process killed at any point leaves at most a hidden directory, which nothing loads (and a background save's
stand-in link, below): the next save of
that name removes a partial one, the next save into that directory an old one moved aside. Removing a
checkpoint (ModelCheckpoint's top-k) first renames it to a hidden name, so a half-deleted checkpoint is
never visible. Where the filesystem has no exchange rename
(some network filesystems), replacing a same-name checkpoint falls back to two renames, with a moment
in which the name is absent.

[Note: a background save's name]
ModelCheckpoint links ``last.ckpt`` (``save_last="link"``) to a checkpoint as soon as its save returns, before a
background save has published it: a run killed then would find ``last.ckpt`` naming nothing, and Lightning's
``ckpt_path="last"`` would start from scratch. So before a background save returns, rank 0 makes its name a link
to the newest complete checkpoint beside it (``directory.stand_in``): at every instant the name, and so the links
to it, resolve to a complete checkpoint, and publishing exchanges the link for the new directory as it exchanges
any checkpoint of that name. A failed save removes the link; a killed one leaves it (a name that resolves to the
older checkpoint, which ``latest`` skips as it skips every link, and the next save of that name replaces).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module

from lightning_zero.checkpoint import hugging_face
from lightning_zero.checkpoint.atomic import fsync_dir, write_atomically
from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.checkpoint.consolidate import write_consolidated
from lightning_zero.checkpoint.directory import OURS, delete, point_links_away, remove_ours, stand_in
from lightning_zero.checkpoint.format import (
    AVERAGED,
    AVERAGED_IN_SHARDS,
    COMPLETE,
    CONSOLIDATED,
    LIGHTNING,
    METADATA,
    WRITTEN_DIGEST,
    CheckpointError,
    Metadata,
    ParamEntry,
    UnitEntry,
    file_digest,
    is_checkpoint,
    partial_dir,
    rank_file,
)
from lightning_zero.checkpoint.snapshot import copy_tensors, unit_payload, zip_crc32
from lightning_zero.sharding import collectives
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer

PAUSE_ENV = "LIGHTNING_ZERO_TEST_PAUSE"  # tests: "<phase>@<n>:<marker file>" stops the n-th save there
_phases_reached: dict[str, int] = {}


def _pause(phase: str) -> None:
    """Test-only: the kill tests stop a save at a chosen phase (``PAUSE_ENV``) and kill -9 it there."""
    wanted = os.environ.get(PAUSE_ENV)
    if not wanted:
        return
    spec, _, marker = wanted.partition(":")
    name, _, nth = spec.partition("@")
    if name != phase:
        return
    _phases_reached[phase] = _phases_reached.get(phase, 0) + 1
    if _phases_reached[phase] == int(nth or 1):
        Path(marker).write_text(phase)
        while True:
            time.sleep(1)


def _describe(error: BaseException, what: Path) -> str:
    """One line for a failed write: the path and the cause (free space when the disk is the cause)."""
    if isinstance(error, OSError):
        cause = error.strerror or str(error)
    else:
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
    try:
        free = shutil.disk_usage(what.parent if not what.exists() else what).free
        if free < 64 * 2**20:
            cause += f"; {free:,} bytes free on its filesystem"
    except OSError:
        pass
    if isinstance(error, FileNotFoundError):
        cause += " (checkpoints are written to a filesystem every node shares: does this node see it?)"
    return f"{what}: {cause}"


def _agree(problem: str | None, path: Path, rank: int, group=None) -> None:
    """Raises the first rank's problem on every rank (a collective over ``group``: every rank calls it)."""
    problems = [p for p in collectives.all_gather_object(problem, group=group) if p is not None]
    if problems:
        raise CheckpointError(f"cannot save checkpoint {path}: {problems[0]}")


def _sweep(directory: Path) -> None:
    """Old checkpoints a killed save or removal had moved aside (``.<name>.replaced|removing``): deleted (what is
    ours: directory.py's [Note: what a deletion removes]), except one whose name is empty because the kill fell
    between the two renames of a replacement: that one is put back."""
    for hidden in directory.glob(".*.re*"):
        name, _, suffix = hidden.name[1:].rpartition(".")
        if suffix == "replaced" and not (directory / name).exists() and is_checkpoint(hidden):
            os.replace(hidden, directory / name)
        elif suffix in ("replaced", "removing"):
            remove_ours(hidden, directory / name)


def _prepare(path: Path, partial: Path) -> None:
    if path.parent.is_dir():
        _sweep(path.parent)
    if path.exists() and not (path.is_dir() and (is_checkpoint(path) or not any(path.iterdir()))):
        kind = "directory" if path.is_dir() else "file"
        raise CheckpointError(
            f"{path}: exists and is a {kind} that is not a lightning_zero checkpoint; nothing was overwritten"
            " (choose another name, or remove it yourself)"
        )
    if partial.exists() or partial.is_symlink():
        remove_ours(partial, path)  # left by a save that was killed
        if partial.exists() or partial.is_symlink():
            raise CheckpointError(f"{partial}: exists and was not made by lightning_zero; nothing was overwritten")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    (partial / OURS).touch()
    fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False where the filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _publish(partial: Path, path: Path) -> None:
    """Puts the finished directory in place; an older checkpoint of the same name is replaced atomically.
    Once the new checkpoint is in place, deleting the old one is best effort: the save has succeeded."""
    (partial / OURS).unlink()
    if not (path.exists() or path.is_symlink()):  # (a link, save_last="link", is swapped like a directory)
        os.replace(partial, path)
        fsync_dir(path.parent)
        return
    if _exchange(partial, path):
        _pause("exchanged")
        fsync_dir(path.parent)
        delete(partial, path)  # the old checkpoint, now under the hidden name
        return
    aside = path.parent / f".{path.name}.replaced"
    remove_ours(aside, path)
    os.replace(path, aside)
    try:
        os.replace(partial, path)
    except OSError:
        os.replace(aside, path)  # the old checkpoint goes back under its name
        raise
    fsync_dir(path.parent)
    delete(aside, path)


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    model: Module,
    units: Sequence[FlatUnit],
    optimizers: Sequence[ZeroOptimizer],
    stage: int,
    rank: int,
    world_size: int,
    shard_rank: int | None = None,
    writes_shards: bool = True,
    consolidated: bool = False,
    average: WeightAverage | None = None,
    background: BackgroundSaves | None = None,
) -> None:
    """Writes Lightning's ``checkpoint`` dict and the ranks' shards as the directory ``path`` (collective;
    see [Note: the save protocol]); with ``background`` the files are written by its writer thread once this
    rank's state is copied to the host (background.py's [Note: background saves]). ``world_size`` ranks hold
    the partitions, this one as ``shard_rank`` (default: ``rank``); with hybrid sharding only the first shard
    group ``writes_shards`` (the others hold replicas of the same partitions), and ``rank`` 0 coordinates.
    ``consolidated``: rank 0 also writes the whole model's fp32 weights as a Lightning checkpoint into it, from
    the shard files (format.py).
    ``average``: a weight-averaging callback's, saved beside the weights (format.py)."""
    path = Path(path)
    partial = partial_dir(path)
    problem, stood_in = None, False
    if rank == 0:
        try:
            _prepare(path, partial)
            stood_in = background is not None and stand_in(path)  # see [Note: a background save's name]
        except CheckpointError as error:
            problem = str(error)
        except OSError as error:
            problem = _describe(error, partial)
    _agree(problem, path, rank)
    _pause("prepared")

    weights_only = "optimizer_states" not in checkpoint
    owner = {id(u): opt for opt in optimizers for u in opt.units}
    keep = background.host_copy if background is not None else (lambda t: t.cpu())
    empty = background.host_empty if background is not None else (lambda n, dtype, pinned: torch.empty(n, dtype=dtype))
    name = rank_file(rank if shard_rank is None else shard_rank) if writes_shards else None
    averaged: list = [None] * len(units)

    def snapshot() -> tuple[dict | None, str | None]:
        """This rank's shards on the host, or the problem (in the background: before the next optimizer step)."""
        try:
            if not writes_shards:
                return None, None
            payloads = zip(units, averaged)
            return {
                "units": [unit_payload(u, owner.get(id(u)), weights_only, a, keep, empty) for u, a in payloads]
            }, None
        except CheckpointError as error:
            return None, str(error)
        except Exception as error:  # noqa: BLE001 - every failure becomes the one agreed error
            return None, _describe(error, partial / name)

    lightning, meta, problem = None, None, None
    try:  # what this step must copy before training goes on (its forward changes buffers, its loop the state)
        if average is not None and writes_shards:
            averaged = average.partitions(units)  # (copies, which the averaging callback's next update changes)
        if rank == 0:
            lightning = _lightning(checkpoint, model, units, optimizers, average)
            if background is not None:
                lightning = copy_tensors(lightning, keep)
            meta = _metadata(checkpoint, model, units, optimizers, stage, world_size, weights_only, {})
    except CheckpointError as error:
        problem = str(error)
    except Exception as error:  # noqa: BLE001 - every failure becomes the one agreed error
        problem = _describe(error, partial / LIGHTNING)

    def write(taken: tuple[dict | None, str | None], failure: BaseException | None = None) -> None:
        shard, shard_problem = taken if failure is None else (None, _describe(failure, partial / (name or "")))
        group = background.group if background is not None else None
        try:
            _write_files(
                path, partial, rank, name, shard, lightning, meta, consolidated, problem or shard_problem, group
            )
        except BaseException:
            if stood_in and path.is_symlink():  # (the save failed: its stand-in goes with it)
                path.unlink()
            raise

    if background is None:
        with zip_crc32(False):  # (see zip_crc32)
            write(snapshot())
    else:
        background.start(snapshot, write)


def _write_files(
    path: Path,
    partial: Path,
    rank: int,
    name: str | None,
    shard: dict | None,
    lightning: dict | None,
    meta: Metadata | None,
    consolidated: bool,
    problem: str | None,
    group=None,
) -> None:
    """Phases 2 and 3 of [Note: the save protocol], the ranks agreeing over ``group``."""
    entry = None
    try:
        if problem is None and name is not None:
            entry = write_atomically(partial / name, lambda f: torch.save(shard, f))
    except CheckpointError as error:
        problem = str(error)
    except Exception as error:  # noqa: BLE001 - every failure becomes the one agreed error
        problem = _describe(error, partial / name)
    written = collectives.all_gather_object((name, entry, problem), group=group)
    problems = [p for _, _, p in written if p is not None]
    if problems:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"cannot save checkpoint {path}: {problems[0]}")
    _pause("shards")

    problem = None
    if rank == 0:
        try:
            files = {n: e for n, e, _ in written if n is not None}
            files[LIGHTNING] = write_atomically(partial / LIGHTNING, lambda f: torch.save(lightning, f))
            meta.files = files
            if consolidated:  # streamed from the shard files just written: about one parameter in memory
                write_consolidated(partial, meta, lightning, partial / CONSOLIDATED)
                size = (partial / CONSOLIDATED).stat().st_size
                meta.files[CONSOLIDATED] = {"bytes": size, WRITTEN_DIGEST: file_digest(partial / CONSOLIDATED)}
            write_atomically(partial / METADATA, lambda f: f.write(meta.to_json().encode()))
            _pause("metadata")
            write_atomically(partial / COMPLETE, lambda f: None)
            fsync_dir(partial)
            _pause("complete")
            _publish(partial, path)
        except Exception as error:  # noqa: BLE001
            shutil.rmtree(partial, ignore_errors=True)
            problem = str(error) if isinstance(error, CheckpointError) else _describe(error, path)
    _agree(problem, path, rank, group)
    _pause("published")


def _lightning(
    checkpoint: dict,
    model: Module,
    units: Sequence[FlatUnit],
    optimizers: Sequence[ZeroOptimizer],
    average: WeightAverage | None,
) -> dict:
    """Lightning's own state, with the parameters and buffers that are not sharded (and their average)."""
    sharded = {id(p) for u in units for p in u.params}
    lightning = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    if average is not None:
        lightning[AVERAGED] = {k: v.detach().cpu() for k, v in average.whole().items()}
        lightning[AVERAGED_IN_SHARDS] = {"exported": average.exported}
    lightning["state_dict"] = {
        k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if id(v) not in sharded
    }
    lightning["optimizer_groups"] = [
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers
    ]
    lightning.update(hugging_face.describe(model))  # see [Note: the Hugging Face description in a checkpoint]
    return lightning


def _metadata(checkpoint, model, units, optimizers, stage, world_size, weights_only, files) -> Metadata:
    entries = model.state_dict(keep_vars=True)
    keys: dict[int, list[str]] = {}  # tied parameters: every key that holds them
    for key, value in entries.items():
        keys.setdefault(id(value), []).append(key)
    return Metadata(
        stage=stage,
        world_size=world_size,
        global_step=int(checkpoint.get("global_step", 0)),
        epoch=int(checkpoint.get("epoch", 0)),
        units=[
            UnitEntry(
                [
                    ParamEntry(n, keys[id(p)], list(p.shape), str(p.dtype).removeprefix("torch."))
                    for n, p in zip(u.names, u.params)
                ],
                u.layout.bucket_bounds(),
            )
            for u in units
        ],
        optimizers=[opt.param_names() for opt in optimizers],
        state_dict_keys=list(entries),
        weights_only=weights_only,
        files=files,
    )


def remove(path: str | os.PathLike, *, rank: int) -> None:
    """Removes a checkpoint of ours (rank 0): the links that name it (last.ckpt) first name the newest other
    complete checkpoint, then it is renamed to a hidden name, so a half-deleted one is never visible, and its
    files are deleted (directory.py's [Note: what a deletion removes]); anything that is not a lightning_zero
    checkpoint is left alone."""
    path = Path(path)
    if rank != 0 or not (is_checkpoint(path) or path.is_symlink()):
        return
    if path.is_symlink():  # ModelCheckpoint's save_last="link": the link, never its target
        path.unlink()
        return
    hidden = path.parent / f".{path.name}.removing"
    try:
        point_links_away(path)
        remove_ours(hidden, path)
        os.replace(path, hidden)
        fsync_dir(path.parent)
    except OSError as error:  # rank 0 alone is here: a failure must not stop it while the others go on
        warnings.warn(f"lightning_zero: could not remove checkpoint {path}: {error.strerror or error}", stacklevel=2)
        return
    _pause("removing")
    delete(hidden, path)

"""Writing a sharded checkpoint directory (a ``SaveJob``), replacing one of the same name, and removing one:
collectively, atomically, and never touching what lightning_zero did not write.

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

[Note: a save as a job]
A ``SaveJob`` is one save; its methods are the phases, called in this order: ``prepare`` (phase 1) and ``capture``
(what the saving step itself must copy: rank 0's Lightning state and the metadata, the weight average's partitions)
in the training thread; then ``snapshot`` (this rank's shards on the host), ``write`` (phase 2) and ``publish``
(phase 3), which ``run`` calls at once, or hands to the background writer (``BackgroundSaves.start``, background.py)
with ``ZeroConfig(async_save=True)``. A failure before ``write`` is kept, not raised: the ranks agree on it there.

[Note: observing a save]
A job given ``on_phase`` (``ZeroEngine.save``'s, ``ZeroStrategy(on_save_phase=...)``'s; ``remove``'s likewise)
calls ``on_phase(phase, path)`` at each point the save of ``path`` reaches, on each rank that reaches it, on the
thread that runs it (the writer's for a background save's last three phases):
- "prepared" (every rank): the hidden directory made, every rank agreed;
- "shards" (every rank): every shard written, every rank agreed;
- "metadata" (rank 0): Lightning's state and the metadata written, ``COMPLETE`` not yet;
- "complete" (rank 0): ``COMPLETE`` written, the directory not yet in place;
- "exchanged" (rank 0, over a checkpoint of the same name): the new one in place, the old one under the hidden
  name, not yet deleted;
- "published" (every rank): in place, every rank agreed;
- "removing" (rank 0, ``remove``): the checkpoint renamed aside, not yet deleted.
An observer watches and must not raise; it may block (the kill tests stop a save at a phase and kill it there).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_zero.checkpoint.atomic import fsync_dir, write_atomically
from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.checkpoint.consolidate import write_consolidated
from lightning_zero.checkpoint.directory import OURS, delete, point_links_away, remove_ours, stand_in
from lightning_zero.checkpoint.format import (
    COMPLETE,
    CONSOLIDATED,
    LIGHTNING,
    METADATA,
    WRITTEN_DIGEST,
    CheckpointError,
    Metadata,
    file_digest,
    is_checkpoint,
    partial_dir,
    rank_file,
)
from lightning_zero.checkpoint.save_state import SaveSpec, lightning_state, metadata
from lightning_zero.checkpoint.snapshot import copy_tensors, unit_payload, zip_crc32
from lightning_zero.sharding import collectives

Observer = Callable[[str, Path], None]  # on_phase(phase, path): see [Note: observing a save]


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


def _publish(partial: Path, path: Path, on_phase: Observer | None = None) -> None:
    """Puts the finished directory in place; an older checkpoint of the same name is replaced atomically.
    Once the new checkpoint is in place, deleting the old one is best effort: the save has succeeded."""
    (partial / OURS).unlink()
    if not (path.exists() or path.is_symlink()):  # (a link, save_last="link", is swapped like a directory)
        os.replace(partial, path)
        fsync_dir(path.parent)
        return
    if _exchange(partial, path):
        if on_phase is not None:
            on_phase("exchanged", path)
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


class SaveJob:
    """One save of ``checkpoint`` (the front door's own state) and ``spec``'s shards as the directory ``path``, in
    the phases of [Note: a save as a job]; ``run`` on every rank (collective). ``background``: the phases after
    ``capture`` are the writer's (background.py's [Note: background saves]); ``on_phase``: see [Note: observing a
    save]."""

    def __init__(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        spec: SaveSpec,
        *,
        background: BackgroundSaves | None = None,
        on_phase: Observer | None = None,
    ) -> None:
        self.checkpoint, self.path, self.spec, self.on_phase = checkpoint, Path(path), spec, on_phase
        self.partial, self.background = partial_dir(self.path), background
        self.group = background.group if background is not None else None  # the ranks agree over it
        self.weights_only = "optimizer_states" not in checkpoint
        self.owner = {id(u): opt for opt in spec.optimizers for u in opt.units}
        writes = spec.topology.writes_checkpoint_shards
        self.name = rank_file(spec.topology.shard_rank) if writes else None  # this rank's shard file
        self.problem: str | None = None  # this rank's first failure, which every rank learns in ``write``
        self.stood_in = False  # see [Note: a background save's name]
        self.averaged: list = [None] * len(spec.units)  # the weight average's partitions, copied
        self.lightning: dict | None = None  # rank 0: Lightning's state and the metadata
        self.meta: Metadata | None = None
        self.files: dict[str, dict] = {}  # the shard files written, by name

    def run(self) -> None:
        """Every phase: at once, or the last three handed to the background writer."""
        self.prepare()
        self.capture()
        if self.background is None:
            with zip_crc32(False):  # (see zip_crc32)
                self.finish(self.snapshot())
        else:
            self.background.start(self.snapshot, self.finish)

    def _observe(self, phase: str, path: Path) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, path)

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host tensor written for ``tensor``: a copy that training does not change, in the background."""
        return self.background.host_copy(tensor) if self.background is not None else tensor.cpu()

    def _empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        if self.background is not None:
            return self.background.host_empty(numel, dtype, pinned)
        return torch.empty(numel, dtype=dtype)

    def prepare(self) -> None:
        """Phase 1: rank 0 checks the target and makes the hidden directory (in the background, the name a stand-in:
        [Note: a background save's name]); every rank agrees."""
        problem = None
        if self.spec.rank == 0:
            try:
                _prepare(self.path, self.partial)
                self.stood_in = self.background is not None and stand_in(self.path)
            except CheckpointError as error:
                problem = str(error)
            except OSError as error:
                problem = _describe(error, self.partial)
        _agree(problem, self.path, self.spec.rank)
        self._observe("prepared", self.path)

    def capture(self) -> None:
        """What the saving step must copy before training goes on (its forward changes buffers, its loop the
        state, the averaging callback's next update the average): the average's partitions and, on rank 0,
        Lightning's state and the metadata."""
        spec = self.spec
        try:
            if spec.average is not None and self.name is not None:
                self.averaged = spec.average.partitions(spec.units)  # (copies)
            if spec.rank == 0:
                self.lightning = lightning_state(self.checkpoint, spec)
                if self.background is not None:
                    self.lightning = copy_tensors(self.lightning, self._keep)
                self.meta = metadata(self.checkpoint, spec, weights_only=self.weights_only)
        except CheckpointError as error:
            self.problem = str(error)
        except Exception as error:  # noqa: BLE001 - every failure becomes the one agreed error
            self.problem = _describe(error, self.partial / LIGHTNING)

    def snapshot(self) -> tuple[dict | None, str | None]:
        """This rank's shards on the host, or the problem (in the background: before the next optimizer step)."""
        if self.name is None:
            return None, None
        try:
            payloads = zip(self.spec.units, self.averaged)
            units = [
                unit_payload(u, self.owner.get(id(u)), self.weights_only, a, self._keep, self._empty)
                for u, a in payloads
            ]
            return {"units": units}, None
        except CheckpointError as error:
            return None, str(error)
        except Exception as error:  # noqa: BLE001 - every failure becomes the one agreed error
            return None, _describe(error, self.partial / self.name)

    def finish(self, taken: tuple[dict | None, str | None] | None, failure: BaseException | None = None) -> None:
        """``write`` and ``publish`` what ``snapshot`` took (``failure``: why it took nothing). A failed save's
        stand-in goes with it."""
        shard, problem = taken if failure is None else (None, _describe(failure, self.partial / (self.name or "")))
        self.problem = self.problem or problem
        try:
            self.write(shard)
            self.publish()
        except BaseException:
            if self.stood_in and self.path.is_symlink():
                self.path.unlink()
            raise

    def write(self, shard: dict | None) -> None:
        """Phase 2: this rank's shard file; every rank agrees (and learns any rank's earlier failure)."""
        problem, entry = self.problem, None
        try:
            if problem is None and self.name is not None:
                entry = write_atomically(self.partial / self.name, lambda f: torch.save(shard, f))
        except CheckpointError as error:
            problem = str(error)
        except Exception as error:  # noqa: BLE001 - every failure becomes the one agreed error
            problem = _describe(error, self.partial / self.name)
        written = collectives.all_gather_object((self.name, entry, problem), group=self.group)
        problems = [p for _, _, p in written if p is not None]
        if problems:
            if self.spec.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)
            raise CheckpointError(f"cannot save checkpoint {self.path}: {problems[0]}")
        self.files = {n: e for n, e, _ in written if n is not None}
        self._observe("shards", self.path)

    def publish(self) -> None:
        """Phase 3: rank 0 completes the directory and puts it in place; every rank agrees."""
        problem = None
        if self.spec.rank == 0:
            try:
                self._complete()
                _publish(self.partial, self.path, self.on_phase)
            except Exception as error:  # noqa: BLE001
                shutil.rmtree(self.partial, ignore_errors=True)
                problem = str(error) if isinstance(error, CheckpointError) else _describe(error, self.path)
        _agree(problem, self.path, self.spec.rank, self.group)
        self._observe("published", self.path)

    def _complete(self) -> None:
        """Rank 0: Lightning's state, the consolidated weights (if asked), the metadata and ``COMPLETE``."""
        partial, meta, lightning = self.partial, self.meta, self.lightning
        files = dict(self.files)
        files[LIGHTNING] = write_atomically(partial / LIGHTNING, lambda f: torch.save(lightning, f))
        meta.files = files
        if self.spec.consolidated:  # streamed from the shard files just written: about one parameter in memory
            write_consolidated(partial, meta, lightning, partial / CONSOLIDATED)
            size = (partial / CONSOLIDATED).stat().st_size
            meta.files[CONSOLIDATED] = {"bytes": size, WRITTEN_DIGEST: file_digest(partial / CONSOLIDATED)}
        write_atomically(partial / METADATA, lambda f: f.write(meta.to_json().encode()))
        self._observe("metadata", self.path)
        write_atomically(partial / COMPLETE, lambda f: None)
        fsync_dir(partial)
        self._observe("complete", self.path)


def remove(path: str | os.PathLike, *, rank: int, on_phase: Observer | None = None) -> None:
    """Removes a checkpoint of ours (rank 0): the links that name it (last.ckpt) first name the newest other
    complete checkpoint, then it is renamed to a hidden name, so a half-deleted one is never visible, and its
    files are deleted (directory.py's [Note: what a deletion removes]); anything that is not a lightning_zero
    checkpoint is left alone. ``on_phase``: see [Note: observing a save]."""
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
    if on_phase is not None:
        on_phase("removing", path)
    delete(hidden, path)

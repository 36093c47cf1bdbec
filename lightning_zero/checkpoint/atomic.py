"""Writing one file atomically: under a fresh hidden name created exclusively (never through a link), hashed as it
is written, fsynced and renamed into place, the OS's own error reported when a write fails; and making a
directory's entries durable. Every file of a checkpoint and every export goes through here."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from lightning_zero.checkpoint.format import DIGESTS, WRITTEN_DIGEST, CheckpointError


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries durable; a filesystem that cannot fsync directories (some FUSE and
    network filesystems answer EINVAL) is left to its own guarantees."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


class _HashingFile:
    """A binary file that hashes and counts what is written to it (no second read to checksum), and keeps the
    OS's error if a write fails (torch's zip writer replaces it with its own, about stream positions)."""

    def __init__(self, file) -> None:
        self.file = file
        self.digest = DIGESTS[WRITTEN_DIGEST][0]()
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        written = self._keeping_error(self.file.write, data)
        self.digest.update(data)
        self.bytes += len(data)
        return written

    def flush(self) -> None:
        self._keeping_error(self.file.flush)

    def _keeping_error(self, call: Callable, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as error:
            self.error = self.error or error  # the first: what stopped the writing
            raise


def check_not_a_link(path: Path) -> None:
    """One line if ``path`` is a symbolic link, dangling or not: an output is written as a new file or directory,
    never through a link nor over one."""
    if path.is_symlink():
        raise CheckpointError(
            f"{path}: is a symbolic link (to {os.readlink(path)}); nothing is written through or over a link: give"
            " a path that does not exist"
        )


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A new file that becomes ``path`` when the block ends (flushed, fsynced, renamed), or is removed if it raises.
    It is opened for reading and writing under a fresh hidden name beside ``path``, created exclusively: never an
    existing file, never through a link put where a temporary is expected. ``path`` itself must not be a link."""
    check_not_a_link(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)  # (less the umask, as any file written)
            break
        except FileExistsError:  # the name is taken (by anything, a link included): another one
            continue
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # ours: created above
        raise


def write_atomically(path: Path, write: Callable[[Any], None]) -> dict[str, Any]:
    """``write(file)`` into a new file (``atomic_file``: fsynced, renamed to ``path``); returns the file's size and
    checksum. A full device raises one CheckpointError saying so, with the bytes written and free; any other OS error
    that stopped the writing is raised as itself, also from inside torch.save (see ``_HashingFile``)."""
    hashing = None
    try:
        with atomic_file(path) as f:
            hashing = _HashingFile(f)
            write(hashing)
    except BaseException as error:
        cause = hashing.error if hashing is not None and hashing.error is not None else error
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            written = hashing.bytes if hashing is not None else 0
            free = shutil.disk_usage(path.parent).free
            raise CheckpointError(
                f"{path}: no space left on device ({cause.strerror}): {written:,} bytes of it were written when the"
                f" device filled, {free:,} bytes are free in {path.parent}; free space or save elsewhere"
            ) from error
        if cause is not error:  # the OS's error (EFBIG, EIO, EROFS...), not torch's about its stream position
            raise cause from None
        raise
    return {"bytes": hashing.bytes, WRITTEN_DIGEST: hashing.digest.hexdigest()}

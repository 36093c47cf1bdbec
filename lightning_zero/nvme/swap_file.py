"""Swap files for the NVMe tier (ZeRO-Infinity, issue 43): a rank's state in a preallocated file of its own under
``nvme_path``, read and written with direct I/O, several requests in flight.

[Note: direct I/O]
The file is opened with O_DIRECT, so reads and writes go between the disk and our buffers without the page cache:
the cache would hold a second copy of what the tier exists to keep out of host memory, and would hide the disk's
speed until it filled. O_DIRECT wants the buffer's address, the file offset and the length to be multiples of the
disk's logical block; ``ALIGN`` (4096) is one for every NVMe drive, and ``aligned_buffer`` makes buffers that start
on it (pinned where a GPU will copy from them). A request of ``n`` bytes is cut into pieces of at most
``block_size`` bytes, each a positional read or write (``os.preadv`` / ``os.pwritev``, which release the GIL) on the
process's pool of ``queue_depth`` threads (``io_threads``, shared by every file), so the drive sees that many
requests at once, as DeepSpeed's ``aio`` section's ``queue_depth`` and ``block_size`` set. (io_uring would submit
them from one thread; no well-kept binding ships a wheel for this Python here, and threads reach the drive's queue
the same way.) The file is made whole up front and reads as zeros (``posix_fallocate``: a disk too small fails
there, not in the middle of a step) and removed at ``close``, also when training fails: it is scratch, never a
checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import multiprocessing.util
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

ALIGN = 4096  # bytes: a multiple of every NVMe drive's logical block
MADV_REMOVE = 9  # (linux/mman.h)
SUFFIX = ".swap"  # (a swap file's name ends so; checkpoints never do)


def aligned_buffer(nbytes: int, *, pin: bool = False) -> Tensor:
    """A uint8 CPU tensor of ``nbytes`` rounded up to ``ALIGN``, whose data starts on an ``ALIGN`` boundary."""
    size = -(-nbytes // ALIGN) * ALIGN
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + size]


def scratch_name(kind: str) -> str:
    """A new swap file's name (without ``SUFFIX``): its kind, this host and process (``remove_stale`` reads them)."""
    return f"lightning_zero_{kind}_{scratch_host()}_{os.getpid()}_{uuid.uuid4().hex[:12]}"


def remove_stale(directory: Path) -> list[Path]:
    """Removes the swap files that processes of this host which are gone left in ``directory`` (a kill -9 skips the
    removal at exit); returns them. Files of other hosts (a shared directory) and of live processes stay."""
    removed = []
    for path in directory.glob(f"lightning_zero_*{SUFFIX}"):
        head, pid, _ = path.stem.rsplit("_", 2)
        if head.endswith(f"_{scratch_host()}") and pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):  # (another user's, in a shared directory: theirs to remove)
                if path.stat().st_uid == os.getuid():
                    path.unlink()
                    removed.append(path)
    return removed


def scratch_host() -> str:
    """This host and its pid namespace (two containers may share a host name, never a namespace and its pids)."""
    return f"{socket.gethostname()}-{os.stat('/proc/self/ns/pid').st_ino}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host: /proc has it as a process (a thread's id is no process's) that is no
    zombie."""
    try:
        status = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
        )
    except OSError:
        return False
    return status.get("Tgid", "").strip() == str(pid) and not status.get("State", "").startswith("Z")


def check_nvme_path(path: str | os.PathLike) -> Path:
    """``path`` as a directory where this process can make swap files with direct I/O; one line otherwise. What
    processes of this host that are gone left there is removed (``remove_stale``)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"nvme_path {str(path)!r} is not a directory (make it first, on the NVMe drive)")
    probe = directory / f".lightning_zero_probe_{os.getpid()}{SUFFIX}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise ValueError(f"nvme_path {str(path)!r} is on a filesystem without direct I/O (O_DIRECT)") from None
        raise ValueError(f"nvme_path {str(path)!r}: cannot make a file there ({error.strerror})") from None
    os.close(fd)
    probe.unlink()
    remove_stale(directory)
    return directory


def mapped_zeros(directory: Path, numel: int) -> Tensor:
    """A zeroed fp32 tensor of ``numel`` elements that is a shared mapping of a new file under ``directory`` (made
    whole first), unlinked at once: the kernel writes its pages to the disk under memory pressure and reads them back
    when touched, so host memory holds what is in use; the file goes with the tensor, even after a kill -9."""
    path = directory / f"{scratch_name('mapped')}{SUFFIX}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(numel, 1) * 4)
    except OSError as error:
        path.unlink(missing_ok=True)
        raise OSError(error.errno, f"cannot make a {numel * 4:,}-byte file in {directory}: {error.strerror}") from None
    finally:
        os.close(fd)
    try:
        return torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=torch.float32)[:numel]
    finally:
        path.unlink()


def zero_mapped(tensor: Tensor) -> None:
    """Zeroes a ``mapped_zeros`` tensor without writing it: its whole pages are given back (MADV_REMOVE punches them
    out of the file, whose reads give zeros again), the rest is written; a plain ``zero_`` where that fails."""
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    first, last = -(-start // page) * page, end // page * page
    if last > first and _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_REMOVE) == 0:
        tensor[: (first - start) // 4].zero_()
        tensor[(last - start) // 4 :].zero_()
    else:
        tensor.zero_()


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class Requests:
    """The pieces of one read or write in flight: ``wait()`` returns when all are done, raising the first error."""

    def __init__(self, pieces: list[Future]) -> None:
        self.pieces = pieces

    def done(self) -> bool:
        """Whether every piece has finished (with or without an error), without waiting."""
        return all(piece.done() for piece in self.pieces)

    def wait(self) -> None:
        """Waits for every piece, then raises the first error (a piece never outlives its request's wait)."""
        errors = [piece.exception() for piece in self.pieces]
        for error in errors:
            if error is not None:
                raise error


class SwapFile:
    """``nbytes`` (rounded up to ``ALIGN``) in ``directory/name.swap``, made whole now; reads and writes of aligned
    buffers at aligned offsets, in flight at once (see [Note: direct I/O]). ``close()`` removes the file."""

    def __init__(
        self, directory: Path, name: str, nbytes: int, *, queue_depth: int = 8, block_size: int = 1 << 20
    ) -> None:
        if block_size % ALIGN or block_size <= 0 or queue_depth < 1:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN} and queue_depth >= 1")
        self.path = Path(directory) / f"{name}{SUFFIX}"
        self.nbytes, self.block_size = -(-nbytes // ALIGN) * ALIGN, block_size
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as error:
            self._remove()
            raise OSError(
                error.errno, f"cannot make a {self.nbytes:,}-byte swap file in {directory}: {error.strerror}"
            ) from None
        self.pool = io_threads(queue_depth)
        self.in_flight: set[Future] = set()  # this file's pieces not yet done (``close`` waits for them)
        # removed at close, or when the object goes, or at exit without one: multiprocessing's finalizers also run
        # in a forked rank, which ends with os._exit (not after a kill -9: see ``remove_stale``)
        self._finalizer = multiprocessing.util.Finalize(
            self, _discard, args=(self.in_flight, self.fd, self.path), exitpriority=0
        )

    def write(self, offset: int, buffer: Tensor) -> Requests:
        """Starts writing ``buffer`` (from ``aligned_buffer``) at byte ``offset``."""
        return self._submit(offset, buffer, os.pwritev)

    def read(self, offset: int, buffer: Tensor) -> Requests:
        """Starts reading ``buffer.nbytes`` bytes at byte ``offset`` into ``buffer`` (from ``aligned_buffer``)."""
        return self._submit(offset, buffer, os.preadv)

    def _submit(self, offset: int, buffer: Tensor, call) -> Requests:
        view = memoryview(buffer.numpy()).cast("B")
        if offset % ALIGN or len(view) % ALIGN or buffer.data_ptr() % ALIGN:
            raise ValueError(f"direct I/O needs offsets, lengths and buffers aligned to {ALIGN} bytes")
        if offset + len(view) > self.nbytes:
            raise ValueError(f"bytes {offset}..{offset + len(view)} lie past the swap file's {self.nbytes}")
        pieces = []
        for start in range(0, len(view), self.block_size):
            piece = view[start : start + self.block_size]
            future = self.pool.submit(_whole, call, self.fd, piece, offset + start)
            self.in_flight.add(future)
            future.add_done_callback(self.in_flight.discard)
            pieces.append(future)
        return Requests(pieces)

    def close(self) -> None:
        """Waits for what is in flight, then removes the file (call it on errors too)."""
        self.fd = None
        self._finalizer()

    def _remove(self) -> None:
        os.close(self.fd)
        self.fd = None
        self.path.unlink(missing_ok=True)


def _discard(in_flight: set[Future], fd: int, path: Path) -> None:
    concurrent.futures.wait(list(in_flight))
    os.close(fd)
    path.unlink(missing_ok=True)


@functools.cache
def io_threads(queue_depth: int) -> ThreadPoolExecutor:
    """The threads that serve every swap file's requests in this process: ``queue_depth`` requests in flight at most,
    whatever the number of files (one per unit). Made again in a forked child (the threads do not follow a fork)."""
    return ThreadPoolExecutor(queue_depth, thread_name_prefix="lightning_zero_swap")


os.register_at_fork(after_in_child=io_threads.cache_clear)


def _whole(call, fd: int, piece: memoryview, offset: int) -> None:
    """One piece, all of it (a positional call may move fewer bytes than asked: the rest is asked again)."""
    done = 0
    while done < len(piece):
        moved = call(fd, [piece[done:]], offset + done)
        if moved == 0:
            raise OSError(errno.EIO, f"the swap file ended at byte {offset + done}")
        done += moved


def stream(
    regions: Sequence[tuple[SwapFile, int, int]], ring: Sequence[Tensor], *, write_back: bool = True
) -> Iterator[Tensor]:
    """Each region (swap file, byte offset, bytes; aligned, at most a ring buffer long) in turn, in the buffers of
    ``ring`` (from ``aligned_buffer``): while the caller works on region i (the yielded buffer, changed in place),
    region i + 1 is read ahead and region i - 1 written behind (with ``write_back``), so the disk and the caller
    overlap; the host holds the ring, never more. Region i is written when the caller asks for region i + 1, so the
    loop must run the stream to its end (``zip(stream(...), other)``, not ``zip(other, stream(...))``, which stops
    before the last write); every write has ended when the loop does (or is left)."""
    if len(ring) < 2 + write_back and len(regions) > 1:
        raise ValueError(f"a stream needs >= {2 + write_back} buffers")
    reads: dict[int, Requests] = {}
    writes: dict[int, Requests] = {}

    def buffer_of(i: int) -> Tensor:
        return ring[i % len(ring)][: -(-regions[i][2] // ALIGN) * ALIGN]

    def start_read(i: int) -> None:
        if i < len(regions) and i not in reads:
            if i - len(ring) in writes:  # (the buffer's last region must be on the disk before it is reused)
                writes.pop(i - len(ring)).wait()
            reads[i] = regions[i][0].read(regions[i][1], buffer_of(i))

    try:
        for i in range(len(regions)):
            start_read(i)
            start_read(i + 1)
            reads.pop(i).wait()
            yield buffer_of(i)
            if write_back:
                writes[i] = regions[i][0].write(regions[i][1], buffer_of(i))
    finally:  # every request waited for (the ring is reused after), the first error raised once all are
        failures = []
        for pending in [*reads.values(), *writes.values()]:
            try:
                pending.wait()
            except OSError as error:
                failures.append(error)
        if failures:
            raise failures[0]


def stream_chunks(
    swap: SwapFile, offset: int, nbytes: int, chunk_bytes: int, *, buffers: int = 3, write_back: bool = True
) -> Iterator[Tensor]:
    """``stream`` over the bytes ``offset .. offset + nbytes`` of ``swap`` in chunks of ``chunk_bytes`` (the last
    shorter), through ``buffers`` new buffers."""
    if chunk_bytes % ALIGN or offset % ALIGN:
        raise ValueError(f"chunks and offsets must be aligned to {ALIGN} bytes")
    regions = [
        (swap, start, min(chunk_bytes, offset + nbytes - start))
        for start in range(offset, offset + nbytes, chunk_bytes)
    ]
    ring = [aligned_buffer(chunk_bytes) for _ in range(min(buffers, len(regions)))]
    if buffers < 2 + write_back:
        raise ValueError(f"a stream needs >= {2 + write_back} buffers")
    return stream(regions, ring, write_back=write_back)

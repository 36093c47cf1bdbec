"""One unit's optimizer state on NVMe (ZeRO-Infinity's optimizer tier, issue 43): its fp32 master partition and
Adam's two moments in a swap file of its own, cut into chunks that a step streams through a few host buffers.

[Note: a unit's swap file]
The partition's ``numel`` elements are cut into chunks of at most ``chunk_numel``; chunk k covers elements [lo, hi) and
is stored as one record: the master's run, then exp_avg's, then exp_avg_sq's, each ``width`` elements (hi - lo rounded
up to 1024, so each run starts on a 4096-byte boundary; the rounding is zeros). One read brings a chunk's three runs
into one buffer, one write takes them back, so a step's I/O is a sequence of whole records (``regions``) that
``swap_file.stream`` reads ahead and writes behind. ``read`` and ``write`` move the whole partition (a checkpoint's save
and load, one unit at a time; ``read_master`` and ``write_master`` only the master runs, a third of it),
``update_master`` the chunks of one parameter's piece; the step never does. The file lives as long as the unit (so a
checkpoint can still be saved after ``fit``) and is removed when the unit goes or the process exits (swap_file.py), also
after an error; only a kill -9 leaves it behind."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero.config import NvmeSwap
from lightning_zero.nvme.swap_file import Requests, SwapFile, aligned_buffer, scratch_name

RUN_ALIGN = 1024  # elements: 4096 bytes of fp32
FIELDS = 3  # master, exp_avg, exp_avg_sq


class UnitSwap:
    """One unit's fp32 master partition and Adam moments in a swap file of its own, as records of chunks (see
    [Note: a unit's swap file]); ``pin``: the partitions it reads come in pinned memory."""

    def __init__(self, settings: NvmeSwap, numel: int, *, pin: bool = False) -> None:
        """A swap file for a partition of ``numel`` elements under ``settings.directory`` (made whole now)."""
        self.numel, self.pin = numel, pin
        self.chunks: list[tuple[int, int]] = [
            (lo, min(lo + settings.chunk_numel, numel)) for lo in range(0, numel, settings.chunk_numel)
        ]
        self.offsets: list[int] = []
        total = 0
        for lo, hi in self.chunks:
            self.offsets.append(total)
            total += record_bytes(hi - lo)
        self.buffer_bytes = max((record_bytes(hi - lo) for lo, hi in self.chunks), default=0)
        name = scratch_name("optimizer")
        self.file = SwapFile(
            settings.directory, name, max(total, 1), queue_depth=settings.queue_depth, block_size=settings.block_size
        )

    def regions(self) -> list[tuple[SwapFile, int, int]]:
        """Each chunk's record as ``swap_file.stream`` takes them."""
        return [(self.file, offset, record_bytes(hi - lo)) for (lo, hi), offset in zip(self.chunks, self.offsets)]

    def read(self, allocate: Callable[[int], Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The whole master partition and both moments, as new fp32 tensors (``allocate(numel)``'s: a zeroed tensor)."""
        return self._read(FIELDS, allocate)

    def read_master(self, allocate: Callable[[int], Tensor] | None = None) -> Tensor:
        """The whole master partition, as a new fp32 tensor (a third of the records read: their master runs)."""
        return self._read(1, allocate)[0]

    def _read(self, fields: int, allocate: Callable[[int], Tensor] | None) -> tuple[Tensor, ...]:
        allocate = allocate or (lambda numel: torch.zeros(numel, pin_memory=self.pin))
        out = tuple(allocate(self.numel) for _ in range(fields))
        buffer = aligned_buffer(self.buffer_bytes)
        for (lo, hi), (file, offset, nbytes) in zip(self.chunks, self.regions()):
            record = buffer[: nbytes * fields // FIELDS]
            file.read(offset, record).wait()
            for whole, run in zip(out, split(buffer[:nbytes], hi - lo)):
                whole[lo:hi].copy_(run)
        return out

    def write(self, master: Tensor, exp_avg: Tensor | None = None, exp_avg_sq: Tensor | None = None) -> None:
        """Stores the whole partition (moments None: zeros); one record written while the next is filled."""
        self._write((master, exp_avg, exp_avg_sq))

    def write_master(self, master: Tensor) -> None:
        """Stores the whole master partition, the moments left as they are (the records' master runs only)."""
        self._write((master,))

    def _write(self, wholes: tuple[Tensor | None, ...]) -> None:
        buffers = [aligned_buffer(self.buffer_bytes) for _ in range(2)]
        pending: list[Requests | None] = [None, None]
        for k, ((lo, hi), (file, offset, nbytes)) in enumerate(zip(self.chunks, self.regions())):
            if pending[k % 2] is not None:
                pending[k % 2].wait()
            record = buffers[k % 2][:nbytes]
            record.zero_()  # (the rounding stays zero)
            for run, whole in zip(split(record, hi - lo), wholes):
                if whole is not None:
                    run.copy_(whole[lo:hi])
            pending[k % 2] = file.write(offset, record[: nbytes * len(wholes) // FIELDS])
        for requests in pending:
            if requests is not None:
                requests.wait()

    def update_master(self, lo: int, values: Tensor) -> None:
        """Stores ``values`` as master elements [lo, lo + len): only the chunks they fall in are read and written."""
        buffer = aligned_buffer(self.buffer_bytes)
        hi = lo + values.numel()
        for (start, stop), (file, offset, nbytes) in zip(self.chunks, self.regions()):
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                run = buffer[: nbytes // FIELDS]
                file.read(offset, run).wait()
                run.view(torch.float32)[a - start : b - start].copy_(values[a - lo : b - lo])
                file.write(offset, run).wait()


def width(numel: int) -> int:
    """Elements each of a chunk's runs takes in its record."""
    return -(-numel // RUN_ALIGN) * RUN_ALIGN


def record_bytes(numel: int) -> int:
    """Bytes of the record of a chunk of ``numel`` elements: its three fp32 runs of ``width(numel)`` elements."""
    return FIELDS * 4 * width(numel)


def split(record: Tensor, numel: int) -> tuple[Tensor, Tensor, Tensor]:
    """A record buffer (uint8) as its chunk's master, exp_avg and exp_avg_sq runs (fp32 views, ``numel`` each)."""
    values = record.view(torch.float32).view(FIELDS, width(numel))
    return values[0, :numel], values[1, :numel], values[2, :numel]

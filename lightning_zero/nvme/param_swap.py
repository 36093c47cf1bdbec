"""One stage-3 unit's parameter shard on NVMe (``offload_param="nvme"``, issue 43): this rank's partition of the unit,
in the parameters' dtype, in a swap file of its own.

[Note: a shard on NVMe]
The unit keeps a placeholder (a meta tensor) as ``param_shard``; the values are here. ``start_read`` starts reading
the whole shard into a new aligned buffer (the unit's gather calls it when the schedule asks for the unit, which is
ahead of its use when the schedule prefetches it) and returns what waits for it; the buffer lives until the unit's
all-gather has consumed it. ``write`` stores a run of it (the optimizer step, chunk by chunk; a load or a write of a
weight, the whole shard) from its own aligned buffer, which goes as soon as it is written; the next read waits for
every write in flight first, so a gather never reads what a step is still writing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero.config import NvmeSwap
from lightning_zero.nvme.swap_file import ALIGN, Requests, SwapFile, aligned_buffer, scratch_name


class ParamSwap:
    """One stage-3 unit's parameter shard of ``numel`` elements of ``dtype`` in a swap file of its own (see [Note: a
    shard on NVMe]); ``pin``: the shards it reads come in pinned memory (for a CUDA device)."""

    def __init__(self, settings: NvmeSwap, numel: int, dtype: torch.dtype, *, pin: bool = False) -> None:
        self.numel, self.dtype, self.pin = numel, dtype, pin
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        name = scratch_name("params")
        self.file = SwapFile(
            settings.directory, name, numel * self.itemsize, queue_depth=settings.queue_depth,
            block_size=settings.block_size,
        )  # fmt: skip
        self._writes: list[Requests] = []  # the writes maybe still in flight

    def write(self, lo: int, values: Tensor) -> None:
        """Starts storing elements [lo, lo + len(values)) of the shard (cast to its dtype); ``lo`` times the itemsize
        must be a multiple of 4096 (chunks are: see ``ZeroConfig.nvme_chunk_numel``)."""
        if lo * self.itemsize % ALIGN:
            raise ValueError(f"a shard's write must start on a {ALIGN}-byte boundary, got element {lo}")
        buffer = aligned_buffer(values.numel() * self.itemsize)
        typed = buffer.view(self.dtype)
        typed[: values.numel()].copy_(values.reshape(-1))
        typed[values.numel() :].zero_()
        # the requests' pieces hold the buffer until each is done (then it goes): no copy outlives its write
        self._writes = [requests for requests in self._writes if not requests.done()]
        self._writes.append(self.file.write(lo * self.itemsize, buffer))

    def start_read(self) -> Callable[[], Tensor]:
        """Starts reading the whole shard (after every write in flight); the returned function waits for it and gives
        the shard (a host tensor, pinned for a CUDA device)."""
        self.flush()
        buffer = aligned_buffer(self.numel * self.itemsize, pin=self.pin)
        reading = self.file.read(0, buffer)

        def shard() -> Tensor:
            reading.wait()
            return buffer.view(self.dtype)[: self.numel]

        return shard

    def read(self) -> Tensor:
        """The whole shard, now (a new tensor)."""
        return self.start_read()()

    def update(self, lo: int, values: Tensor) -> None:
        """Stores ``values`` as elements [lo, lo + len) of the shard: only the 4096-byte blocks they fall in are read
        and written (one weight's write: a load, a pretrained checkpoint)."""
        self.flush()
        start = lo * self.itemsize // ALIGN * ALIGN
        stop = min(-(-(lo + values.numel()) * self.itemsize // ALIGN) * ALIGN, self.file.nbytes)
        window = aligned_buffer(stop - start)
        self.file.read(start, window).wait()
        first = (lo * self.itemsize - start) // self.itemsize
        window.view(self.dtype)[first : first + values.numel()].copy_(values.reshape(-1))
        self.file.write(start, window).wait()

    def flush(self) -> None:
        """Waits for every write in flight."""
        for requests in self._writes:
            requests.wait()
        self._writes.clear()


def read_or_zeros(read: Callable[[], Tensor], numel: int, dtype: torch.dtype) -> tuple[Tensor, OSError | None]:
    """``read()``, or ``numel`` zeros and the OSError it raised (a disk's): the collective they feed still runs on this
    rank, which raises the error after it, so that no peer waits for this one."""
    try:
        return read(), None
    except OSError as error:
        return torch.zeros(numel, dtype=dtype), error

"""Checkpointed units' saved tensors kept in host memory (ZeRO-R's Pa+cpu; ``ZeroConfig.offload_activations``).

[Note: offloaded checkpoints]
What a checkpointed unit saves (its inputs: checkpointing.py's [Note: checkpointing a unit]) is copied, as the
forward passes, into one host pool and dropped from the device; in backward, when a unit's recomputation
unpacks its inputs, the inputs of the unit before it (the next one backward reaches) start coming back, so the
copy overlaps that unit's recomputation and backward. On a GPU both directions run on one side stream (in
order, so a copy back never reads a buffer before its copy out landed) and the pool is pinned, so the copies are
asynchronous; the consumer waits on an event, and ``record_stream`` keeps the caching allocator from reusing a
tensor the side stream still reads or writes. On the CPU the same code runs with no stream: host-to-host copies
into the pool and out of it.

[Note: the host pool]
ZeRO-R's constant buffers and defragmented memory: saved tensors are laid one after another in one contiguous
host buffer (each at an aligned offset), and the buffer is filled again from its start once every tensor saved
into it has been released (after the backward). A step needing more than the buffer holds gets an extra chunk
for the overflow (or an emptied one, when a graph kept alive holds the first); when the pool is next empty its
chunks become one buffer of the most it held at once, so a training run allocates host memory in its first
steps only and ``capacity`` bytes stay constant. A tensor saved by several units (an attention mask or rotary
table passed to every layer) is stored once. An input changed in place after it was saved raises at backward,
as autograd's own check does (which a pack hook turns off).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.nn import Parameter

ALIGNMENT = 64  # bytes: any dtype's alignment, and whole cache lines for the copies


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class _Chunk:
    """One host buffer of the pool, filled from its start; reusable once nothing in it is held."""

    def __init__(self, buffer: Tensor) -> None:
        self.buffer, self.used, self.live = buffer, 0, 0


class HostPool:
    """One contiguous host buffer reused every step (see [Note: the host pool])."""

    def __init__(self, *, pin_memory: bool) -> None:
        self._pin = pin_memory
        self._chunks: list[_Chunk] = []  # one, except while a step needs more than it holds
        self._current: _Chunk | None = None  # the chunk being filled
        self._held = 0  # bytes held (aligned)
        self._most = 0  # most bytes held at once since the pool was last empty: the size of one buffer for them
        self.live = 0  # tensors held
        self.peak_bytes = 0  # most bytes held at once, ever

    @property
    def capacity(self) -> int:
        """Bytes the pool's chunks hold in all, in use or not."""
        return sum(chunk.buffer.numel() for chunk in self._chunks)

    def take(self, nbytes: int) -> tuple[Tensor, _Chunk]:
        """``nbytes`` of host memory (uint8) and the chunk it is in, held until ``release(chunk, nbytes)``."""
        if self.live == 0 and len(self._chunks) > 1:  # one buffer of all the last steps held at once, from now on
            self._chunks = [_Chunk(self._allocate(self._most))]
            self._current, self._most = None, 0
        chunk = self._current
        offset = _aligned(chunk.used) if chunk is not None else 0
        if chunk is None or offset + nbytes > chunk.buffer.numel():
            offset = 0  # an emptied chunk large enough (a step whose graph lingers leaves the others held), or more
            chunk = next((c for c in self._chunks if c.live == 0 and c.buffer.numel() >= nbytes), None)
            if chunk is None:
                chunk = _Chunk(self._allocate(max(nbytes, self.capacity)))
                self._chunks.append(chunk)
            self._current = chunk
        chunk.used = offset + nbytes
        chunk.live += 1
        self.live += 1
        self._held += _aligned(nbytes)
        self._most = max(self._most, self._held)
        self.peak_bytes = max(self.peak_bytes, self._held)
        return chunk.buffer[offset : offset + nbytes], chunk

    def release(self, chunk: _Chunk, nbytes: int) -> None:
        """Gives back ``nbytes`` taken from ``chunk`` by ``take``; the chunk is reused from its start once empty."""
        chunk.live -= 1
        self.live -= 1
        self._held -= _aligned(nbytes)
        if chunk.live == 0:
            chunk.used = 0

    def _allocate(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)


class _Held:
    """One saved tensor in the pool, and its copy on the device while backward needs it."""

    def __init__(self, host: Tensor, group: int, source: Tensor) -> None:
        self.host = host
        self.device = source.device  # where it came from, and goes back to
        self.source = weakref.ref(source)  # (changed in place after it was saved: an error, as autograd's)
        self.version = source._version
        self.group = group  # the checkpoint (unit forward) that saved it first, in forward order
        self.shared = False  # saved by several units: its device copy stays until it is released
        self.on_device: Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class HostActivations:
    """Offloads what checkpointed units save (see [Note: offloaded checkpoints]) for a model on ``device``."""

    def __init__(self, device: torch.device, *, pin_memory: bool = True) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = HostPool(pin_memory=pin_memory and device.type == "cuda")
        self._groups: list[list[weakref.ref]] = []  # per checkpoint entered since the pool was empty: its _Helds
        self._seen: dict[int, tuple] = {}  # id(a saved tensor) -> (it, its _Held, its version), weakly: stored once

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint's start: the tensors it saves go to the pool, as one group."""
        if self.pool.live == 0:
            self._groups.clear()
            self._seen.clear()
        self._groups.append([])
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: Tensor) -> Tensor | _Held:
        nbytes = tensor.numel() * tensor.element_size()
        if (
            isinstance(tensor, Parameter)
            or tensor.device.type != self.device.type
            or not 0 < nbytes <= tensor.untyped_storage().nbytes()
        ):
            return tensor  # (parameters, other kinds of device and expanded tensors, whole bigger, stay as they are)
        seen = self._seen.get(id(tensor))  # (the same tensor object, alive, unchanged since)
        held = seen[1]() if seen is not None and seen[0]() is tensor and seen[2] == tensor._version else None
        if held is not None:
            held.shared = True
        else:
            held = self._copy_out(tensor)
            self._seen[id(tensor)] = (weakref.ref(tensor), weakref.ref(held), tensor._version)
        self._groups[-1].append(weakref.ref(held))
        return held

    def _copy_out(self, tensor: Tensor) -> _Held:
        nbytes = tensor.numel() * tensor.element_size()
        buffer, chunk = self.pool.take(nbytes)
        held = _Held(buffer.view(tensor.dtype).view(tensor.shape), len(self._groups) - 1, tensor)
        weakref.finalize(held, self.pool.release, chunk, nbytes)
        if self.stream is None:
            held.host.copy_(tensor)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                held.host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # (its memory is not reused before the copy has read it)
        return held

    def _unpack(self, held: Tensor | _Held) -> Tensor:
        if isinstance(held, Tensor):
            return held
        source = held.source()
        if source is not None and source._version != held.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: a"
                f" block's input kept in host memory (zero.offload_activations) is at version {source._version}, it"
                f" was saved at version {held.version}"
            )
        if held.on_device is None:
            self._copy_back(held)
        # the inputs of the unit backward reaches next start coming back (see [Note: offloaded checkpoints])
        for ref in self._groups[held.group - 1] if held.group > 0 else ():
            earlier = ref()
            if earlier is not None and earlier.on_device is None:
                self._copy_back(earlier)
        tensor = held.on_device
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(held.ready)
            tensor.record_stream(current)
        if not held.shared:
            held.on_device = None  # (autograd holds it from here, for as long as the unit's backward needs it)
        return tensor

    def _copy_back(self, held: _Held) -> None:
        if self.stream is None:
            held.on_device = held.host.clone()
            return
        with torch.cuda.stream(self.stream):  # (after its copy out, on this stream; into memory of this stream's)
            held.on_device = held.host.to(held.device, non_blocking=True)
            held.ready = self.stream.record_event()

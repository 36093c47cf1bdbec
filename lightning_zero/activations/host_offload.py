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
host buffer (each at an aligned offset), and the whole buffer is reused once every tensor saved into it has been
released (after the backward). A step needing more than the buffer holds gets an extra chunk for the overflow;
when the pool is next empty its chunks become one buffer of the largest size used, so a training run allocates
host memory in its first steps only and ``capacity`` bytes stay constant. A tensor saved by several units (an
attention mask or rotary table passed to every layer) is stored once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.nn import Parameter

ALIGNMENT = 64  # bytes: any dtype's alignment, and whole cache lines for the copies


class HostPool:
    """One contiguous host buffer reused every step (see [Note: the host pool])."""

    def __init__(self, *, pin_memory: bool) -> None:
        self._pin = pin_memory
        self._chunks: list[Tensor] = []  # uint8 buffers; all but the first are this step's overflow
        self._used = 0  # bytes taken in the last chunk
        self._taken = 0  # bytes taken (aligned) in all chunks since the pool was last empty
        self.live = 0  # tensors held
        self.peak_bytes = 0  # most bytes held at once

    @property
    def capacity(self) -> int:
        return sum(chunk.numel() for chunk in self._chunks)

    def take(self, nbytes: int) -> Tensor:
        """``nbytes`` of host memory (uint8), held until ``release``."""
        offset = -(-self._used // ALIGNMENT) * ALIGNMENT
        if not self._chunks or offset + nbytes > self._chunks[-1].numel():
            self._chunks.append(self._allocate(max(nbytes, self.capacity)))
            offset = 0
        self._used = offset + nbytes
        self._taken += -(-nbytes // ALIGNMENT) * ALIGNMENT  # (what one buffer needs for everything taken so far)
        self.peak_bytes = max(self.peak_bytes, self._taken)
        self.live += 1
        return self._chunks[-1][offset : offset + nbytes]

    def release(self) -> None:
        self.live -= 1
        if self.live == 0:
            if len(self._chunks) > 1:  # one buffer of everything the step used, from now on
                self._chunks = [self._allocate(self._taken)]
            self._used = self._taken = 0

    def _allocate(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)


class _Held:
    """One saved tensor in the pool, and its copy on the device while backward needs it."""

    def __init__(self, host: Tensor, group: int, device: torch.device) -> None:
        self.host = host
        self.device = device  # where it came from, and goes back to
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
        if isinstance(tensor, Parameter) or tensor.device.type != self.device.type or tensor.numel() == 0:
            return tensor  # (parameters, and tensors of another kind of device, stay where they are)
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
        buffer = self.pool.take(tensor.numel() * tensor.element_size())
        held = _Held(buffer.view(tensor.dtype).view(tensor.shape), len(self._groups) - 1, tensor.device)
        weakref.finalize(held, self.pool.release)
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
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            held.on_device = held.host.to(held.device, non_blocking=True)
            held.ready = self.stream.record_event()

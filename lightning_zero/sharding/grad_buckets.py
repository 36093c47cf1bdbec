"""The gradient reducer's buckets: one slot per bucket of a unit, and the pool their buffers come from.

[Note: bucket lifetime]
A bucket buffer (stages 2 and 3) is taken from a pool and zeroed when its first gradient arrives, and
given back to the pool when its reduce-scatter has been waited on and added into the partition, so
buffers are allocated once and reused across micro-batches and steps. Each gradient is copied once,
into its bucket (scaled by 1/world_size on the way). Launched buckets are kept in flight up to
``max_inflight_bytes``; launching past it first retires the oldest. Together with the buckets still
filling, this bounds transient gradient memory to a few buckets instead of the full model. Stage 1's
"buffer" is the bucket's region of the unit's full gradient, zeroed (not pooled) once reduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import Bucket
from lightning_zero.sharding.offload import wait_for_copy


@dataclass(eq=False)
class BucketSlot:
    """One bucket of one unit in the reducer's launch order, and what the backward in progress did to it."""

    unit: FlatUnit
    bucket: Bucket
    params: list[Parameter]
    expected: list[bool] = field(default_factory=list)  # per parameter: can still get a gradient (stages 1, 2)
    expected_count: int = 0
    arrived: int = 0  # expected gradients that arrived in this backward
    launched: bool = False
    buffer: Tensor | None = None  # where its gradients are summed until its reduce-scatter is retired

    @classmethod
    def of(cls, unit: FlatUnit, bucket: Bucket) -> BucketSlot:
        """The slot of ``unit``'s ``bucket``, every parameter expected until a backward says otherwise."""
        params = [unit.params[i] for i in range(bucket.first_param, bucket.end_param)]
        return cls(unit, bucket, params, expected=[True] * len(params))

    @property
    def key(self) -> tuple[int, int]:
        """``(id(unit), bucket.start)``: how the reducer finds the slot of a parameter's bucket."""
        return id(self.unit), self.bucket.start

    @property
    def full_gradient(self) -> bool:
        """Stage 1: the buffer is the bucket's region of the unit's full gradient (persistent)."""
        return self.unit.training.flat_grad is not None

    def ready(self) -> bool:
        """Whether every gradient expected in this backward has arrived (its reduce-scatter may launch)."""
        return self.arrived >= self.expected_count

    def expect(self, flags: list[bool]) -> None:
        """When a backward that reduces starts: which of its parameters can still get a gradient in it."""
        self.expected, self.expected_count = flags, sum(flags)

    def arrive(self, position: int) -> bool:
        """A gradient of its parameter ``position`` arrived; whether it was one expected."""
        if self.expected[position]:
            self.arrived += 1
        return self.expected[position]

    def mark_launched(self) -> None:
        """Its reduce-scatter was launched (or promised, coalescing at stage 3): a later gradient is an error."""
        self.launched = True

    def use_buffer(self, buffer: Tensor) -> Tensor:
        """Makes ``buffer`` the slot's gradient buffer; returns it."""
        self.buffer = buffer
        return buffer

    def take_buffer(self) -> Tensor:
        """Hands the slot's buffer over (None if it has none), leaving the slot without one."""
        buffer, self.buffer = self.buffer, None
        return buffer

    def end_backward(self) -> None:
        """The backward ended: no gradient has arrived in the next one yet."""
        self.arrived = 0

    def end_reduction(self) -> None:
        """Its reduction was waited for (or dropped): the next backward may launch it again."""
        self.launched = False


class BucketPool:
    """Free bucket buffers by (numel, dtype, device), and the host copies still reading them (offload on CUDA)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[Tensor]] = {}
        self._copying: dict[int, object] = {}  # id(buffer) -> the event of its copy to the host
        self.allocated = 0  # buffers ever allocated (the pool reuses them)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer of ``numel`` elements of ``dtype`` on ``device``: a free one, else a new one; not zeroed.

        A reused buffer's pending copy to the host is waited for first (``wait_for_copy``)."""
        free = self._free.setdefault((numel, dtype, device), [])
        if not free:
            free.append(torch.empty(numel, dtype=dtype, device=device))
            self.allocated += 1
        buffer = free.pop()
        self.wait_for_copy(buffer)
        return buffer

    def give_back(self, buffer: Tensor) -> None:
        """Returns ``buffer``, taken from this pool, for the next ``take`` of its size, dtype and device."""
        self._free[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)

    def copying(self, buffer: Tensor, event: object) -> None:
        """``buffer`` is being copied to the host: its next user waits for ``event``."""
        self._copying[id(buffer)] = event

    def wait_for_copy(self, buffer: Tensor) -> None:
        """Makes the compute stream wait for ``buffer``'s pending copy to the host, if any (``copying``), so it may be
        overwritten; the host does not wait."""
        wait_for_copy(buffer, self._copying.pop(id(buffer), None))

    def free_bytes(self) -> int:
        """Bytes of the buffers in the pool now (taken ones not counted)."""
        return sum(buffer.nbytes for free in self._free.values() for buffer in free)

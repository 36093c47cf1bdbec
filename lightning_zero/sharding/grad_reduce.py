"""From a parameter's gradient hook to this rank's reduced gradient partition.

Each trainable parameter of every unit gets a post-accumulate-grad hook. The hook moves the fresh
gradient out of ``param.grad`` (freeing it) into gradient storage of its bucket and records that the
parameter was used. Stage 1 adds it into the unit's full flat gradient buffer; everything is
reduce-scattered once per optimizer step (``reduce_accumulated``). Stage 2 adds it into a bucket
buffer; a full bucket is reduce-scattered, asynchronously when ``overlap`` is on, while backward goes
on, and the reduced chunk is added into the unit's fp32 gradient partition.

[Note: launch order]
Collectives are matched across ranks by the order in which they are issued, not by name, and which
bucket fills first can differ between ranks (a parameter unused on one rank, say). So buckets are
launched in one order that every rank derives from the layouts alone: by the model position of the
earliest parameter they hold, latest first, which is roughly the order backward fills them. A full
bucket waits until every bucket before it in that order has been launched; ``finish_backward``
launches whatever is left, in order, including buckets no gradient reached on this rank (they
contribute zeros). It must run exactly once per backward on every rank: the strategy calls it from
``post_backward``.

[Note: bucket lifetime]
A stage-2 bucket buffer is allocated (zeroed) when its first gradient arrives and released when its
reduce-scatter has been waited on and added into the partition. At most ``max_inflight`` launched
buckets are kept in flight; launching one more first retires the oldest. Together with the buckets
still filling, this bounds transient gradient memory to a few buckets instead of the full model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import Bucket


class GradReducer:
    def __init__(
        self,
        units: Sequence[FlatUnit],
        model_position: dict[Parameter, int],
        *,
        reduce_in_backward: bool,
        overlap: bool,
        world_size: int,
        max_inflight: int = 2,
        on_bucket_complete: Callable[[FlatUnit], None] | None = None,
        group=None,
    ) -> None:
        self.units = list(units)
        self.reduce_in_backward = reduce_in_backward
        self.overlap = overlap
        self.world_size = world_size
        self.max_inflight = max_inflight if overlap else 0
        self.on_bucket_complete = on_bucket_complete  # stage 3 frees a unit's parameters then
        self.group = group

        # (unit, bucket) in launch order; see [Note: launch order].
        slots = [(u, b) for u in self.units for b in u.layout.buckets]
        slots.sort(
            key=lambda ub: -min(model_position[ub[0].params[i]] for i in range(ub[1].first_param, ub[1].end_param))
        )
        self.order: list[tuple[FlatUnit, Bucket]] = slots
        self._index = {(id(u), b.start): k for k, (u, b) in enumerate(slots)}
        self._sizes = [b.end_param - b.first_param for _, b in slots]

        self._buffers: list[Tensor | None] = [None] * len(slots)
        self._arrived: list[set[int]] = [set() for _ in slots]
        self._next = 0  # first bucket in launch order not launched yet in this backward
        self._inflight: deque[tuple[int, dist.Work | None]] = deque()

        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(u, i))
            for u in self.units
            for i, p in enumerate(u.params)
        ]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _make_hook(self, unit: FlatUnit, index: int):
        bucket = unit.layout.buckets[unit.layout.param_bucket[index]]
        slot = self._index[(id(unit), bucket.start)]
        offset = unit.layout.offsets[index]
        numel = unit.layout.numels[index]

        # Gradients are averaged over ranks: each is divided by world_size on its way into the bucket
        # (as DDP pre-divides), and the reduce-scatter sums.
        scale = 1.0 / self.world_size

        def hook(param: Tensor) -> None:
            grad = param.grad
            param.grad = None
            unit.used[index] = 1
            if not self.reduce_in_backward:
                unit.flat_grad[offset : offset + numel].add_(grad.reshape(-1), alpha=scale)
                return
            if slot < self._next:
                raise RuntimeError(
                    f"parameter {unit.names[index]!r} produced a second gradient after its bucket was already"
                    " reduce-scattered in this backward (reentrant activation checkpointing or a backward outside"
                    " the Trainer). Use non-reentrant checkpointing and `self.manual_backward(loss)`."
                )
            buffer = self._buffers[slot]
            if buffer is None:
                buffer = self._buffers[slot] = torch.zeros(bucket.numel, dtype=grad.dtype, device=grad.device)
            buffer[offset - bucket.start : offset - bucket.start + numel].add_(grad.reshape(-1), alpha=scale)
            self._arrived[slot].add(index)
            if self.on_bucket_complete is not None and len(self._arrived[slot]) == self._sizes[slot]:
                self.on_bucket_complete(unit)
            self._launch_ready()

        return hook

    # --- stage 2 -----------------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self._next < len(self.order) and len(self._arrived[self._next]) == self._sizes[self._next]:
            self._launch_next()

    def _launch_next(self) -> None:
        slot = self._next
        self._next += 1
        unit, bucket = self.order[slot]
        buffer = self._buffers[slot]
        if buffer is None:  # no gradient reached this bucket on this rank: it contributes zeros
            param = unit.flat_param
            buffer = self._buffers[slot] = torch.zeros(bucket.numel, dtype=param.dtype, device=param.device)
        own = buffer[bucket.chunk_numel * unit.rank : bucket.chunk_numel * (unit.rank + 1)]
        work = collectives.reduce_scatter(own, buffer, async_op=self.overlap, group=self.group)
        self._inflight.append((slot, work))
        while len(self._inflight) > self.max_inflight:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        slot, work = self._inflight.popleft()
        collectives.wait(work)
        unit, bucket = self.order[slot]
        own = self._buffers[slot][bucket.chunk_numel * unit.rank : bucket.chunk_numel * (unit.rank + 1)]
        unit.grad_partition[unit.partition_slice(bucket)].add_(own)
        self._buffers[slot] = None

    def finish_backward(self) -> None:
        """Launches every bucket not launched yet, in order, and waits for all of them."""
        if not self.reduce_in_backward:
            return
        while self._next < len(self.order):
            self._launch_next()
        while self._inflight:
            self._retire_oldest()
        self._next = 0
        self._arrived = [set() for _ in self.order]

    def backward_pending(self) -> bool:
        """Whether a backward produced gradients that ``finish_backward`` has not reduced yet."""
        return any(self._arrived)

    # --- stage 1 -----------------------------------------------------------------------------------
    def reduce_accumulated(self, units: Sequence[FlatUnit]) -> None:
        """Stage 1: reduce-scatters the accumulated full gradients of ``units`` into each unit's
        transient ``reduced`` partition, in launch order."""
        wanted = {id(u) for u in units}
        for unit in units:
            unit.reduced = torch.empty(
                unit.layout.partition_numel, dtype=unit.flat_grad.dtype, device=unit.flat_grad.device
            )
        works = []
        for unit, bucket in self.order:
            if id(unit) not in wanted:
                continue
            buffer = unit.flat_grad[bucket.start : bucket.start + bucket.numel]
            out = unit.reduced[unit.partition_slice(bucket)]
            works.append(collectives.reduce_scatter(out, buffer, async_op=True, group=self.group))
        for work in works:
            collectives.wait(work)

"""From a parameter's gradient hook to this rank's reduced gradient partition.

Each trainable parameter of every unit gets a post-accumulate-grad hook. The hook moves the fresh
gradient out of ``param.grad`` (freeing it) into gradient storage of its bucket and records that the
parameter was used. Stage 1 adds it into the unit's full flat gradient buffer; everything is
reduce-scattered once per optimizer step (``reduce_accumulated``). Stages 2 and 3 add it into a
bucket buffer whose reduce-scatter (asynchronous when ``overlap`` is on) adds this rank's chunk into
the unit's gradient partition. Stage 3's schedule decides when a unit's bucket is reduced
(``reduce_unit``, see stage3_schedule.py); stage 2 decides here.

[Note: stage-2 launch order]
Collectives are matched across ranks by issue order, so stage 2 launches buckets in one order that
every rank derives alike: by the model position of the earliest parameter they hold, latest first,
which is roughly the order backward fills them. After the first backward every rank adopts rank 0's
order instead (one broadcast), from the order in which rank 0's forward first used each bucket's
parameters, so modules registered in another order than they run do not hold buckets back. A bucket
is ready when every parameter that can still get a gradient in this backward has one: when the
backward starts, a parameter counts as expected if autograd will run its accumulator
(``torch._C._will_engine_execute_node``) or if its module ran in this forward (a reentrant activation
checkpoint's inner backward reaches it later). A bucket nobody can fill on this rank is therefore
launched (with zeros where no gradient came) as soon as its turn comes, never held to the end; the
end of backward (backward_end.py) launches whatever is left, in order.

[Note: bucket lifetime]
A bucket buffer is allocated (zeroed) when its first gradient arrives and released when its
reduce-scatter has been waited on and added into the partition. At most ``max_inflight`` launched
buckets are kept in flight; launching one more first retires the oldest. Together with the buckets
still filling, this bounds transient gradient memory to a few buckets instead of the full model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.nn import Module, Parameter

from lightning_zero.sharding import collectives
from lightning_zero.sharding.backward_end import BackwardEnd
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import Bucket


class GradReducer:
    def __init__(
        self,
        units: Sequence[FlatUnit],
        model_position: dict[Parameter, int],
        *,
        stage: int,
        overlap: bool,
        world_size: int,
        backward_end: BackwardEnd,
        model: Module | None = None,
        max_inflight: int = 2,
        group=None,
    ) -> None:
        """``model``: stage 2 watches its modules' forwards (see [Note: stage-2 launch order])."""
        self.stage = stage
        self.overlap = overlap
        self.world_size = world_size
        self.max_inflight = max_inflight if overlap else 0
        self.backward_end = backward_end
        self.group = group
        self.peak_live_buckets = 0  # most bucket buffers alive at once (filling or in flight)

        self.order: list[tuple[FlatUnit, Bucket]] = []  # launch order; see [Note: stage-2 launch order]
        self._params: list[list[Parameter]] = []
        self._launched: list[bool] = []
        self._buffers: list[Tensor | None] = []
        self._arrived: list[int] = []  # expected gradients that arrived in this backward
        self._expected: list[int] = []
        self._is_expected: list[list[bool]] = []
        self._next = 0  # first bucket in launch order not launched yet in this backward
        self._inflight: deque[tuple[int, dist.Work | None]] = deque()
        self._handles = []
        self.units = []
        self.add_units(units, model_position)
        self._forward_used: dict[int, int] = {}  # id(param) -> order of first use in this forward (stage 2)
        self._order_agreed = stage != 2 or world_size == 1
        if stage == 2:
            self._watch_forwards(model)
            backward_end.on_begin.append(self._expect)
        if stage >= 2:
            backward_end.on_end.append(self.finish_backward)

    def add_units(self, units: Sequence[FlatUnit], model_position: dict[Parameter, int] | None = None) -> None:
        """Starts reducing the gradients of ``units`` (at set-up, or when parameters are unfrozen): their
        buckets come after the existing ones in the launch order, on every rank alike."""
        position = model_position or {}
        slots = [(u, b) for u in units for b in u.layout.buckets]
        slots.sort(
            key=lambda ub: -min(position.get(ub[0].params[i], 0) for i in range(ub[1].first_param, ub[1].end_param))
        )
        self.units += list(units)
        self.order += slots
        self._params += [[u.params[i] for i in range(b.first_param, b.end_param)] for u, b in slots]
        self._launched += [False] * len(slots)
        self._buffers += [None] * len(slots)
        self._arrived += [0] * len(slots)
        self._expected += [0] * len(slots)
        self._is_expected += [[True] * (b.end_param - b.first_param) for _, b in slots]
        self._slot_of = {(id(u), b.start): k for k, (u, b) in enumerate(self.order)}
        self._handles += [
            p.register_post_accumulate_grad_hook(self._make_hook(u, i)) for u in units for i, p in enumerate(u.params)
        ]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _watch_forwards(self, model: Module | None) -> None:
        owned = {id(p) for u in self.units for p in u.params}
        for module in model.modules() if model is not None else ():
            params = [p for p in module._parameters.values() if p is not None and id(p) in owned]
            if params:
                self._handles.append(module.register_forward_pre_hook(self._make_forward_hook(params)))

    def _make_forward_hook(self, params: list[Parameter]):
        def hook(module: Module, args) -> None:
            for p in params:
                self._forward_used.setdefault(id(p), len(self._forward_used))

        return hook

    def _make_hook(self, unit: FlatUnit, index: int):
        bucket = unit.layout.buckets[unit.layout.param_bucket[index]]
        key = (id(unit), bucket.start)
        position = index - bucket.first_param
        lo = unit.layout.offsets[index] - bucket.start
        hi = lo + unit.layout.numels[index]

        # Gradients are averaged over ranks: each is divided by world_size on its way into the bucket
        # (as DDP pre-divides), and the reduce-scatter sums.
        scale = 1.0 / self.world_size

        def hook(param: Tensor) -> None:
            grad = param.grad
            param.grad = None
            unit.used[index] = 1
            if self.stage == 1:
                unit.flat_grad[bucket.start + lo : bucket.start + hi].add_(grad.reshape(-1), alpha=scale)
                return
            self.backward_end.arm()
            slot = self._slot_of[key]  # looked up: the launch order may change once (_agree_on_order)
            if self._launched[slot]:
                raise RuntimeError(
                    f"parameter {unit.names[index]!r} got a gradient after its bucket was reduce-scattered in this"
                    " backward: it is used where the ZeRO schedule cannot see it (a reentrant activation checkpoint"
                    " that also uses it outside, or a stage-3 parameter read outside its unit on some ranks only)"
                )
            if self._buffers[slot] is None:
                self._buffers[slot] = torch.zeros(bucket.numel, dtype=unit.grad_dtype, device=grad.device)
                self._count_live()
            self._buffers[slot][lo:hi].add_(grad.reshape(-1), alpha=scale)
            if self.stage == 2 and self._is_expected[slot][position]:
                self._arrived[slot] += 1
                self._launch_ready()

        return hook

    def _count_live(self) -> None:
        self.peak_live_buckets = max(self.peak_live_buckets, sum(b is not None for b in self._buffers))

    # --- stage 2 -------------------------------------------------------------------------------------
    def _expect(self) -> None:
        """When a backward starts: which gradients of each bucket can still come in it."""
        for slot, params in enumerate(self._params):
            flags = [
                id(p) in self._forward_used or torch._C._will_engine_execute_node(get_gradient_edge(p).node)
                for p in params
            ]
            self._is_expected[slot] = flags
            self._expected[slot] = sum(flags)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._arrived[self._next] >= self._expected[self._next]:
            self._launch(self._next)
            self._next += 1

    def _launch(self, slot: int) -> None:
        unit, bucket = self.order[slot]
        self._launched[slot] = True
        buffer = self._buffers[slot]
        if buffer is None:  # no gradient reached this bucket on this rank: it contributes zeros
            param = unit.flat_param
            buffer = self._buffers[slot] = torch.zeros(bucket.numel, dtype=unit.grad_dtype, device=param.device)
            self._count_live()
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

    def _agree_on_order(self) -> None:
        """Once, after the first backward: every rank adopts the launch order rank 0's forward implies."""
        first_use = [min((self._forward_used.get(id(p), -1) for p in params), default=-1) for params in self._params]
        mine = sorted(range(len(self.order)), key=lambda k: (-first_use[k], k))  # used last in forward: first
        order = torch.tensor(mine, dtype=torch.int64)
        collectives.broadcast(order, src=0, group=self.group)
        permutation = order.tolist()
        self.order = [self.order[k] for k in permutation]
        self._params = [self._params[k] for k in permutation]
        self._is_expected = [self._is_expected[k] for k in permutation]
        self._slot_of = {(id(u), b.start): k for k, (u, b) in enumerate(self.order)}
        self._order_agreed = True

    # --- stage 3 -------------------------------------------------------------------------------------
    def reduce_unit(self, unit: FlatUnit) -> None:
        """Stage 3: the schedule says ``unit``'s gradients are complete on every rank: reduce them."""
        if unit.grad_partition is None:
            return  # not trainable (evaluating)
        for bucket in unit.layout.buckets:
            slot = self._slot_of[(id(unit), bucket.start)]
            if not self._launched[slot]:
                self._launch(slot)

    # --- end of backward -----------------------------------------------------------------------------
    def finish_backward(self) -> None:
        """Launches every bucket not launched yet, in order, and waits for all of them."""
        for slot in range(len(self.order)):
            if not self._launched[slot]:
                self._launch(slot)
        while self._inflight:
            self._retire_oldest()
        self._next = 0
        self._launched = [False] * len(self.order)
        self._arrived = [0] * len(self.order)
        if not self._order_agreed:
            self._agree_on_order()
        self._forward_used.clear()

    # --- stage 1 -------------------------------------------------------------------------------------
    def reduce_accumulated(self, units: Sequence[FlatUnit], into: dict[int, Tensor] | None = None) -> None:
        """Stage 1: reduce-scatters the accumulated full gradients of ``units`` into each unit's
        ``reduced`` partition (or, given ``into``, into fresh tensors keyed by ``id(unit)``), in launch order."""
        wanted = {id(u) for u in units}
        targets = {}
        for unit in units:
            out = torch.empty(unit.layout.partition_numel, dtype=unit.flat_grad.dtype, device=unit.flat_grad.device)
            targets[id(unit)] = out
            if into is None:
                unit.reduced = out
            else:
                into[id(unit)] = out
        works = []
        for unit, bucket in self.order:
            if id(unit) not in wanted:
                continue
            buffer = unit.flat_grad[bucket.start : bucket.start + bucket.numel]
            out = targets[id(unit)][unit.partition_slice(bucket)]
            works.append(collectives.reduce_scatter(out, buffer, async_op=True, group=self.group))
        for work in works:
            collectives.wait(work)

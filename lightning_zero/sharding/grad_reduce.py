"""From a parameter's gradient hook to this rank's reduced gradient partition.

Each trainable parameter of every unit gets a post-accumulate-grad hook. The hook moves the fresh
gradient out of ``param.grad`` (freeing it) into gradient storage of its bucket and records that the
parameter was used. Stage 1 adds it into the unit's full flat gradient buffer: while micro-batches
accumulate (Lightning's ``block_backward_sync``, the ``accumulating`` flag) that is all; in the
backward of the step's last micro-batch each bucket region is reduce-scattered as soon as its
gradients are complete, added into the step's reduced partition and zeroed. Stages 2 and 3 add it
into a bucket buffer whose reduce-scatter (asynchronous when ``overlap`` is on) adds this rank's
chunk into the unit's gradient partition, every micro-batch. Stage 3's schedule decides when a unit's
bucket is reduced (``reduce_unit``, see stage3_schedule.py); stages 1 and 2 decide here.

[Note: stage-2 launch order]
Collectives are matched across ranks by issue order, so stages 1 and 2 launch buckets in one order that
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
A bucket buffer (stages 2 and 3) is taken from a pool and zeroed when its first gradient arrives, and
given back to the pool when its reduce-scatter has been waited on and added into the partition, so
buffers are allocated once and reused across micro-batches and steps. Each gradient is copied once,
into its bucket (scaled by 1/world_size on the way). Launched buckets are kept in flight up to
``max_inflight_bytes``; launching past it first retires the oldest. Together with the buckets still
filling, this bounds transient gradient memory to a few buckets instead of the full model.

[Note: stage-3 reduction buckets]
A stage-3 unit is one bucket (its all-gather is one collective), reduced when the schedule says its
gradients are complete on every rank. Units the schedule releases one after another are reduced
together until they hold ``coalesce_numel`` elements (``ZeroConfig.reduce_bucket_size``), as DeepSpeed's
stage 3 fills its reduction bucket: their buffers are copied side by side, rank-major (row r = every
unit's chunk r), into one pooled buffer, so one reduce-scatter delivers every unit's chunk r to rank r,
and the units' own buffers go back to the pool at once. A unit at least that large is reduced on its
own, from its own buffer (no copy). The end of backward reduces whatever is still waiting. Releases
follow the schedule, so every rank groups the same units in the same order.
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
from lightning_zero.sharding.offload import HostGradients, wait_for_copy


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
        max_inflight_bytes: int = 200_000_000,
        coalesce_numel: int = 0,
        group=None,
        host_world=None,
        average_over: int | None = None,
        two_level: dict | None = None,
    ) -> None:
        """``model``: stages 1 and 2 watch its modules' forwards (see [Note: stage-2 launch order]).
        ``coalesce_numel``: stage 3 (see [Note: stage-3 reduction buckets]). ``world_size``: the ranks of
        ``group``, which the layouts partition over; ``average_over``: the ranks gradients are averaged
        over (default: the same; with hybrid sharding all of them, the replicas' sum completing the average).
        ``two_level``: ZeRO++'s quantized gradients, the keyword arguments of
        ``collectives.reduce_scatter_two_level`` (every reduce-scatter then blocks)."""
        self.stage = stage
        self.overlap = overlap
        self.world_size = world_size
        self.average_over = average_over or world_size
        self.max_inflight_bytes = max_inflight_bytes if overlap else 0
        # Stage 1: whether a backward only accumulates (set by the strategy: always under manual optimization,
        # else inside Lightning's block_backward_sync, i.e. before the step's last micro-batch).
        self.accumulating = False
        self.stage1_unreduced = False  # stage 1: a backward accumulated gradients no reduction has consumed yet
        self.backward_end = backward_end
        self.group = group
        self.two_level = two_level
        self.host_world = host_world  # the world's group for host tensors (topology.py)
        self.peak_live_buckets = 0  # most bucket buffers alive at once (filling or in flight)
        self.buffers_allocated = 0  # bucket buffers ever allocated (the pool reuses them)

        self.order: list[tuple[FlatUnit, Bucket]] = []  # launch order; see [Note: stage-2 launch order]
        self._params: list[list[Parameter]] = []
        self._launched: list[bool] = []
        self._buffers: list[Tensor | None] = []
        self._arrived: list[int] = []  # expected gradients that arrived in this backward
        self._expected: list[int] = []
        self._is_expected: list[list[bool]] = []
        self._next = 0  # first bucket in launch order not launched yet in this backward
        # slots, buffer, its bytes counted against max_inflight_bytes, work
        self._inflight: deque[tuple[list[int], Tensor, int, dist.Work | None]] = deque()
        self.coalesce_numel = coalesce_numel
        self._to_host = HostGradients()  # offloaded units' partitions (a plain add for the others)
        self._coalescing: list[int] = []  # stage 3: released slots waiting to fill a reduction bucket
        self._inflight_bytes = 0
        self._pool: dict[tuple, list[Tensor]] = {}  # free bucket buffers by (numel, dtype, device)
        self._copying: dict[int, object] = {}  # id(buffer) -> the event of its copy to the host (offload, CUDA)
        self.check_param_read = None  # stages 1 and 2: set by ParamGathers (see param_gather.py)
        self._handles = []
        self.units = []
        self.add_units(units, model_position)
        self._forward_used: dict[int, int] = {}  # id(param) -> order of first use in this forward (stage 2)
        self._order_agreed = stage == 3 or world_size == 1
        if stage <= 2:
            self._watch_forwards(model)
            backward_end.on_begin.append(self._expect)
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
            if torch.compiler.is_compiling():  # a compiled module's forward: traced as nothing (no graph break,
                return  # no guard on these parameters); backward then expects what autograd will run (_expect)
            for p in params:
                self._forward_used.setdefault(id(p), len(self._forward_used))

        return hook

    def _make_hook(self, unit: FlatUnit, index: int):
        bucket = unit.layout.buckets[unit.layout.param_bucket[index]]
        key = (id(unit), bucket.start)
        position = index - bucket.first_param
        lo = unit.layout.offsets[index] - bucket.start
        hi = lo + unit.layout.numels[index]

        # Gradients are averaged over ranks: each is divided by the number of ranks on its way into the bucket
        # (as DDP pre-divides, so fp16 sums stay in range), and the reduce-scatter (and with hybrid sharding,
        # the replicas' all-reduce) sums.
        scale = 1.0 / self.average_over

        def hook(param: Tensor) -> None:
            grad = param.grad
            param.grad = None
            if unit.step_grad is not None:  # (the same on every rank: the same program runs everywhere)
                raise RuntimeError(
                    f"parameter {unit.names[index]!r} got a gradient after this step's gradients were reduced for"
                    " the optimizer (by clip_gradients, or the optimizer's grad_norm/step preparation): call every"
                    " backward of a step before clipping and stepping"
                )
            unit.used[index] = 1
            self.backward_end.arm()
            if self.check_param_read is not None:
                self.check_param_read(unit, bucket, index)
            if self.stage == 1 and self.accumulating:
                unit.flat_grad[bucket.start + lo : bucket.start + hi].add_(grad.reshape(-1), alpha=scale)
                unit.flat_grad_dirty = True
                return
            slot = self._slot_of[key]  # looked up: the launch order may change once (_agree_on_order)
            if self._launched[slot]:
                raise RuntimeError(
                    f"parameter {unit.names[index]!r} got a gradient after its bucket was reduce-scattered in this"
                    " backward, which had already passed every use of it the ZeRO schedule saw: it is also used where"
                    " the schedule cannot see it (a stage-3 parameter read outside its unit on some ranks only, or a"
                    " parameter used both inside a reentrant activation checkpoint and outside it)"
                )
            if self._buffers[slot] is None:
                self._buffers[slot] = self._take_buffer(unit, bucket)
            self._buffers[slot][lo:hi].add_(grad.reshape(-1), alpha=scale)
            unit.flat_grad_dirty = unit.flat_grad is not None
            if self.stage <= 2 and self._is_expected[slot][position]:
                self._arrived[slot] += 1
                self._launch_ready()

        return hook

    def _take_buffer(self, unit: FlatUnit, bucket: Bucket) -> Tensor:
        """Where ``bucket``'s gradients go: stage 1's region of the flat gradient (holding what accumulated),
        else a zeroed buffer from the pool."""
        if unit.flat_grad is not None:
            return unit.flat_grad[bucket.start : bucket.start + bucket.numel]
        self.peak_live_buckets = max(self.peak_live_buckets, 1 + sum(b is not None for b in self._buffers))
        return self._pooled(bucket.numel, unit.grad_dtype, unit.flat_param.device).zero_()

    def _pooled(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        free = self._pool.setdefault((numel, dtype, device), [])
        if not free:
            free.append(torch.empty(numel, dtype=dtype, device=device))
            self.buffers_allocated += 1
        buffer = free.pop()
        wait_for_copy(buffer, self._copying.pop(id(buffer), None))
        return buffer

    def _give_back(self, unit: FlatUnit, slot: int) -> None:
        """Stage 1 zeroes the bucket's region of the flat gradient (consumed); other stages pool the buffer."""
        buffer = self._buffers[slot]
        self._buffers[slot] = None
        if unit.flat_grad is not None:
            wait_for_copy(buffer, self._copying.pop(id(buffer), None))
            buffer.zero_()
        else:
            self._pool[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)

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
        if self.stage == 1 and self.accumulating:
            return
        while self._next < len(self.order) and self._arrived[self._next] >= self._expected[self._next]:
            self._launch(self._next)
            self._next += 1

    def _launch(self, slot: int) -> None:
        unit, bucket = self.order[slot]
        self._launched[slot] = True
        if self._buffers[slot] is None:  # stage 1, or no gradient reached this bucket on this rank: zeros
            self._buffers[slot] = self._take_buffer(unit, bucket)
        self._start([slot], self._buffers[slot], counted=unit.flat_grad is None)  # stage 1's regions persist

    def _launch_together(self, slots: list[int]) -> None:
        """Stage 3: one reduce-scatter for several units' buckets (see [Note: stage-3 reduction buckets])."""
        unit = self.order[slots[0]][0]
        total = sum(self.order[s][1].numel for s in slots)
        combined = self._pooled(total, unit.grad_dtype, unit.flat_param.device)
        rows = combined.view(self.world_size, -1)
        column = 0
        for slot in slots:
            chunk = self.order[slot][1].chunk_numel
            if self._buffers[slot] is None:
                rows[:, column : column + chunk].zero_()
            else:
                rows[:, column : column + chunk].copy_(self._buffers[slot].view(self.world_size, chunk))
                self._give_back(self.order[slot][0], slot)
            column += chunk
        self._start(slots, combined, counted=True)

    def _start(self, slots: list[int], buffer: Tensor, *, counted: bool) -> None:
        """Reduce-scatters ``buffer`` (rank-major: row r goes to rank r), keeping in flight at most
        ``max_inflight_bytes`` of it and earlier launches."""
        own = buffer.view(self.world_size, -1)[self.order[slots[0]][0].rank]
        work = self._reduce_scatter(own, buffer, async_op=self.overlap)
        counted_bytes = buffer.nbytes if counted else 0
        self._inflight.append((slots, buffer, counted_bytes, work))
        self._inflight_bytes += counted_bytes
        while len(self._inflight) > 1 and self._inflight_bytes > self.max_inflight_bytes:
            self._retire_oldest()

    def _reduce_scatter(self, output: Tensor, input: Tensor, *, async_op: bool) -> object:
        if self.two_level is None:
            return collectives.reduce_scatter(output, input, async_op=async_op, group=self.group)
        collectives.reduce_scatter_two_level(output, input, **self.two_level)
        return None

    def _retire_oldest(self) -> None:
        slots, buffer, counted_bytes, work = self._inflight.popleft()
        collectives.wait(work)
        self._inflight_bytes -= counted_bytes
        own = buffer.view(self.world_size, -1)[self.order[slots[0]][0].rank]
        column, copied = 0, None
        for slot in slots:
            unit, bucket = self.order[slot]
            if unit.flat_grad is not None and unit.reduced is None:  # stage 1: the step's reduced partition
                unit.reduced = unit.new_reduced()
            chunk = own[column : column + bucket.chunk_numel]
            copied = self._to_host.add(unit.reduced[unit.partition_slice(bucket)], chunk) or copied
            column += bucket.chunk_numel
        if copied is not None:  # (offload on CUDA) the buffer's next user waits for the copy
            self._copying[id(buffer)] = copied
        if len(slots) == 1:  # the slot's own buffer
            self._give_back(unit, slots[0])
        else:  # a combined buffer (the slots' own went back at launch)
            self._pool[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)

    def _agree_on_order(self) -> None:
        """Once, after the first backward: every rank adopts the launch order rank 0's forward implies (over
        the whole world, so that with hybrid sharding every shard group issues the same sequence; a CPU
        tensor, so on the host group)."""
        first_use = [min((self._forward_used.get(id(p), -1) for p in params), default=-1) for params in self._params]
        mine = sorted(range(len(self.order)), key=lambda k: (-first_use[k], k))  # used last in forward: first
        order = torch.tensor(mine, dtype=torch.int64)
        collectives.broadcast(order, src=0, group=self.host_world)
        permutation = order.tolist()
        self.order = [self.order[k] for k in permutation]
        self._params = [self._params[k] for k in permutation]
        self._is_expected = [self._is_expected[k] for k in permutation]
        self._slot_of = {(id(u), b.start): k for k, (u, b) in enumerate(self.order)}
        self._order_agreed = True

    # --- stage 3 -------------------------------------------------------------------------------------
    def reduce_unit(self, unit: FlatUnit) -> None:
        """Stage 3: the schedule says ``unit``'s gradients are complete on every rank: reduce them (together
        with the units released before it, see [Note: stage-3 reduction buckets])."""
        if not unit.trainable:
            return  # evaluating
        for bucket in unit.layout.buckets:
            slot = self._slot_of[(id(unit), bucket.start)]
            if self._launched[slot]:
                continue
            if bucket.numel >= self.coalesce_numel:
                self._flush_coalescing()  # (units released before it go first)
                self._launch(slot)
                continue
            first = self.order[self._coalescing[0]][0] if self._coalescing else unit
            if (first.grad_dtype, first.flat_param.device) != (unit.grad_dtype, unit.flat_param.device):
                self._flush_coalescing()
            self._launched[slot] = True  # a gradient arriving after this is an error, as after a launch
            self._coalescing.append(slot)
            if sum(self.order[s][1].numel for s in self._coalescing) >= self.coalesce_numel:
                self._flush_coalescing()

    def _flush_coalescing(self) -> None:
        slots, self._coalescing = self._coalescing, []
        if len(slots) == 1:
            self._launch(slots[0])
        elif slots:
            self._launch_together(slots)

    # --- end of backward -----------------------------------------------------------------------------
    def finish_backward(self) -> None:
        """Launches every bucket not launched yet, in order, and waits for all of them (stage 1 only in
        the step's last micro-batch: before it, gradients just accumulate)."""
        if self.stage == 1 and self.accumulating:
            self.stage1_unreduced = True
        else:
            self.reduce_pending()  # (an accumulating stage-1 backward launches nothing)
        self._next = 0
        self._arrived = [0] * len(self.order)
        if not self._order_agreed:
            self._agree_on_order()
        self._forward_used.clear()

    def reduce_pending(self) -> None:
        """Launches, in order, every bucket not launched in this backward and waits for all of them."""
        self._flush_coalescing()
        for slot in range(len(self.order)):
            if not self._launched[slot]:
                self._launch(slot)
        while self._inflight:
            self._retire_oldest()
        self._to_host.drain()
        self._launched = [False] * len(self.order)
        self.stage1_unreduced = False
        for unit in self.units:
            unit.flat_grad_dirty = False  # stage 1: every region was reduced and zeroed

    # --- stage 1 -------------------------------------------------------------------------------------
    def peek_accumulated(self, units: Sequence[FlatUnit]) -> dict[int, Tensor]:
        """Stage 1 between micro-batches: the reduced partition the gradients accumulated so far would give,
        keyed by ``id(unit)``, from copies (the accumulation itself goes on untouched)."""
        out = {}
        works = []
        for unit, bucket in self.order:
            if unit not in units:
                continue
            if id(unit) not in out:
                out[id(unit)] = unit.flat_grad.new_empty(unit.layout.partition_numel)
            scratch = unit.flat_grad[bucket.start : bucket.start + bucket.numel].clone()
            target = out[id(unit)][unit.partition_slice(bucket)]
            works.append(self._reduce_scatter(target, scratch, async_op=True))
        for work in works:
            collectives.wait(work)
        return out

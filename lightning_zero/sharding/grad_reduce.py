"""From a parameter's gradient hook to this rank's reduced gradient partition.

Each trainable parameter of every unit gets a post-accumulate-grad hook. The hook moves the fresh
gradient out of ``param.grad`` (freeing it) into gradient storage of its bucket (grad_buckets.py) and
records that the parameter was used. Stage 1 adds it into the unit's full flat gradient buffer: while
micro-batches accumulate (inside ``no_sync``, the step state's; or always, for a front door that does not
mark micro-batches) that is all; in the backward of the step's last micro-batch each bucket region is
reduce-scattered as soon as its gradients are complete, added into the step's reduced partition and
zeroed. Stages 2 and 3 add it into a bucket buffer whose reduce-scatter (asynchronous when ``overlap`` is
on) adds this rank's chunk into the unit's gradient partition, every micro-batch. When a bucket is
launched is its launch policy's (launch_policy.py): stages 1 and 2 in one agreed order as buckets fill
(``OrderedLaunch``), stage 3 as its schedule releases units (``ScheduledLaunch``, via ``reduce_unit``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, Parameter

from lightning_zero.sharding import collectives
from lightning_zero.sharding.backward_end import BackwardEnd, BackwardWork
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.grad_buckets import BucketPool, BucketSlot
from lightning_zero.sharding.launch_policy import OrderedLaunch, ScheduledLaunch
from lightning_zero.sharding.layout import Bucket
from lightning_zero.sharding.offload import HostGradients
from lightning_zero.sharding.param_gather import ParamGathers
from lightning_zero.sharding.step_state import StepState


@dataclass(frozen=True)
class ReduceSettings:
    """How a reducer's gradients travel. ``world_size``: the ranks of ``group``, which the layouts partition over;
    ``average_over``: the ranks gradients are averaged over (default: the same; with hybrid sharding all of them,
    the replicas' sum completing the average). ``overlap``: reduce-scatters run asynchronously, up to
    ``max_inflight_bytes`` in flight. ``coalesce_numel``: stage 3 (launch_policy.py). ``host_world``: the world's
    group for host tensors (topology.py). ``two_level``: ZeRO++'s quantized gradients, the keyword arguments of
    ``collectives.reduce_scatter_two_level`` (every reduce-scatter then blocks)."""

    stage: int
    world_size: int
    overlap: bool = False
    max_inflight_bytes: int = 200_000_000
    coalesce_numel: int = 0
    group: Any = None
    host_world: Any = None
    average_over: int | None = None
    two_level: dict | None = None


class GradReducer:
    """Reduces the gradients of the units' parameters into this rank's gradient partitions, bucket by bucket, from
    each parameter's gradient hook (see the module docstring).

    Args:
        units: the trainable units whose gradients it reduces (more join with ``add_units``).
        model_position: each parameter's position in the model; buckets whose parameters come later launch first.
        settings: how the gradients travel (``ReduceSettings``).
    """

    def __init__(
        self,
        units: Sequence[FlatUnit],
        model_position: dict[Parameter, int],
        settings: ReduceSettings,
        *,
        step: StepState,
        backward_end: BackwardEnd,
        model: Module | None = None,
        marks_micro_batches: bool = True,
        gathers: ParamGathers | None = None,
    ) -> None:
        """``step``: the engine's step state (whether a micro-batch is inside ``no_sync``). ``model``: stages 1
        and 2 watch its modules' forwards (launch_policy.py). ``marks_micro_batches``: the front door enters
        ``no_sync`` for the micro-batches before a step's last (else stage 1 cannot know which backward is a
        step's last, and reduces at the step). ``gathers``: stages 1 and 2's post-step gathers, which a
        gradient checks its parameter was waited for (param_gather.py)."""
        self.step, self.stage, self.overlap, self.world_size = (
            step,
            settings.stage,
            settings.overlap,
            settings.world_size,
        )
        self.marks_micro_batches, self.gathers = marks_micro_batches, gathers
        self.average_over = settings.average_over or settings.world_size
        self.max_inflight_bytes = settings.max_inflight_bytes if settings.overlap else 0
        self.backward_end, self.group, self.two_level = backward_end, settings.group, settings.two_level
        self.peak_live_buckets = 0  # most bucket buffers alive at once (filling or in flight)
        self.pool = BucketPool()
        self.slots: list[BucketSlot] = []  # in launch order
        self._slot_of: dict[tuple[int, int], BucketSlot] = {}
        # slots, buffer, its bytes counted against max_inflight_bytes, work
        self._inflight: deque[tuple[list[BucketSlot], Tensor, int, dist.Work | None]] = deque()
        self._inflight_bytes = 0
        self._to_host = HostGradients()  # offloaded units' partitions (a plain add for the others)
        self._handles = []
        self.units: list[FlatUnit] = []
        if self.stage == 3:
            coalesce = settings.coalesce_numel
            self.launch = ScheduledLaunch(self._launch, self._launch_together, coalesce_numel=coalesce)
        else:
            owned = {id(p) for u in units for p in u.params}
            agreed, host_world = self.world_size == 1, settings.host_world
            self.launch = OrderedLaunch(self._launch, model=model, owned=owned, agreed=agreed, host_world=host_world)
        self.add_units(units, model_position)
        work = {"begin": self._begin_backward, "end": self.finish_backward, "raised": self.abandon_backward}
        backward_end.register(BackwardWork.REDUCTION, **work)

    @property
    def order(self) -> list[tuple[FlatUnit, Bucket]]:
        """The launch order (stages 1 and 2: the post-step gathers go in its reverse)."""
        return [(slot.unit, slot.bucket) for slot in self.slots]

    def add_units(self, units: Sequence[FlatUnit], model_position: dict[Parameter, int] | None = None) -> None:
        """Starts reducing the gradients of ``units`` (at set-up, or when parameters are unfrozen): their
        buckets come after the existing ones in the launch order, on every rank alike."""
        position = model_position or {}
        slots = [BucketSlot.of(u, b) for u in units for b in u.layout.buckets]
        slots.sort(key=lambda slot: -min(position.get(p, 0) for p in slot.params))
        self.units += list(units)
        self.slots += slots
        self._slot_of.update((slot.key, slot) for slot in slots)
        self._handles += [
            p.register_post_accumulate_grad_hook(self._make_hook(u, i)) for u in units for i, p in enumerate(u.params)
        ]

    def remove_hooks(self) -> None:
        """Removes its gradient hooks, its launch policy's hooks and its backward callbacks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.launch.remove_hooks()
        self.backward_end.unregister(self._begin_backward, self.finish_backward, self.abandon_backward)

    def defers_reduction(self) -> bool:
        """Stage 1: this backward only accumulates (a micro-batch before the step's last)."""
        return self.stage == 1 and (self.step.in_no_sync or not self.marks_micro_batches)

    def _make_hook(self, unit: FlatUnit, index: int):
        bucket = unit.layout.buckets[unit.layout.param_bucket[index]]
        key, training = (id(unit), bucket.start), unit.training
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
            if training.taken_by_step:  # (the same on every rank: the same program runs everywhere)
                raise RuntimeError(
                    f"parameter {unit.names[index]!r} got a gradient after this step's gradients were reduced for"
                    " the optimizer (by clip_gradients, or the optimizer's grad_norm/step preparation): call every"
                    " backward of a step before clipping and stepping"
                )
            training.mark_used(index)
            self.backward_end.arm()
            if self.gathers is not None:
                self.gathers.check_read(unit, bucket, index)
            if self.defers_reduction():
                training.flat_grad[bucket.start + lo : bucket.start + hi].add_(grad.reshape(-1), alpha=scale)
                return
            slot = self._slot_of[key]
            if slot.launched:
                raise RuntimeError(
                    f"parameter {unit.names[index]!r} got a gradient after its bucket was reduce-scattered in this"
                    " backward, which had already passed every use of it the ZeRO schedule saw: it is also used where"
                    " the schedule cannot see it (a stage-3 parameter read outside its unit on some ranks only, or a"
                    " parameter used both inside a reentrant activation checkpoint and outside it)"
                )
            buffer = slot.buffer if slot.buffer is not None else slot.use_buffer(self._take_buffer(slot))
            buffer[lo:hi].add_(grad.reshape(-1), alpha=scale)
            self.launch.arrived(slot, position, self.slots)

        return hook

    def _take_buffer(self, slot: BucketSlot) -> Tensor:
        """Where ``slot``'s gradients go: stage 1's region of the flat gradient (holding what accumulated),
        else a zeroed buffer from the pool."""
        unit, bucket = slot.unit, slot.bucket
        if slot.full_gradient:
            return unit.training.flat_grad[bucket.start : bucket.start + bucket.numel]
        self.peak_live_buckets = max(self.peak_live_buckets, 1 + sum(s.buffer is not None for s in self.slots))
        return self.pool.take(bucket.numel, unit.training.grad_dtype, unit.flat_param.device).zero_()

    def _give_back(self, slot: BucketSlot) -> None:
        """Stage 1 zeroes the bucket's region of the flat gradient (consumed); other stages pool the buffer."""
        buffer = slot.take_buffer()
        if slot.full_gradient:
            self.pool.wait_for_copy(buffer)
            buffer.zero_()
        else:
            self.pool.give_back(buffer)

    # --- launching and retiring reduce-scatters -----------------------------------------------------
    def _launch(self, slot: BucketSlot) -> None:
        slot.mark_launched()
        buffer = slot.buffer if slot.buffer is not None else slot.use_buffer(self._take_buffer(slot))
        self._start([slot], buffer, counted=not slot.full_gradient)  # stage 1's regions persist

    def _launch_together(self, slots: list[BucketSlot]) -> None:
        """Stage 3: one reduce-scatter for several units' buckets (see [Note: stage-3 reduction buckets])."""
        unit = slots[0].unit
        total = sum(slot.bucket.numel for slot in slots)
        combined = self.pool.take(total, unit.training.grad_dtype, unit.flat_param.device)
        rows = combined.view(self.world_size, -1)
        column = 0
        for slot in slots:
            chunk = slot.bucket.chunk_numel
            if slot.buffer is None:
                rows[:, column : column + chunk].zero_()
            else:
                rows[:, column : column + chunk].copy_(slot.buffer.view(self.world_size, chunk))
                self._give_back(slot)
            column += chunk
        self._start(slots, combined, counted=True)

    def _start(self, slots: list[BucketSlot], buffer: Tensor, *, counted: bool) -> None:
        """Reduce-scatters ``buffer`` (rank-major: row r goes to rank r), keeping in flight at most
        ``max_inflight_bytes`` of it and earlier launches."""
        own = buffer.view(self.world_size, -1)[slots[0].unit.rank]
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
        own = buffer.view(self.world_size, -1)[slots[0].unit.rank]
        column, copied = 0, None
        for slot in slots:
            unit, bucket = slot.unit, slot.bucket
            chunk = own[column : column + bucket.chunk_numel]
            target = unit.training.reduced_partition()[unit.partition_slice(bucket)]
            copied = self._to_host.add(target, chunk) or copied
            column += bucket.chunk_numel
        if copied is not None:  # (offload on CUDA) the buffer's next user waits for the copy
            self.pool.copying(buffer, copied)
        if len(slots) == 1:  # the slot's own buffer
            self._give_back(slots[0])
        else:  # a combined buffer (the slots' own went back at launch)
            self.pool.give_back(buffer)

    # --- stage 3 -------------------------------------------------------------------------------------
    def reduce_unit(self, unit: FlatUnit) -> None:
        """Stage 3: the schedule says ``unit``'s gradients are complete on every rank: reduce them (together
        with the units released before it, see [Note: stage-3 reduction buckets])."""
        if unit.trainable:  # (else evaluating)
            self.launch.release([self._slot_of[(id(unit), bucket.start)] for bucket in unit.layout.buckets])

    # --- a backward's start and end ------------------------------------------------------------------
    def _begin_backward(self) -> None:
        for unit in self.units:
            unit.training.begin_backward()
        if not self.defers_reduction():
            self.launch.expect(self.slots)

    def finish_backward(self) -> None:
        """Launches every bucket not launched yet, in order, and waits for all of them (stage 1 only in
        the step's last micro-batch: before it, gradients just accumulate)."""
        if self.defers_reduction():
            for unit in self.units:
                unit.training.end_accumulating_backward()
        else:
            self.reduce_pending()
        for slot in self.slots:
            slot.end_backward()
        self.slots = self.launch.end_backward(self.slots)

    def reduce_pending(self) -> None:
        """Launches, in order, every bucket not launched in this backward and waits for all of them."""
        self.launch.flush()
        for slot in self.slots:
            if not slot.launched:
                self._launch(slot)
        while self._inflight:
            self._retire_oldest()
        self._to_host.drain()
        for slot in self.slots:
            slot.end_reduction()
        for unit in self.units:
            unit.training.reductions_done()  # (stage 1: every region was reduced and zeroed)

    def abandon_backward(self) -> None:
        """A backward raised before its end (every rank alike: the same program ran there): the reduce-scatters it
        started are waited for and kept, as ddp keeps what a failed backward accumulated until ``zero_grad``; the
        gradients of buckets it never launched are dropped, and the next backward starts afresh. No collective."""
        self.launch.abandon()
        while self._inflight:
            self._retire_oldest()
        self._to_host.drain()
        for slot in self.slots:
            buffer = slot.take_buffer()
            if buffer is not None and not slot.full_gradient:  # (stage 1's region stays: zero_grad zeroes it)
                self.pool.give_back(buffer)
            slot.end_reduction()
            slot.end_backward()

    # --- stage 1 -------------------------------------------------------------------------------------
    def peek_accumulated(self, units: Sequence[FlatUnit]) -> dict[int, Tensor]:
        """Stage 1 between micro-batches: the reduced partition the gradients accumulated so far would give,
        keyed by ``id(unit)``, from copies (the accumulation itself goes on untouched)."""
        out = {}
        works = []
        for slot in self.slots:
            unit, bucket = slot.unit, slot.bucket
            if unit not in units:
                continue
            flat_grad = unit.training.flat_grad
            if id(unit) not in out:
                out[id(unit)] = flat_grad.new_empty(unit.layout.partition_numel)
            scratch = flat_grad[bucket.start : bucket.start + bucket.numel].clone()
            target = out[id(unit)][unit.partition_slice(bucket)]
            works.append(self._reduce_scatter(target, scratch, async_op=True))
        for work in works:
            collectives.wait(work)
        return out

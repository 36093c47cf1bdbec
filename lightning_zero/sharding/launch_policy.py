"""When the gradient reducer launches a bucket's reduce-scatter: two policies, one per kind of stage.

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

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn import Module

from lightning_zero.sharding import collectives
from lightning_zero.sharding.grad_buckets import BucketSlot


class OrderedLaunch:
    """Stages 1 and 2: buckets launch in one agreed order, each as soon as it and those before it are ready."""

    def __init__(
        self, launch: Callable[[BucketSlot], None], *, model: Module | None, owned: set[int], agreed: bool, host_world
    ) -> None:
        """``launch``: the reducer's. ``owned``: ids of the parameters reduced (their modules' forwards are
        watched). ``agreed``: the order needs no agreement (one rank)."""
        self._launch = launch
        self._next = 0  # first slot in launch order not launched yet in this backward
        self._forward_used: dict[int, int] = {}  # id(param) -> order of first use in this forward
        self._agreed = agreed
        self._host_world = host_world
        self._handles = []
        for module in model.modules() if model is not None else ():
            params = [p for p in module._parameters.values() if p is not None and id(p) in owned]
            if params:
                self._handles.append(module.register_forward_pre_hook(self._forward_hook(params)))

    def _forward_hook(self, params: list):
        def hook(module: Module, args) -> None:
            if torch.compiler.is_compiling():  # a compiled module's forward: traced as nothing (no graph break,
                return  # no guard on these parameters); backward then expects what autograd will run (expect)
            for p in params:
                self._forward_used.setdefault(id(p), len(self._forward_used))

        return hook

    def expect(self, slots: Sequence[BucketSlot]) -> None:
        """When a backward that reduces starts: which gradients of each bucket can still come in it."""
        for slot in slots:
            slot.expect(
                [
                    id(p) in self._forward_used or torch._C._will_engine_execute_node(get_gradient_edge(p).node)
                    for p in slot.params
                ]
            )
        self.launch_ready(slots)

    def arrived(self, slot: BucketSlot, position: int, slots: Sequence[BucketSlot]) -> None:
        """A gradient of ``slot``'s parameter ``position`` arrived: launches the buckets now ready, in order."""
        if slot.arrive(position):
            self.launch_ready(slots)

    def launch_ready(self, slots: Sequence[BucketSlot]) -> None:
        """Launches the buckets from the next one on in ``slots``' order, as long as each is ready."""
        while self._next < len(slots) and slots[self._next].ready():
            self._launch(slots[self._next])
            self._next += 1

    def flush(self) -> None:
        """Nothing to do: every bucket launches on its own once ready."""
        pass  # (every bucket launches on its own)

    def abandon(self) -> None:
        """The backward raised: the next one starts from the first bucket (the agreed order stays)."""
        self._next = 0
        self._forward_used.clear()

    def end_backward(self, slots: list[BucketSlot]) -> list[BucketSlot]:
        """The backward ended: the launch order from now on (after the first backward, rank 0's)."""
        self._next = 0
        if not self._agreed:
            slots = self._agree_on_order(slots)
        self._forward_used.clear()
        return slots

    def _agree_on_order(self, slots: list[BucketSlot]) -> list[BucketSlot]:
        """Every rank adopts the order rank 0's forward implies (over the whole world, so that with hybrid
        sharding every shard group issues the same sequence; a CPU tensor, so on the host group)."""
        first_use = [min((self._forward_used.get(id(p), -1) for p in slot.params), default=-1) for slot in slots]
        mine = sorted(range(len(slots)), key=lambda k: (-first_use[k], k))  # used last in forward: first
        order = torch.tensor(mine, dtype=torch.int64)
        collectives.broadcast(order, src=0, group=self._host_world)
        self._agreed = True
        return [slots[k] for k in order.tolist()]

    def remove_hooks(self) -> None:
        """Removes the forward hooks that watch the modules."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class ScheduledLaunch:
    """Stage 3: a unit's bucket launches when the schedule releases it, coalesced with the units released
    before it (see [Note: stage-3 reduction buckets])."""

    def __init__(
        self,
        launch: Callable[[BucketSlot], None],
        launch_together: Callable[[list[BucketSlot]], None],
        *,
        coalesce_numel: int,
    ) -> None:
        self._launch, self._launch_together = launch, launch_together
        self.coalesce_numel = coalesce_numel
        self._coalescing: list[BucketSlot] = []  # released slots waiting to fill a reduction bucket

    def expect(self, slots: Sequence[BucketSlot]) -> None:
        """Nothing to do: the schedule knows when a unit's gradients are complete."""
        pass  # (the schedule knows when a unit is complete)

    def arrived(self, slot: BucketSlot, position: int, slots: Sequence[BucketSlot]) -> None:
        """Nothing to do: a gradient's arrival launches nothing (``release`` does)."""
        pass

    def release(self, slots: Sequence[BucketSlot]) -> None:
        """The schedule says these slots' gradients are complete on every rank."""
        for slot in slots:
            if slot.launched:
                continue
            if slot.bucket.numel >= self.coalesce_numel:
                self.flush()  # (units released before it go first)
                self._launch(slot)
                continue
            first = self._coalescing[0].unit if self._coalescing else slot.unit
            kind = (first.training.grad_dtype, first.flat_param.device)
            if kind != (slot.unit.training.grad_dtype, slot.unit.flat_param.device):
                self.flush()
            slot.mark_launched()  # a gradient arriving after this is an error, as after a launch
            self._coalescing.append(slot)
            if sum(s.bucket.numel for s in self._coalescing) >= self.coalesce_numel:
                self.flush()

    def flush(self) -> None:
        """Launches the released slots waiting to fill a reduction bucket, together (or alone, if one)."""
        slots, self._coalescing = self._coalescing, []
        if len(slots) == 1:
            self._launch(slots[0])
        elif slots:
            self._launch_together(slots)

    def end_backward(self, slots: list[BucketSlot]) -> list[BucketSlot]:
        """The backward ended: the launch order stays ``slots``."""
        return slots

    def abandon(self) -> None:
        """The backward raised: forgets the released slots not launched yet."""
        self._coalescing = []  # (released, never launched: the reducer drops their gradients)

    def remove_hooks(self) -> None:
        """Nothing to do: it registers no hooks."""
        pass

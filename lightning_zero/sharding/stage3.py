"""Stage 3 at run time: each unit's parameters exist in full only around the code that uses them.

Every rank keeps only its shard of every unit (``FlatUnit.param_shard``). Module hooks report the events of a step (a
unit's forward starts or ends, the first gradient reaches a unit's outputs, a parameter is read outside its unit,
backward ends) to the ``Schedule`` of stage3_schedule.py, which decides from them alone which unit to gather, free or
reduce, identically on every rank (see [Note: one schedule on every rank] there); this module carries them out.

[Note: what a freed parameter looks like]
While its unit is freed, the flat buffer has no storage and a parameter's ``.data`` is one NaN expanded to the
parameter's shape (stride 0), and its class a ``ShardedParameter``: code that looks at shapes (param groups by
``p.dim()``, parameter counts) works as on the whole model, and code that reads its values gathers it inside a step or
gets one clear error elsewhere (sharded_param.py's [Note: reading a sharded parameter]); never NaN, stale or plausible
numbers. Autograd holds the parameter objects and views of the flat buffer, whose storage is the same object again
(resized) once the schedule gathers the unit for its backward.

[Note: when a unit is gathered]
- the root unit (parameters of no unit module, e.g. tied embeddings) from ``begin_step`` to ``end_step``;
- a unit no larger than ``param_persistence_threshold`` for the whole run;
- any other unit from its forward until the schedule's next entry, and in backward from the first
  gradient reaching its outputs (or its recomputation by activation checkpointing) until backward
  moves past it; a unit whose parameter is read outside its own forward, until the step ends.
Prefetching never takes more than ``max_live_parameters`` elements of gathered units (the root and
persistent units not counted); a unit that is about to run is gathered regardless.

[Note: a secondary partition]
With ``ZeroConfig(secondary_partition=True)`` (ZeRO++'s hpZ) a unit gathered for a training forward (from the shards of
every rank, across nodes) leaves each rank a copy of its 1/K of the whole unit, K being the ranks of its node
(``FlatUnit.secondary``), and the unit's later gathers in the same step (its backward, a recomputation) all-gather those
parts inside the node: the same values the forward computed with, so it is exact, and only the forward's gathers cross
nodes. Whether a gather keeps a part or reads one follows from the schedule's events, the same on every rank; the parts
are dropped when the step ends and whenever the shards change (a step of the optimizer, a write). Each rank holds up to
Psi/K elements of them between a forward and its backward.

[Note: compiled models]
The module hooks run eagerly (``torch._dynamo.disable``): a unit compiled with ``torch.compile`` breaks its
graph at them (or they run outside it), and its graphs never hold the schedule's state (which changes every
step and would fail their guards, recompiling each step until Dynamo gives up and falls back to eager).
Attribute access inside a compiled graph is traced as a plain read, with no hook: the unit's forward hook has
gathered it already, and a parameter read outside its unit that is not whole when the graph runs fails the
graph's guards (a placeholder's class and strides differ), so that call runs eagerly, through the hook.
Between the hooks a unit is whole, with its parameters' own class, so each graph is traced once per shape.

[Note: uneven inputs]
Validation, test and predict loops can give ranks different numbers of batches (Lightning's predict
sampler does not pad). A rank that has run out keeps issuing what the others' forwards issue until
all are done, like torch's ``Join``: before each forward-only step every rank all-reduces whether it
still has a batch; a rank without one replays the collectives of its own last step (``shadow_step``): its
gathers, and the agreements of ``gathered_parameters`` on whether a rank wrote (param_writes.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from lightning_zero.sharding import param_writes
from lightning_zero.sharding.backward_end import BackwardEnd, BackwardWork, in_backward
from lightning_zero.sharding.flat_unit import FlatUnit, unshard_together
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.sharded_param import ShardedParameter, original_class, read_error
from lightning_zero.sharding.stage3_access import GatherOnAccess, output_tensors
from lightning_zero.sharding.stage3_schedule import Schedule
from lightning_zero.sharding.step_state import StepState


class Stage3Runtime:
    """Carries out stage 3's schedule for ``units``: gathers, frees and reduces them from module hooks (see above)."""

    def __init__(
        self,
        units: Sequence[FlatUnit],
        modules: Sequence[Module | None],
        *,
        max_live_parameters: int,
        prefetch_bucket_size: int | None = None,
        param_persistence_threshold: int,
        backward_end: BackwardEnd,
        step: StepState,
        reducer: GradReducer | None = None,
        group=None,
        quantize_block: int | None = None,
        node: tuple[int, int, Any] | None = None,
    ) -> None:
        """``modules[i]`` is the module whose forward uses ``units[i]`` (several units may share one: its trainable and
        frozen parameters); None marks the root. Modules come in registration order (the schedule's ``S``).
        ``quantize_block``: the step's gathers travel as int8 in blocks of that many elements (quantize.py's
        [Note: quantized weight gathers]); other gathers are exact. ``node``: hpZ's (node rank, node size, node group),
        see [Note: a secondary partition]. ``step``: the engine's step state (step_state.py), which says whether a step
        is on and whether it trains. ``reducer``: while training, reduces the units the schedule releases."""
        self.units = list(units)
        self.group = group
        self.quantize_block = quantize_block
        self.node = node
        self._keep: set[int] = set()  # units whose gather in flight leaves a secondary part (hpZ)
        self.root = [u for u, m in zip(units, modules) if m is None]
        by_module: dict[int, list[FlatUnit]] = {}
        self._modules: list[Module] = []
        for unit, module in zip(units, modules):
            if module is not None:
                if id(module) not in by_module:
                    self._modules.append(module)
                by_module.setdefault(id(module), []).append(unit)
        self.scheduled = [by_module[id(m)] for m in self._modules]  # the flat units of each scheduled module
        self._index = {id(u): k for k, group_ in enumerate(self.scheduled) for u in group_}
        self._owner = {id(p): u for u in units for p in u.params}
        self._names = {id(p): name for u in units for p, name in zip(u.params, u.names)}
        self._classes: dict[type, type] = {}  # a parameter's own class -> its ShardedParameter class here
        sizes = [sum(u.layout.total_numel for u in group_) for group_ in self.scheduled]
        persistent = {k for k, size in enumerate(sizes) if size <= param_persistence_threshold}
        self.schedule = Schedule(sizes, persistent, max_live_parameters, self, prefetch_bucket_size)
        self.reducer, self.step = reducer, step
        self.backward_end = backward_end
        backward_end.register(BackwardWork.SCHEDULE, begin=self.schedule.begin_backward, end=self._end_backward)
        self._replays: list[Callable[[], Any]] | None = None  # a forward-only step's collectives (None outside one)
        self._last_replays: list[Callable[[], Any]] | None = None  # the last such step's, for shadow_step
        self.peak_gathered_bytes = 0  # largest size of all gathered units together (root, persistent included)
        self._handles = []
        for k, module in enumerate(self._modules):
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_forward, k)))
            self._handles.append(module.register_forward_hook(partial(self._post_forward, k)))
        unshard_together([u for k in sorted(persistent) for u in self.scheduled[k]], group=group)
        for unit in self.units:
            (self.mark_whole if unit.gathered else self._mark_sharded)(unit)
        self.peak_gathered_bytes = sum(u.flat_param.untyped_storage().nbytes() for u in self.units)

    @property
    def peak_live_numel(self) -> int:
        """Most elements of gathered units at once (the root and persistent units not counted)."""
        return self.schedule.peak_live

    def install_access_hooks(self, model: Module) -> None:
        """Lets modules that register sharded parameters gather them on attribute access."""
        for module in model.modules():
            if any(id(p) in self._owner for p in module._parameters.values() if p is not None):
                module._parameters = GatherOnAccess(self, module._parameters)

    def remove_hooks(self, model: Module) -> None:
        """Removes the module hooks, ``model``'s access hooks (``install_access_hooks``) and the backward callbacks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in model.modules():
            if isinstance(module._parameters, GatherOnAccess):
                module._parameters = dict(module._parameters)
        self.backward_end.unregister(self.schedule.begin_backward, self._end_backward)

    # --- the schedule's executor -------------------------------------------------------------------
    def _start(self, unit: FlatUnit, *, for_step: bool = False) -> None:
        """Starts gathering ``unit``; ``for_step``: for the step's forward or backward (quantized if asked)."""
        if unit.gathered:
            return
        if for_step and unit.secondary is not None:
            unit.unshard_within_node(group=self.node[2])
        else:
            unit.unshard(async_op=True, group=self.group, quantize_block=self.quantize_block if for_step else None)
            forward = self.step.training and not self.schedule.in_backward_pass  # (schedule state, not grad mode)
            if for_step and self.node is not None and forward and unit not in self.root:
                self._keep.add(id(unit))
        if self._replays is not None:
            self._replays.append(partial(self._gather_and_free, unit, for_step))
        gathered = sum(u.flat_param.untyped_storage().nbytes() for u in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    def _gather_and_free(self, unit: FlatUnit, for_step: bool) -> None:
        self._start(unit, for_step=for_step)  # (quantized or exact, as the others' forwards gather it)
        self._free(unit)

    def _wait(self, unit: FlatUnit) -> None:
        unit.wait_gathered()
        if id(unit) in self._keep:
            self._keep.discard(id(unit))
            unit.keep_secondary(self.node[0], self.node[1])
        if unit.gathered:
            self.mark_whole(unit)

    def _free(self, unit: FlatUnit) -> None:
        self._wait(unit)
        if unit.gathered:
            unit.reshard()
            self._mark_sharded(unit)

    # --- reading a parameter whose unit is not here (sharded_param.py) -------------------------------
    def mark_whole(self, unit: FlatUnit) -> None:
        """``unit``'s parameters hold their values: their own class again."""
        for p in unit.params:
            p.__class__ = original_class(p)

    def _mark_sharded(self, unit: FlatUnit) -> None:
        for p in unit.params:
            original = original_class(p)
            if original not in self._classes:
                self._classes[original] = ShardedParameter.of(original, self)
            p.__class__ = self._classes[original]

    def _guard(self, k: int) -> None:
        """``k``'s forward returned: while its units stay gathered unpinned, their parameters take the sharded
        class again (see [Note: a read after the unit's forward] in sharded_param.py)."""
        if k in self.schedule.persistent or k in self.schedule.pinned:
            return
        for unit in self.scheduled[k]:
            if unit.gathered:
                self._mark_sharded(unit)

    @property
    def in_step(self) -> bool:
        """Whether a step is on (the step state's)."""
        return self.step.in_step

    def can_read(self) -> bool:
        """Whether a sharded parameter may be read now: inside a step, not in backward."""
        return self.in_step and not in_backward()

    def read(self, param: Tensor) -> None:
        """A sharded parameter is read: in a step its unit is gathered and kept until the step ends; else raises."""
        unit = self._owner[id(param)]
        if not self.can_read():
            raise read_error(self.describe(param), "in backward" if self.in_step else "outside a step")
        if unit in self.root:  # gathered for the whole step by begin_step
            self._wait(unit)
        else:
            self.schedule.access(self._index[id(unit)])

    def replace(self, param: Tensor, value: Tensor) -> bool:
        """``param.data = value`` on a parameter of the sharded class (``FlatUnit.replace``)."""
        unit = self._owner[id(param)]
        return unit.replace(next(k for k, p in enumerate(unit.params) if p is param), value)

    def describe(self, param: Tensor) -> str:
        """``param``'s name in the module, for errors."""
        return self._names.get(id(param), "a parameter")

    def gather(self, k: int) -> None:
        """The schedule's executor: starts gathering scheduled module ``k``'s units (quantized if asked, in a step)."""
        for unit in self.scheduled[k]:
            self._start(unit, for_step=self.in_step)

    def wait(self, k: int) -> None:
        """The schedule's executor: returns once scheduled module ``k``'s units are whole."""
        for unit in self.scheduled[k]:
            self._wait(unit)

    def free(self, k: int) -> None:
        """The schedule's executor: frees scheduled module ``k``'s units (waiting for a pending gather first)."""
        for unit in self.scheduled[k]:
            self._free(unit)

    def reduce(self, k: int) -> None:
        """The schedule's executor: hands scheduled module ``k``'s trainable units to the reducer."""
        for unit in self.scheduled[k]:
            if self.reducer is not None and unit.trainable:
                self.reducer.reduce_unit(unit)

    # --- hooks ------------------------------------------------------------------------------------
    @torch._dynamo.disable
    def _pre_forward(self, k: int, module: Module, args: Any) -> None:
        if not self.in_step:  # a forward outside the Trainer's steps: gathered for the call (every rank alike)
            self.gather(k)
            self.wait(k)
        elif in_backward():  # activation checkpointing recomputes the unit's forward inside a backward
            self.schedule.recompute(k)
        else:
            self.schedule.enter(k)

    @torch._dynamo.disable
    def _post_forward(self, k: int, module: Module, args: Any, output: Any) -> None:
        if not self.in_step:
            if k not in self.schedule.persistent:
                self.free(k)
            return
        if in_backward():
            entry = self.schedule.entry_for_recompute(k)
        else:
            entry = self.schedule.exit(k)
            self._guard(k)
        if torch.is_grad_enabled() and entry >= 0:
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(partial(self._pre_backward, entry))

    @torch._dynamo.disable
    def _pre_backward(self, entry: int, grad: Tensor) -> None:
        self.backward_end.arm()
        self.schedule.backward(entry)

    def on_access(self, param: Tensor) -> None:
        """``param`` was read as a module attribute in a step: its unit, unless running, is pinned (``access``)."""
        unit = self._owner.get(id(param))
        if unit is None or unit in self.root or not self.in_step or in_backward():
            return
        k = self._index[id(unit)]
        if self.schedule.active_unit() != k:
            self.schedule.access(k)

    def _end_backward(self) -> None:
        self.schedule.end_backward()
        for unit in self.root:
            if self.reducer is not None and unit.trainable:
                self.reducer.reduce_unit(unit)

    # --- step boundaries --------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a training or forward-only step (the step state says which): gathers the root unit for it."""
        self._replays = None if self.step.training else []
        self.schedule.begin_step(forward_only=not self.step.training)
        for unit in self.root:
            self._start(unit, for_step=True)
        for unit in self.root:
            self._wait(unit)

    def end_forward(self) -> None:
        """The step's forward returned: the schedule serves the units this rank did not run."""
        if self.in_step:
            self.schedule.end_forward()

    def end_step(self) -> None:
        """After the step's backward (or forward when there is none): everything not persistent is freed."""
        if self._replays:  # (a forward-only step that gathered)
            self._last_replays = self._replays
        self._replays = None
        self.schedule.end_step()
        for unit in self.root:
            self._free(unit)
        self._drop_secondaries()

    def _drop_secondaries(self) -> None:
        self._keep.clear()
        for unit in self.units:
            unit.drop_secondary()

    @property
    def forward_only_step(self) -> bool:
        """Inside a validation/test/predict step (the same on every rank)."""
        return self.step.evaluating

    def agree_on_writers(self, changed: Tensor, problem: str | None) -> list[int | None]:
        """``param_writes.agree``, which a rank that has run out of batches replays in a forward-only step (there it
        writes nothing, and raises as the others do)."""
        forward_only = self.forward_only_step
        if self._replays is not None:
            self._replays.append(partial(param_writes.agree, torch.zeros_like(changed), None, forward_only=True))
        return param_writes.agree(changed, problem, forward_only=forward_only)

    def shadow_step(self) -> None:
        """Issues the collectives of a forward-only step without running the model (see [Note: uneven inputs]):
        those of this rank's last one, or one gather of every unit."""
        scheduled = [u for k, units in enumerate(self.scheduled) if k not in self.schedule.persistent for u in units]
        everything = [partial(self._gather_and_free, unit, True) for unit in self.root + scheduled]
        for replay in self._last_replays if self._last_replays is not None else everything:
            replay()

    def abandon(self) -> None:
        """At the end of a run, after an error too: forgets pending work without waiting on peers that may never
        come; what the schedule does not keep for the whole run counts as sharded (see [Note: a unit's states])."""
        persistent = {id(u) for k in self.schedule.persistent for u in self.scheduled[k]}
        for unit in self.units:
            if id(unit) in persistent:
                unit.abandon_gather()
            elif unit.gathered:
                unit.forget_values()
                self._mark_sharded(unit)
        self._drop_secondaries()

    @contextmanager
    def gathered_params(self, params: Sequence[Tensor]) -> Iterator[list[FlatUnit]]:
        """Keeps the units holding ``params`` gathered inside the block and yields them, in unit order (collective:
        every rank the same ``params``). In a step they are held as any read there holds them, until the step ends (a
        forward inside the block must not free a write made before it); elsewhere those it gathered are freed after."""
        ids = {id(p) for p in params}
        units = [u for u in self.units if any(id(p) in ids for p in u.params)]
        if self.can_read():
            for unit in units:
                self.read(unit.params[0])
            yield units
            return
        before = {id(u) for u in units if u.gathered}
        for unit in units:
            self._start(unit)
        for unit in units:
            self._wait(unit)
        try:
            yield units
        finally:
            for unit in units:
                if id(unit) not in before:
                    self._free(unit)

    @contextmanager
    def gathered(self, unit: FlatUnit) -> Iterator[None]:
        """Keeps ``unit`` gathered inside the block (outside the step hooks, e.g. for a state dict)."""
        was_gathered = unit.gathered
        self._start(unit)
        self._wait(unit)
        try:
            yield
        finally:
            if not was_gathered:
                self._free(unit)

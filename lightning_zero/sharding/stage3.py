"""Stage 3 at run time: each unit's parameters exist in full only around the code that uses them.

Every rank keeps only its shard of every unit (``FlatUnit.param_shard``). A unit is gathered
(all-gather of the shards into its flat buffer) right before its module's forward and again before
its backward, and freed after each; the gather of the unit expected next is started early
(prefetch) so it overlaps with compute.

[Note: collectives must match across ranks]
Each gather is a collective, so every rank must issue the same gathers in the same order. All
decisions below depend only on what every rank sees alike: the sequence of unit forwards in this
step and the previous one (a model whose control flow differs *between ranks* within one step
cannot be run by any ZeRO-3; one whose control flow differs between steps can). Prefetch guesses the
next unit from the previous step's order; a wrong guess costs memory until the step ends, never a
hang or a wrong result, because nothing is used before it is required (``_require``).

[Note: what a freed parameter looks like]
While its unit is freed, the flat buffer has no storage and a parameter's ``.data`` is one NaN
expanded to the parameter's shape (stride 0): code that looks at shapes (param groups by
``p.dim()``, parameter counts) works as on the whole model, writing into it fails, and reading it
outside a step gives NaN, never stale or plausible numbers. Autograd holds the parameter objects
themselves, which are whole again by the time their backward runs.

[Note: when a unit is gathered]
- the root unit (parameters of no unit module, e.g. embeddings tied to the output head) for a whole
  step, from ``begin_step`` to ``end_step``;
- a unit no larger than ``param_persistence_threshold`` for the whole run;
- any other unit from its forward pre-hook to its forward hook, and from the first gradient reaching
  one of its outputs until all of its parameters' gradients are accumulated (``release_after_backward``);
- a unit whose parameter is read through a module attribute while the unit is freed (a parameter
  used outside its own module) from then until the step ends.
Prefetching never takes more than ``max_live_parameters`` elements of gathered units (the root and
persistent units not counted); a unit that is about to run is gathered regardless.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.utils._pytree import tree_leaves

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit


class _GatherOnAccess(dict):
    """A module's ``_parameters``: reading a sharded parameter as an attribute makes it whole first."""

    def __init__(self, runtime: Stage3Runtime, params: dict) -> None:
        super().__init__(params)
        self.runtime = runtime

    def __getitem__(self, name: str) -> Any:
        param = super().__getitem__(name)
        self.runtime.on_access(param)
        return param


class Stage3Runtime:
    def __init__(
        self,
        units: Sequence[FlatUnit],
        modules: Sequence[Module | None],
        *,
        max_live_parameters: int,
        param_persistence_threshold: int,
        group=None,
    ) -> None:
        """``modules[i]`` is the module whose forward uses ``units[i]``; None marks the root unit."""
        self.units = list(units)
        self.group = group
        self.max_live = max_live_parameters
        self.root = next((u for u, m in zip(units, modules) if m is None), None)
        self.persistent = {id(u) for u in units if u.layout.total_numel <= param_persistence_threshold}
        self._owner = {id(p): u for u in units for p in u.params}
        self._inflight: dict[int, dist.Work | None] = {}
        self._pinned: set[int] = set()
        self._order: list[FlatUnit] = []  # unit forwards of this step, in order
        self._last_order: list[FlatUnit] = []
        self._bwd_cursor: int | None = None
        self.in_step = False
        self.peak_live_numel = 0  # largest prefetch-bounded gathered size seen
        self.peak_gathered_bytes = 0  # largest size of all gathered units together (root, persistent included)
        self._handles = []
        for unit, module in zip(units, modules):
            if module is not None:
                self._handles.append(module.register_forward_pre_hook(partial(self._pre_forward, unit)))
                self._handles.append(module.register_forward_hook(partial(self._post_forward, unit)))
        for unit in units:
            if id(unit) in self.persistent:
                self._require(unit)

    def install_access_hooks(self, model: Module) -> None:
        """Lets modules that register sharded parameters gather them on attribute access."""
        for module in model.modules():
            if any(id(p) in self._owner for p in module._parameters.values() if p is not None):
                module._parameters = _GatherOnAccess(self, module._parameters)

    def remove_hooks(self, model: Module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in model.modules():
            if isinstance(module._parameters, _GatherOnAccess):
                module._parameters = dict(module._parameters)

    # --- gather and free --------------------------------------------------------------------------
    def _live_numel(self) -> int:
        return sum(
            u.layout.total_numel
            for u in self.units
            if u.gathered and u is not self.root and id(u) not in self.persistent
        )

    def _start(self, unit: FlatUnit, *, async_op: bool) -> None:
        self._inflight[id(unit)] = unit.unshard(async_op=async_op, group=self.group)
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())
        gathered = sum(u.flat_param.untyped_storage().nbytes() for u in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    def _require(self, unit: FlatUnit) -> None:
        """Returns once ``unit`` is gathered and its data has arrived."""
        if id(unit) not in self._inflight and not unit.gathered:
            self._start(unit, async_op=False)
        if id(unit) in self._inflight:
            collectives.wait(self._inflight.pop(id(unit)))

    def _prefetch(self, unit: FlatUnit | None) -> None:
        if unit is None or unit.gathered or id(unit) in self._inflight:
            return
        if self._live_numel() + unit.layout.total_numel <= self.max_live:
            self._start(unit, async_op=True)

    def _release(self, unit: FlatUnit) -> None:
        if unit is self.root or id(unit) in self.persistent or id(unit) in self._pinned or not unit.gathered:
            return
        if id(unit) in self._inflight:
            collectives.wait(self._inflight.pop(id(unit)))
        unit.reshard()

    # --- hooks ------------------------------------------------------------------------------------
    def _pre_forward(self, unit: FlatUnit, module: Module, args: Any) -> None:
        self._order.append(unit)
        self._require(unit)
        position = len(self._order)
        self._prefetch(self._last_order[position] if position < len(self._last_order) else None)

    def _post_forward(self, unit: FlatUnit, module: Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._pre_backward, unit))
        self._release(unit)

    def _pre_backward(self, unit: FlatUnit, grad: Tensor) -> None:
        self._require(unit)
        # Backward runs the step's unit forwards in reverse: prefetch the one before this occurrence.
        cursor = len(self._order) if self._bwd_cursor is None else self._bwd_cursor
        k = next((i for i in range(cursor - 1, -1, -1) if self._order[i] is unit), None)
        if k is not None:
            self._bwd_cursor = k
            self._prefetch(self._order[k - 1] if k > 0 else None)

    def release_after_backward(self, unit: FlatUnit) -> None:
        """Called once every parameter of ``unit`` has its gradient accumulated."""
        self._release(unit)

    def on_access(self, param: Tensor) -> None:
        unit = self._owner.get(id(param))
        if unit is None or not self.in_step or (unit.gathered and id(unit) not in self._inflight):
            return
        self._require(unit)
        self._pinned.add(id(unit))

    # --- step boundaries --------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a training/validation/test/predict step: the root unit is gathered for the step."""
        if self.in_step:  # the last step had no backward (training_step returned None)
            self.end_step()
        self.in_step = True
        if self.root is not None:
            self._require(self.root)

    def end_step(self) -> None:
        """After the step's backward (or forward when there is none): everything not persistent is freed."""
        self._pinned.clear()
        for unit in self.units:
            if id(unit) in self._inflight:
                collectives.wait(self._inflight.pop(id(unit)))
            if id(unit) not in self.persistent and unit.gathered:
                unit.reshard()
        if self._order:
            self._last_order = self._order
        self._order, self._bwd_cursor, self.in_step = [], None, False

    @contextmanager
    def gathered(self, unit: FlatUnit) -> Iterator[None]:
        """Keeps ``unit`` gathered inside the block (outside the step hooks, e.g. for a state dict)."""
        was_gathered = unit.gathered
        self._require(unit)
        try:
            yield
        finally:
            if not was_gathered:
                unit.reshard()

    def gather_all(self) -> None:
        """Gathers every unit and leaves it so (end of training: the module becomes whole again)."""
        self.end_step()
        for unit in self.units:
            self._require(unit)

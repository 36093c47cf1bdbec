"""Which unit holds each parameter: the index that lets code outside a step find a parameter's unit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.sharding.flat_unit import FlatUnit


class UnitIndex:
    """Which unit holds each parameter (its master weights, stage 3 its shards) and its index there.

    It lives on the module whose parameters the units hold and on each of its submodules (``attach``,
    ``of``), for as long as the units hold them: stages 1 and 2 from set-up to teardown, stage 3 as long as
    the module stays sharded (stage3_setup.ShardedModule). Whoever writes parameters from outside a step
    (``load_pretrained`` into any submodule, ``add_param_group``) finds their units here."""

    _ATTRIBUTE = "_lightning_zero_units"

    def __init__(self, units: Sequence[FlatUnit] = ()) -> None:
        self._entries: dict[int, tuple[FlatUnit, int]] = {}
        self.add(units)

    def add(self, units: Sequence[FlatUnit]) -> None:
        """Indexes the parameters of ``units`` (a parameter indexed before now points to its new unit)."""
        for unit in units:
            for index, p in enumerate(unit.params):
                self._entries[id(p)] = (unit, index)

    def __call__(self, param: Tensor) -> tuple[FlatUnit, int] | None:
        """``param``'s unit and index there, or None. (The units hold their parameters, so an id here is
        never another tensor's.)"""
        entry = self._entries.get(id(param))
        return entry if entry is not None and entry[0].params[entry[1]] is param else None

    def attach(self, module: torch.nn.Module) -> UnitIndex:
        """Attaches this index to ``module`` and each of its submodules (``of`` finds it there); returns it."""
        for submodule in module.modules():
            submodule.__dict__[self._ATTRIBUTE] = self
        return self

    @classmethod
    def of(cls, module: torch.nn.Module) -> UnitIndex:
        """The index attached to ``module``; an empty one when its parameters are in no unit."""
        return module.__dict__.get(cls._ATTRIBUTE) or cls()

    @classmethod
    def detach(cls, module: torch.nn.Module) -> None:
        """Removes the index from ``module`` and each of its submodules."""
        for submodule in module.modules():
            submodule.__dict__.pop(cls._ATTRIBUTE, None)

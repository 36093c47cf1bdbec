"""The engine's flat units, and how parameters join them in the middle of a run (``add_param_group``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from torch.nn import Module, Parameter

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.layout import build_layout
from lightning_zero.sharding.placement import Replicated, Sharded
from lightning_zero.sharding.stage3_setup import install_load_hooks
from lightning_zero.sharding.unit_index import UnitIndex


class UnitSet:
    """The engine's flat units (a list a weight average reads as it grows, new for each ``use``) and, at stages 1 and 2,
    the load hooks through which a ``load_state_dict`` of the module reaches their masters."""

    def __init__(self) -> None:
        self.units: list[FlatUnit] = []
        self.load_hooks: list = []

    def use(self, units: Sequence[FlatUnit], module: Module | None = None) -> None:
        """The units from now on; with ``module`` (stages 1 and 2), located by it and its loads reaching them."""
        self.units = list(units)
        if module is not None:
            UnitIndex(self.units).attach(module)
            self.load_hooks += install_load_hooks(module, units)

    def add(self, units: Sequence[FlatUnit], module: Module) -> None:
        """Units of their own for parameters added to training (stages 1 and 2)."""
        self.units += units
        UnitIndex.of(module).add(units)
        self.load_hooks += install_load_hooks(module, units)

    def release(self) -> None:
        """Removes the load hooks (the units stay)."""
        for handle in self.load_hooks:
            handle.remove()
        self.load_hooks = []


class ParamActivation:
    """``ZeroOptimizer.add_param_group``'s work: gives parameters master weights and gradients from now on (stage 3:
    their frozen units become trainable; stages 1-2: they get a unit of their own), for every component that
    holds units. Built by the engine once those exist, before the optimizers."""

    def __init__(
        self,
        *,
        config: ZeroConfig,
        module: Module,
        unit_set: UnitSet,
        reducer: GradReducer,
        placement: Replicated | Sharded,
        average: WeightAverage | None,
        before_change: Callable[[], None],
        rank: int,
        world_size: int,
    ) -> None:
        """``placement``: the engine's (placement.py); ``before_change``: settles the parameters' pending writes and
        a background save's snapshot (the units are about to change); ``rank``, ``world_size``: of the shard group."""
        self.config, self.module, self.unit_set, self.reducer = config, module, unit_set, reducer
        self.placement, self.average, self.before_change = placement, average, before_change
        self.shard = {"rank": rank, "world_size": world_size}

    def __call__(self, params: list[Parameter]) -> tuple[dict, dict]:
        """Returns where each of ``params`` is now, (unit, index) by parameter, and the module's names by parameter."""
        self.before_change()
        names = {p: n for n, p in self.module.named_parameters()}
        unit_location = UnitIndex.of(self.module)
        units = trainable_units(params, names, self.config, unit_location, **self.shard)
        if self.placement.units_from_optimizers:  # units of their own
            self.unit_set.add(units, self.module)
        self.reducer.add_units(units)
        self.placement.add_units(units)
        if self.average is not None:
            self.average.units_changed()
        return {p: unit_location(p) for p in params}, names


def trainable_units(
    params: list, names: dict, config: ZeroConfig, unit_location: UnitIndex, *, rank: int, world_size: int
) -> list[FlatUnit]:
    """``add_param_group``: the units that train ``params`` from now on (stage 3: their frozen units made
    trainable; stages 1-2: one new unit). Refuses what is not a module parameter that requires grad and
    is not trained already."""
    for p in params:
        located = unit_location(p)
        if p not in names or not p.requires_grad or (located is not None and located[0].trainable):
            raise ValueError(
                f"add_param_group: {names.get(p, 'a tensor')!r} must be a parameter of the LightningModule that"
                " requires grad and is not trained already"
            )
    if config.stage == 3:
        units = list(dict.fromkeys(unit_location(p)[0] for p in params))
        for unit in units:
            unit.make_trainable(**config.unit_options(unit.param_dtype))
        return units
    layout = build_layout([p.numel() for p in params], world_size, config.reduce_bucket_size)
    options = config.unit_options(params[0].dtype)
    return [FlatUnit(params, [names[p] for p in params], layout, rank, full_grad=config.stage == 1, **options)]


def settle(placement: Replicated | Sharded, unit_set: UnitSet) -> None:
    """Waits for ``placement``'s pending post-step gathers (before anything reads parameters) and keeps each ``.data``
    user code replaced (sharding/param_writes.py's [Note: a replaced .data])."""
    placement.settle()
    for unit in unit_set.units:
        unit.take_replaced()


class Snapshots(Protocol):
    """What a background writer offers (checkpoint/background.py's ``BackgroundSaves``)."""

    def wait_snapshot(self) -> None:
        """Returns once the save in flight, if any, has copied what it saves (before the state changes)."""


def before_weights_change(placement: Replicated | Sharded, unit_set: UnitSet, background: Snapshots | None) -> None:
    """Before anything but the optimizer step writes the masters (the averaging callbacks' swaps, parameters added to
    training): the parameter all-gathers settled and a background save's snapshot taken (background.py's Note)."""
    settle(placement, unit_set)
    if background is not None:
        background.wait_snapshot()

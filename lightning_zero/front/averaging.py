"""Lightning's weight-averaging callbacks under the ZeRO strategies, their average sharded (4Ψ/N per rank).

``WeightAveraging`` (``EMAWeightAveraging``, and subclasses that choose when to update through ``should_update``)
and ``StochasticWeightAveraging`` keep a whole copy of the module (``AveragedModel`` or ``deepcopy``) and zip its
parameters with the module's. Under the ZeRO strategies each such callback becomes an instance of a subclass
made for its class (``Sharded<Class>``, as ``fully_shard`` swaps a module's class): the same object, its
arguments, schedule and state kept, whose averaged model is the strategy's ``WeightAverage``
(sharding/averaging.py): updated, swapped in for validation, copied in at the end, saved and resumed from the
shards. What a subclass overrides besides ``should_update`` is refused at set-up (it would be bypassed).
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module

from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.flat_unit import FlatUnit

try:  # Lightning 2.6 on
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning has SWA only
    WeightAveraging = None

AVERAGED_STATE = "averaging_state"  # WeightAveraging's key for the average's count in a checkpoint


class _ShardedAverage:
    """What both sharded callbacks share: no copy of the model, the strategy's average instead."""

    _average_model: WeightAverage | None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pass  # no copy: the strategy hands the average over once the units exist (``use_average``)

    def use_average(self, average: WeightAverage | None) -> None:
        self._average_model = average


class _ShardedWeightAveraging(_ShardedAverage):
    """``WeightAveraging`` over the strategy's sharded average."""

    def _swap_models(self, pl_module: pl.LightningModule) -> None:
        self._average_model.swap()

    def _copy_average_to_current(self, pl_module: pl.LightningModule) -> None:
        self._average_model.copy_to_model()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self._average_model is not None:  # the averaged weights themselves go into the shards (strategy)
            checkpoint[AVERAGED_STATE] = {"n_averaged": self._average_model.n_averaged.clone()}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self._average_model is None:
            return
        if AVERAGED_STATE in checkpoint:  # the average itself was loaded with the model (strategy)
            self._average_model.n_averaged.copy_(checkpoint[AVERAGED_STATE]["n_averaged"])
        else:
            rank_zero_warn(
                "The checkpoint was not created with WeightAveraging. Both the current and the average model will"
                " be initialized with state_dict."
            )


class _ShardedSWA(_ShardedAverage):
    """``StochasticWeightAveraging`` over the strategy's sharded average."""

    def update_parameters(self, average_model: WeightAverage, model: Any, n_averaged: Tensor, avg_fn: Any) -> None:
        average_model.update_swa(avg_fn, n_averaged)

    def transfer_weights(self, src: Any, dst: Any) -> None:
        if isinstance(src, WeightAverage):
            src.copy_to_model(buffers=False)
        else:
            raise TypeError(f"internal: {type(self).__name__} transfers from its WeightAverage, got {type(src)}")


def _overridden(cls: type, base: type, mixin: type) -> list[str]:
    """The methods of ``mixin`` that ``cls`` (a subclass of Lightning's ``base``) overrides itself."""
    defined = {n: v for k in reversed(mixin.__mro__[:-1]) for n, v in vars(k).items()}  # (its base's too)
    names = [n for n, v in defined.items() if callable(v) and n != "use_average" and not n.startswith("__")]
    return [n for n in names if getattr(cls, n, None) is not getattr(base, n, None)]


@functools.cache
def _sharded_class(cls: type, mixin: type) -> type:
    # The qualified name stays the class's own: Lightning keys a callback's state in checkpoints by it, so that
    # checkpoints cross with ddp's (and with runs whose callback is not swapped).
    return type(
        f"Sharded{cls.__name__}", (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )


def _kinds() -> list[tuple[type, type]]:
    kinds = [(StochasticWeightAveraging, _ShardedSWA)]
    if WeightAveraging is not None:
        kinds.append((WeightAveraging, _ShardedWeightAveraging))
    return kinds


def shard_averaging_callbacks(callbacks: list[pl.Callback]) -> list[pl.Callback]:
    """Makes Lightning's weight-averaging callbacks among ``callbacks`` keep the strategy's sharded average
    (before their ``setup``, which would copy the model); returns them. At most one: their averages would
    each write the model's weights."""
    found = []
    for callback in callbacks:
        for base, mixin in _kinds():
            if isinstance(callback, mixin):
                found.append(callback)  # (a second fit with the same callback)
            elif isinstance(callback, base):
                bypassed = _overridden(type(callback), base, mixin)
                if bypassed:
                    raise ValueError(
                        f"{type(callback).__name__} overrides {bypassed}, which the ZeRO strategies replace to keep"
                        f" its average sharded; subclass {base.__name__} overriding should_update only, or average"
                        " inside `with lightning_zero.gathered_parameters(pl_module):`"
                    )
                callback.__class__ = _sharded_class(type(callback), mixin)
                found.append(callback)
    if len(found) > 1:
        names = [type(c).__name__ for c in found]
        raise ValueError(f"one weight-averaging callback at a time under the ZeRO strategies, got {names}")
    return found


def attach_average(
    callbacks: list[pl.Callback], model: Module, units: list[FlatUnit], *, group=None, settle=lambda: None
) -> WeightAverage | None:
    """The sharded average the (sharded) averaging callback among ``callbacks`` keeps, made from the current
    weights with the callback's own arguments and handed to it; None without one."""
    if not callbacks:
        return None
    (callback,) = callbacks
    if isinstance(callback, _ShardedSWA):  # parameters only, by its rule; kept where it says (the CPU by default)
        options = {"device": callback._device, "exported": False}
    else:
        options = {"device": callback._device, "use_buffers": callback._use_buffers, **callback._kwargs}
    average = WeightAverage(model, units, group=group, settle=settle, **options)
    callback.use_average(average)
    return average


def detach_average(callbacks: list[pl.Callback]) -> None:
    """After the run: the callbacks lose the average and are of their own class again (usable elsewhere)."""
    for callback in callbacks:
        callback.use_average(None)
        callback.__class__ = type(callback).__bases__[1]  # (mixin, the user's class)

"""What ``ZeroEngine.load`` returns: a checkpoint opened for one engine (io.py's ``open_checkpoint``), whose front
door takes its own state from it (``lightning``) and restores the sharded parts when it restores them: the Trainer
in the order of Lightning's hooks (the model in ``load_model_state_dict``, the optimizers in
``load_optimizer_state_dict``), Fabric at once. Saving through the engine is save.py's ``SaveJob``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Module

from lightning_zero.checkpoint.io import LoadedCheckpoint, load_average, load_model, load_optimizer
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


class Restore:
    """``loaded`` restored into an engine's ``units`` (loaded over ``group``, its shard group) and its weight
    ``average``, if it keeps one. Each part's restore is collective: every rank calls it."""

    def __init__(
        self,
        loaded: LoadedCheckpoint,
        *,
        units: Sequence[FlatUnit],
        group: Any = None,
        average: WeightAverage | None = None,
    ) -> None:
        self.loaded, self.units, self.group, self.average = loaded, units, group, average

    @property
    def lightning(self) -> dict[str, Any]:
        """The front door's own state as it was saved (Lightning's, Fabric's, a script's), with the entries the
        engine wrote beside it (format.py)."""
        return self.loaded.lightning

    @property
    def optimizer_count(self) -> int:
        """How many optimizers' state the checkpoint holds (none: the weights alone)."""
        return len(self.loaded.meta.optimizers)

    def model(self, module: Module, *, exported_average_as_weights: bool = False) -> None:
        """Every parameter and buffer of ``module`` (io.py's ``load_model``), and the engine's weight average: from
        the checkpoint's where it has one, else restarted from the loaded weights (as Lightning's callbacks do).
        ``exported_average_as_weights``: where the engine keeps no average and the checkpoint presents its average as
        the weights (Lightning's WeightAveraging: ddp's checkpoint holds it as its state_dict), that average goes
        into ``module`` (the Trainer's reading; Fabric's loads the trained weights)."""
        saved, average = self.loaded.average, self.average
        as_weights = exported_average_as_weights and average is None and saved is not None and saved["exported"]
        load_model(self.loaded, module, self.units, group=self.group, averaged=as_weights)
        if average is not None and saved is not None:
            load_average(self.loaded, average)
        elif average is not None:
            average.restart()

    def optimizers(self, optimizers: Sequence[ZeroOptimizer]) -> None:
        """Each optimizer's hyper-parameters and state, by position, as many as the checkpoint holds (like
        Lightning's own restore, a zip: a checkpoint saved outside fit has none to restore)."""
        for index, optimizer in enumerate(optimizers[: self.optimizer_count]):
            load_optimizer(self.loaded, index, optimizer)

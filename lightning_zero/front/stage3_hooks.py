"""The ZeRO strategy's stage-3 hooks: building ``configure_model``'s modules sharded, reading parameters whole,
and making the module whole again when asked (the work is the engine's: engine.py).

A mixin of ``ZeroStrategy`` (strategy.py), kept apart so that the strategy file holds set-up and steps.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import lightning.pytorch as pl
import torch
from torch.nn import Module, Parameter


class Stage3Hooks:
    """Stage 3's part of ``ZeroStrategy`` (uses its config, topology, optimizers and units)."""

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 builds ``configure_model``'s modules for real but never whole (sharding/construct.py)."""
        if self.config.stage != 3:
            yield
            return
        self._construction = self.engine.construction()
        with self._construction:
            yield

    @contextmanager
    def gathered_parameters(
        self, *targets: Module | Parameter, modifier_rank: int | None = None
    ) -> Generator[list[Parameter], None, None]:
        """The parameters of ``targets`` (modules, with their submodules, or parameters) whole inside the block,
        outside the steps too, like DeepSpeed's ``GatheredParameters`` and FSDP's ``summon_full_params``.
        Collective: enter it on every rank with the same targets (stage 3 gathers their units, one
        all-gather each, and frees them after; stages 1 and 2 hold every parameter whole already). Changes
        made inside are dropped, unless ``modifier_rank`` names the (global) rank whose values every rank
        then takes, master weights included. Yields the parameters."""
        with self.engine.gathered_parameters(targets, modifier_rank) as params:
            yield params

    def gather_module(self, device: str | torch.device = "cpu") -> pl.LightningModule:
        """Stage 3, after ``fit``/``validate``/...: makes the LightningModule whole on ``device``, one unit
        gathered at a time (collective: call it on every rank). Other stages' modules are whole already."""
        module = self.lightning_module
        if self.engine is not None:
            self.engine.gather_module(module, torch.device(device))
        return module.to(device)

"""The ZeRO strategy's stage-3 hooks: building ``configure_model``'s modules sharded, sharding the module at
set-up, and making it whole again when asked (the work is in ``sharding/stage3*.py`` and ``construct.py``).

A mixin of ``ZeroStrategy`` (strategy.py), kept apart so that the strategy file holds set-up and steps.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import lightning.pytorch as pl
import torch
from torch.nn import Module, Parameter

from lightning_zero.precision import stage3_param_dtype
from lightning_zero.sharding import collectives
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.flat_unit import UnitIndex
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.stage3_setup import (
    ShardedModule,
    default_init,
    gather_module,
    initialize_sharded,
    shard_module,
)


class Stage3Hooks:
    """Stage 3's part of ``ZeroStrategy`` (uses its config, topology, optimizers and units)."""

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 builds ``configure_model``'s modules for real but never whole (sharding/construct.py)."""
        if self.config.stage != 3:
            yield
            return
        self._construction = ShardedConstruction(
            rank=self.topology.shard_rank,
            world_size=self.topology.shard_size,
            device=self.root_device,
            max_whole_numel=self.config.max_live_parameters,
            group=self.topology.shard_group,
        )
        with self._construction:
            yield

    def _setup_stage3(
        self, fitting: bool, on_meta: bool, sharded: ShardedModule | None, construction: ShardedConstruction | None
    ) -> None:
        module = self.lightning_module
        if sharded is not None:  # fit, then validate/test/predict (or fit again): keep the shards
            sharded.check(world_size=self.topology.shard_size, rank=self.topology.shard_rank)
            if fitting:
                for unit in sharded.units:
                    if unit.requires_grad:
                        unit.make_trainable(**self.config.unit_options(unit.param_dtype))
        else:
            holder = {id(p): k for k, o in enumerate(self.optimizers) for g in o.param_groups for p in g["params"]}
            sharded = shard_module(
                module,
                self.config,
                rank=self.topology.shard_rank,
                world_size=self.topology.shard_size,
                device=self.root_device,
                dtype=stage3_param_dtype(self.precision_plugin, self.config.gather_dtype),
                construction=construction,
                holder=holder if fitting else None,
            )
            if construction is not None:
                self.sharded_init_peak_bytes = construction.peak_bytes
            if on_meta:
                init = getattr(module, "init_module", default_init)
                self.sharded_init_peak_bytes = initialize_sharded(module, sharded.units, init, device=self.root_device)
                self.model_to_device()
        self._units = sharded.units
        self._stage3 = Stage3Runtime(
            sharded.units,
            sharded.modules,
            max_live_parameters=self.config.max_live_parameters,
            prefetch_bucket_size=self.config.prefetch_bucket_size,
            param_persistence_threshold=self.config.param_persistence_threshold,
            backward_end=self._backward_end,
            group=self.topology.shard_group,
        )
        self._stage3.install_access_hooks(module)

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
        params = list(dict.fromkeys(p for t in targets for p in (t.parameters() if isinstance(t, Module) else [t])))
        if self._stage3 is None:
            yield params
            if modifier_rank is not None:
                unit_location = UnitIndex.of(self.lightning_module)
                for p in params:
                    collectives.broadcast(p.data, src=modifier_rank)
                    located = unit_location(p)
                    if located is not None:
                        located[0].write_owned(located[1], p.data)  # the master too
            return
        with self._stage3.gathered_params(params) as units:
            yield params
            if modifier_rank is not None:
                for unit in units:  # whole units: every rank then keeps its own pieces of them
                    collectives.broadcast(unit.flat_param, src=modifier_rank)
                    for index, p in enumerate(unit.params):
                        unit.write_owned(index, p.data)

    def gather_module(self, device: str | torch.device = "cpu") -> pl.LightningModule:
        """Stage 3, after ``fit``/``validate``/...: makes the LightningModule whole on ``device``, one unit
        gathered at a time (collective: call it on every rank). Other stages' modules are whole already."""
        module = self.lightning_module
        if self._stage3 is not None:
            if self._stage3.in_step:
                raise RuntimeError("gather_module() is for after a Trainer run, not inside a step")
            gather_module(self._stage3, torch.device(device))
            ShardedModule.detach(module)
            self._stage3, self._units = None, []
        return module.to(device)

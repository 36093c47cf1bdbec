"""ZeroStrategy: the Lightning side of ZeRO stages 1, 2 and 3; the sharding itself lives in ``sharding/``.

It reuses Lightning's DDP machinery for what is the same (launchers, process group, barrier,
broadcast, distributed sampler) and replaces the DDP wrapper: parameters are flattened into units,
the user's optimizers become ZeroOptimizers and gradients are reduce-scattered by hooks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.config import ZeroConfig
from lightning_zero.deepspeed_config import read_deepspeed_config
from lightning_zero.precision import ZeroPrecision, validate_precision
from lightning_zero.sharding.build import check_optimizer_params, units_per_param_group, wrap_optimizers
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.stage3_setup import (
    build_units,
    default_init,
    full_state_dict,
    initialize_sharded,
    make_whole,
)
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3)
    sharded across ranks.

    Args:
        config: the typed configuration; ``ZeroConfig()`` by default.
        stage: shortcut that overrides ``config.stage``.
        start_method: how Lightning starts the processes: "popen" (re-run the script, like ``ddp``) or
            "spawn" (like ``ddp_spawn``, for notebooks and tests).
    """

    strategy_name = "zero"

    def __init__(
        self,
        config: ZeroConfig | None = None,
        *,
        stage: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        config = config if config is not None else ZeroConfig()
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a ZeroConfig, got {type(config).__name__}")
        if stage is not None:
            config = dataclasses.replace(config, stage=stage)
        self.config = config
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=config.timeout),
            start_method=start_method,
        )
        self._reducer: GradReducer | None = None
        self._units: list[FlatUnit] = []
        self._stage3: Stage3Runtime | None = None
        self._loaded: checkpoint_io.LoadedCheckpoint | None = None  # between load_checkpoint and the restores
        self.sharded_init_peak_bytes: int | None = None  # stage 3 from the meta device: see initialize_sharded
        self.peak_gathered_bytes: int | None = None  # stage 3: most bytes of whole units at once, at teardown

    @classmethod
    def from_deepspeed_config(cls, source: Any, *, ignore: tuple[str, ...] = ()) -> ZeroStrategy:
        """The strategy a DeepSpeed JSON config (path or dict) describes, its fp16 loss scaling included.

        Trainer arguments it also sets (clipping, accumulation) come from
        ``lightning_zero.deepspeed_config.read_deepspeed_config(source).trainer_kwargs()``.
        """
        settings = read_deepspeed_config(source, ignore=ignore)
        strategy = cls(settings.zero)
        if settings.precision is not None:
            strategy.precision_plugin = ZeroPrecision(settings.precision, loss_scale=settings.loss_scale)
        return strategy

    # --- precision --------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> ZeroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Accepts the plugin Lightning builds from ``Trainer(precision=...)`` and turns it into ours."""
        if plugin is None or isinstance(plugin, ZeroPrecision):
            self._precision_plugin = plugin
        elif type(plugin) is Precision:
            self._precision_plugin = ZeroPrecision("32-true")
        elif isinstance(plugin, MixedPrecision):
            self._precision_plugin = ZeroPrecision(plugin.precision, device=plugin.device)
        else:
            validate_precision(str(getattr(plugin, "precision", None)))
            raise ValueError(f"the ZeRO strategies need ZeroPrecision, got {type(plugin).__name__}")

    # --- set-up -----------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.precision_plugin.device is None:
            self.precision_plugin.device = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        module = self.lightning_module
        on_meta = any(p.is_meta for p in module.parameters())
        if on_meta and self.config.stage != 3:
            raise ValueError(
                "the model has parameters on the meta device, which only stage 3 can materialize;"
                f" zero.stage is {self.config.stage}"
            )
        if not on_meta:
            self.model_to_device()
            _sync_module_states(self.model)  # every rank starts from rank 0's parameters and buffers
        if self.config.stage == 3:
            self._setup_stage3(fitting, on_meta)
        if fitting:
            self.setup_optimizers(trainer)
            names = check_optimizer_params(module, self.optimizers, rank=self.global_rank)
            if self.config.stage < 3:
                kwargs = {"rank": self.global_rank, "world_size": self.world_size}
                self._units = units_per_param_group(self.optimizers, names, self.config, **kwargs)
            self.optimizers, self._reducer = wrap_optimizers(
                self.optimizers,
                self._units,
                names,
                self.config,
                world_size=self.world_size,
                on_bucket_complete=self._stage3.release_after_backward if self._stage3 else None,
            )
            if self.precision_plugin.scaler is not None:
                self._hold_schedulers_on_skipped_steps()
        self.setup_precision_plugin()

    def _setup_stage3(self, fitting: bool, on_meta: bool) -> None:
        module = self.lightning_module
        self._units, modules = build_units(
            module,
            self.config,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
            trainable=fitting,
        )
        if on_meta:
            init = getattr(module, "init_module", default_init)
            self.sharded_init_peak_bytes = initialize_sharded(module, self._units, init, device=self.root_device)
            self.model_to_device()
        self._stage3 = Stage3Runtime(
            self._units,
            modules,
            max_live_parameters=self.config.max_live_parameters,
            param_persistence_threshold=self.config.param_persistence_threshold,
        )
        self._stage3.install_access_hooks(module)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 builds ``configure_model``'s modules on the meta device, to be materialized shard by shard."""
        with torch.device("meta") if self.config.stage == 3 else nullcontext():
            yield

    def _hold_schedulers_on_skipped_steps(self) -> None:
        """[Note: skipped steps] An fp16 step skipped for overflow did not happen, so step-wise LR
        schedulers must not advance either (Lightning steps them after every optimizer step)."""
        owner = {id(z.optimizer): z for z in self.optimizers if isinstance(z, ZeroOptimizer)}
        for config in self.lr_scheduler_configs:
            zero = owner.get(id(config.scheduler.optimizer))
            if config.interval == "step" and zero is not None:
                config.scheduler = SkipAwareScheduler(config.scheduler, zero)

    # --- steps -----------------------------------------------------------------------------------
    # [Note: stage-3 steps] A step gathers the root unit first; it ends after backward (post_backward)
    # or, without backward, right after the step. Units used by the step are gathered by hooks.
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._stage3 is not None:
            self._stage3.begin_step()
        return super().training_step(*args, **kwargs)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._reducer is not None:
            self._reducer.finish_backward()
        if self._stage3 is not None:
            self._stage3.end_step()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only_step(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only_step(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only_step(super().predict_step, *args, **kwargs)

    def _forward_only_step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        if self._stage3 is None:
            return step(*args, **kwargs)
        self._stage3.begin_step()
        try:
            return step(*args, **kwargs)
        finally:
            self._stage3.end_step()

    # --- checkpoints (lightning_zero.checkpoint) -------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a sharded checkpoint is loaded into the units, which exist after set-up

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # sharded: each rank writes its own part in save_checkpoint; nothing is gathered

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Writes the checkpoint as a directory: each rank its own shards (collective; see checkpoint/format.py)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        checkpoint_io.save(
            checkpoint,
            filepath,
            model=self.lightning_module,
            units=self._units,
            optimizers=[o for o in self.optimizers if isinstance(o, ZeroOptimizer)],
            stage=self.config.stage,
            rank=self.global_rank,
            world_size=self.world_size,
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Checks a sharded checkpoint directory (saved at any world size and stage) on every rank."""
        self._loaded = checkpoint_io.open_checkpoint(checkpoint_path, rank=self.global_rank, world_size=self.world_size)
        return self._loaded.lightning

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        module, loaded = self.lightning_module, self._loaded
        if self._units:
            checkpoint_io.check_model(loaded, {n: s for u in self._units for n, s in zip(u.names, u.shapes)})
            checkpoint_io.load_units(loaded, self._units)
            checkpoint_io.load_replicated(loaded, module)
        else:
            trainable = {n: tuple(p.shape) for n, p in module.named_parameters() if p.requires_grad}
            checkpoint_io.check_model(loaded, trainable)
            checkpoint_io.load_whole_model(loaded, module)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        zero_optimizers = [o for o in self.optimizers if isinstance(o, ZeroOptimizer)]
        for index, optimizer in enumerate(zero_optimizers):
            checkpoint_io.load_optimizer(self._loaded, index, optimizer)
        self._loaded = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full, unsharded state dict on every rank (stage 3 gathers it unit by unit, on the CPU)."""
        if self._stage3 is not None:
            return full_state_dict(self.lightning_module, self._stage3)
        return super().lightning_module_state_dict()

    def teardown(self) -> None:
        if self._stage3 is not None:
            self.peak_gathered_bytes = self._stage3.peak_gathered_bytes
            make_whole(self._stage3)  # the LightningModule leaves fit() with whole parameters
            self._stage3.remove_hooks(self.lightning_module)
            self._stage3 = None
        if self._reducer is not None:
            self._reducer.remove_hooks()
            self._reducer = None
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # Set-up failed before materializing the model: there is nothing to move to the CPU, and
            # trying would replace the set-up's error with "Cannot copy out of meta tensor".
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()

    # --- introspection ----------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """This rank's persistent bytes: parameters, gradients, master weights and optimizer state.

        Parameters include frozen ones (stage 3: the shards, not units gathered for a moment; see
        ``peak_gathered_bytes``); gradients are the stage's persistent storage (in-flight buckets
        are transient and not counted).
        """
        totals = {"parameters": 0, "gradients": 0, "master": 0, "optimizer_state": 0}
        for unit in self._units:
            for key, value in unit.nbytes().items():
                totals[key] += value
        for optimizer in self.optimizers:
            if isinstance(optimizer, ZeroOptimizer):
                totals["optimizer_state"] += optimizer.state_nbytes()
        totals["parameters"] += sum(p.nbytes for p in self.lightning_module.parameters() if not p.requires_grad)
        return totals

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage, what in ((1, "optimizer state"), (2, "optimizer state and gradients"), (3, "everything")):
            strategy_registry.register(
                f"zero{stage}",
                cls,
                description=f"ZeRO stage {stage}: {what} sharded across data-parallel ranks",
                stage=stage,
            )


class SkipAwareScheduler:
    """Forwards everything to an LR scheduler, except ``step`` after a skipped optimizer step."""

    def __init__(self, scheduler: Any, optimizer: ZeroOptimizer) -> None:
        self.scheduler = scheduler
        self.zero_optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.zero_optimizer.last_step_skipped:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

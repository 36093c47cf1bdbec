"""ZeroStrategy: the Lightning side of ZeRO stages 1, 2 and 3; the sharding itself lives in ``sharding/``.

It reuses Lightning's DDP machinery for what is the same (launchers, process group, barrier,
broadcast, distributed sampler) and replaces the DDP wrapper: parameters are flattened into units,
the user's optimizers become ZeroOptimizers and gradients are reduce-scattered by hooks. The
checkpoint hooks live in checkpoint_hooks.py and stage 3's in stage3_hooks.py (mixins).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_module_states as torch_sync_module_states

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.checkpoint import rng
from lightning_zero.config import ZeroConfig
from lightning_zero.deepspeed_config import read_deepspeed_config
from lightning_zero.engine import ZeroEngine
from lightning_zero.front.averaging import attach_average, detach_average, shard_averaging_callbacks
from lightning_zero.front.checkpoint_hooks import CheckpointHooks
from lightning_zero.front.precision import (
    ZeroPrecision,
    as_zero_precision,
    check_skip_on_device,
    hold_schedulers_on_skipped_steps,
    stage3_param_dtype,
)
from lightning_zero.front.stage3_hooks import Stage3Hooks
from lightning_zero.resilience.elastic import start_process_group
from lightning_zero.resilience.peer_failure import exit_if_peer_failed
from lightning_zero.resilience.preemption import end_on_signal_outside_training, ensure_preemption_callback
from lightning_zero.sharding import collectives
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.param_gather import ParamGathers
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.stage3_setup import ShardedModule
from lightning_zero.sharding.topology import Topology, topology_for


class ZeroStrategy(Stage3Hooks, CheckpointHooks, DDPStrategy):
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
        self.engine: ZeroEngine | None = None  # made with the process group (setup_environment)
        self._construction: ShardedConstruction | None = None  # stage 3, from configure_model to set-up
        self._averaging: list[pl.Callback] = []  # while fitting: Lightning's weight averaging, sharded
        self.traffic = collectives.Traffic()  # what this strategy's collectives covered while it was set up
        self._observing = ExitStack()  # from set-up to teardown: self.traffic and, if asked, the collective log
        self._loaded: checkpoint_io.LoadedCheckpoint | None = None  # between load_checkpoint and the restores
        self.topology = Topology(shard_rank=0, shard_size=1)  # made with the process group (setup_environment)

    @classmethod
    def from_deepspeed_config(cls, source: Any, *, ignore: tuple[str, ...] = ()) -> ZeroStrategy:
        """The strategy a DeepSpeed JSON config (path or dict) describes, its fp16 loss scaling included.

        Trainer arguments it also sets (clipping, accumulation) come from ``trainer_kwargs_from_deepspeed``.
        """
        settings = read_deepspeed_config(source, ignore=ignore)
        strategy = cls(settings.zero)
        if settings.precision is not None:
            strategy.precision_plugin = ZeroPrecision(settings.precision, loss_scale=settings.loss_scale)
        return strategy

    @classmethod
    def trainer_kwargs_from_deepspeed(cls, source: Any, *, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
        """Keyword arguments for ``Trainer`` from a DeepSpeed JSON config (the strategy and fp16 plugin included)."""
        settings = read_deepspeed_config(source, ignore=ignore)
        kwargs: dict[str, Any] = {"strategy": cls(settings.zero)}
        if settings.precision == "16-mixed":
            kwargs["plugins"] = [ZeroPrecision("16-mixed", loss_scale=settings.loss_scale)]
        elif settings.precision is not None:
            kwargs["precision"] = settings.precision
        for key in ("gradient_clip_val", "accumulate_grad_batches"):
            if getattr(settings, key) is not None:
                kwargs[key] = getattr(settings, key)
        return kwargs

    # --- precision --------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> ZeroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Accepts the plugin Lightning builds from ``Trainer(precision=...)`` and turns it into ours."""
        self._precision_plugin = as_zero_precision(plugin)

    # --- set-up -----------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        """Lightning's, except under torchrun's agent store: one store prefix per attempt (resilience/elastic.py)."""
        self.set_world_ranks()
        timeout = timedelta(seconds=self.config.timeout)
        start_process_group(
            self._get_process_group_backend(), self.global_rank, self.world_size, timeout, self.root_device
        )
        super().setup_distributed()  # finds the group made above, if any

    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:  # (SWA copies it in any run)
            # before the callbacks' setup, in which they would copy the whole model (see front/averaging.py)
            self._averaging = shard_averaging_callbacks(trainer.callbacks)
        self.topology = topology_for(self.topology, self.config, self.global_rank, self.world_size, self.num_processes)
        previous, self.engine = (
            self.engine,
            ZeroEngine(self.config, self.topology, self.root_device, rank=self.global_rank),
        )
        if previous is not None:  # what building the model sharded took stays readable in later runs (fit, then test)
            self.engine.sharded_init_peak_bytes = previous.sharded_init_peak_bytes

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.precision_plugin.device is None:
            self.precision_plugin.device = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            if self.root_device.type == "cpu":  # (ddp fails at the first forward)
                raise ValueError(
                    "sync_batchnorm=True: torch's SyncBatchNorm runs on CUDA only, and this run is on the CPU;"
                    " remove it (BatchNorm's running statistics are still rank 0's before every step and before"
                    " validation: ZeroConfig(broadcast_buffers=True), as ddp's default)"
                )
            self.model = self._layer_sync.apply(self.model)
        module = self.lightning_module
        sharded = ShardedModule.of(module)  # still sharded by an earlier stage-3 run
        construction = self._construction if self._construction is not None and self._construction.managed else None
        if sharded is None and construction is None:
            self.model = self.precision_plugin.convert_module(self.model)
        elif construction is not None:  # parameters are cast as they are made whole; buffers now
            self.precision_plugin.convert_buffers(module)
        on_meta = any(p.is_meta for p in module.parameters())
        if (on_meta or sharded is not None) and self.config.stage != 3:
            what = (
                "parameters on the meta device, which only stage 3 can materialize"
                if on_meta
                else "parameters sharded by an earlier zero3 run (call trainer.strategy.gather_module() after it)"
            )
            raise ValueError(f"the model has {what}; zero.stage is {self.config.stage}")
        if not on_meta and sharded is None:
            if construction is None:
                self.model_to_device()
            # every rank starts from rank 0's parameters and buffers (constructed ones agree already)
            skip = [n for n, p in module.named_parameters() if construction is not None and construction.owns(p)]
            torch_sync_module_states(module, _get_default_group(), 250 * 1024 * 1024, 0, skip)
        self._observing.close()
        self._observing.enter_context(collectives.observing(self.traffic))
        self.engine.record_collectives(self._observing)
        if fitting and self.config.stage == 3 and not on_meta:
            self.setup_optimizers(trainer)  # first, so that units can follow the optimizers (several of them)
        if self.config.stage == 3:
            dtype = stage3_param_dtype(self.precision_plugin, self.config.gather_dtype)
            kwargs = dict(training=fitting, dtype=dtype, construction=construction, optimizers=self.optimizers)
            self.engine.shard(module, **kwargs)
        self._construction = None
        if fitting:
            ensure_preemption_callback(trainer, save=self.config.checkpoint_on_signal)  # see resilience/preemption.py
            if self.config.stage < 3 or on_meta:
                self.setup_optimizers(trainer)
            # stage 1 reduces in the backward of a step's last micro-batch, which only automatic optimization tells
            marks = module.automatic_optimization
            self.optimizers = self.engine.wrap(module, self.optimizers, marks_micro_batches=marks)
            group = self.topology.shard_group
            self.engine.average = attach_average(self._averaging, module, self._units, group=group, settle=self._settle)
            if self.precision_plugin.skip_on_device:  # schedulers then step as under torch's GradScaler
                check_skip_on_device(self.optimizers, self.config.fused_step)
            elif self.precision_plugin.scaler is not None:
                hold_schedulers_on_skipped_steps(self.lr_scheduler_configs, self.optimizers)
        self.setup_precision_plugin()

    # --- steps -----------------------------------------------------------------------------------
    # [Note: stage-3 steps] A step gathers the root unit first; the forward ends when the step returns
    # (the schedule then serves the units this rank did not run), and the step ends after backward
    # (automatic optimization) or when the step returns (manual optimization, whose backward calls
    # happen inside it). The end of every backward reduces what is left (backward_end.py).
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_collectives()
        self.engine.begin_training_forward()
        output = super().training_step(*args, **kwargs)
        self.engine.end_training_forward(step_ends=not self.lightning_module.automatic_optimization)
        self._rng_after_step = rng.snapshot()  # see checkpoint_hooks.py [Note: generators across a resume]
        return output

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's micro-batches before the step's last: stage 1 only accumulates gradients locally."""
        with self.engine.no_sync():
            yield

    def _settle(self) -> None:
        """Waits for the post-step parameter all-gathers still running (before anything reads parameters)."""
        if self.engine is not None:
            self.engine.settle()

    def pre_backward(self, closure_loss: Tensor) -> None:
        self.engine.before_backward(closure_loss)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.lightning_module.automatic_optimization:
            self.engine.after_backward()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only_step(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only_step(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only_step(super().predict_step, *args, **kwargs)

    def _forward_only_step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """Stage 3: one forward-only step of a Join (see [Note: uneven inputs] in sharding/stage3.py)."""
        self._check_collectives()
        trainer = self.lightning_module.trainer

        def last() -> bool:  # this rank's loop has run out of batches
            return trainer._active_loop is not None and trainer._active_loop.batch_progress.is_last_batch

        return self.engine.forward_only(step, *args, last=last, **kwargs)

    def _check_collectives(self) -> None:
        self.engine.check_collectives(f"before global step {self.lightning_module.trainer.global_step}")

    def on_validation_start(self) -> None:
        super().on_validation_start()
        module = self.lightning_module
        end_on_signal_outside_training(module.trainer)  # see resilience/preemption.py
        trainer = module.trainer
        if (
            trainer.state.fn == TrainerFn.FITTING
            and not trainer.sanity_checking
            and not trainer.fit_loop.epoch_loop._should_accumulate()  # Lightning's condition for the hook
            and not is_overridden("on_validation_model_zero_grad", module)
        ):
            # Lightning's default hook has just released ddp's gradients (module.zero_grad): ours too, so that a
            # step with no backward after validation (SWA's BatchNorm epoch) applies none, as under ddp.
            self.engine.release_gradients()

    def on_test_start(self) -> None:
        super().on_test_start()
        end_on_signal_outside_training(self.lightning_module.trainer)

    def on_predict_start(self) -> None:
        super().on_predict_start()
        end_on_signal_outside_training(self.lightning_module.trainer)

    def on_exception(self, exception: BaseException) -> None:
        """A lost peer ends this rank with one line (resilience/peer_failure.py); other errors go on to teardown."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        loggers = trainer.loggers if trainer is not None else ()
        exit_if_peer_failed(exception, rank=self.global_rank, world_size=self.world_size, loggers=loggers)
        super().on_exception(exception)

    def teardown(self) -> None:
        """Releases hooks; a stage-3 module stays sharded where it is (nothing is gathered, even after an
        error): ``lightning_module_state_dict()`` or ``gather_module()`` make it whole when asked."""
        module = self.lightning_module
        if self.engine is not None:
            self.engine.teardown()
        self._pending_rng = self._rng_after_step = None
        detach_average(self._averaging)
        self._averaging = []
        self._observing.close()
        if module is not None and (self._stage3 is not None or any(p.is_meta for p in module.parameters())):
            # Lightning would move the module to the CPU: a sharded module stays put, and one whose set-up
            # failed before materializing has nothing to move ("Cannot copy out of meta tensor").
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()

    # --- introspection ----------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """This rank's persistent bytes by category, device and ``host_*`` (see ``memory.persistent_bytes``;
        stage 3's units gathered for a moment: ``peak_gathered_bytes``), and ``weight_average`` while a
        weight-averaging callback keeps one (this rank's share, sharding/averaging.py)."""
        totals = self.engine.memory_bytes()
        if self._average is not None:
            totals["weight_average"] = self._average.nbytes()
        return totals

    # What the engine holds, as earlier versions of this class held it (tests and benchmarks read these).
    @property
    def _average(self) -> WeightAverage | None:
        return self.engine.average if self.engine is not None else None

    @property
    def _collective_log(self) -> list | None:
        return self.engine.collective_log if self.engine is not None else None

    @property
    def _units(self) -> list[FlatUnit]:
        return self.engine.units if self.engine is not None else []

    @property
    def _stage3(self) -> Stage3Runtime | None:
        return self.engine.stage3 if self.engine is not None else None

    @property
    def _reducer(self) -> GradReducer | None:
        return self.engine.reducer if self.engine is not None else None

    @property
    def _gathers(self) -> ParamGathers | None:
        return self.engine.gathers if self.engine is not None else None

    @property
    def peak_gathered_bytes(self) -> int | None:
        """Stage 3: the most bytes of whole units at once during the last run (set at teardown)."""
        return self.engine.peak_gathered_bytes if self.engine is not None else None

    @property
    def sharded_init_peak_bytes(self) -> int | None:
        """Stage 3 built sharded: the most bytes whole at once while building (construct.py)."""
        return self.engine.sharded_init_peak_bytes if self.engine is not None else None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage, what in ((1, "optimizer state"), (2, "optimizer state and gradients"), (3, "everything")):
            strategy_registry.register(
                f"zero{stage}",
                cls,
                description=f"ZeRO stage {stage}: {what} sharded across data-parallel ranks",
                stage=stage,
            )

"""ZeroStrategy: the ZeRO engine (engine.py) behind the Trainer, on DDP's machinery where it is the same (launchers,
process group, sampler), told the step's boundaries (engine.py's Note); checkpoint hooks: trainer_checkpoints.py."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from functools import partial
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
from torch.nn import Module, Parameter

from lightning_zero.checkpoint.save import Observer
from lightning_zero.config import ZeroConfig
from lightning_zero.engine import ZeroEngine
from lightning_zero.front import deepspeed
from lightning_zero.front.averaging import attach_average, detach_average, shard_averaging_callbacks
from lightning_zero.front.precision import (
    ZeroPrecision,
    as_zero_precision,
    check_skip_on_device,
    hold_schedulers_on_skipped_steps,
    stage3_param_dtype,
)
from lightning_zero.front.prepare import apply_layer_sync, config_for, place_module
from lightning_zero.front.trainer_checkpoints import TrainerCheckpoints
from lightning_zero.resilience.elastic import start_process_group
from lightning_zero.resilience.peer_failure import exit_if_peer_failed
from lightning_zero.resilience.preemption import end_on_signal_outside_training, ensure_preemption_callback
from lightning_zero.sequence.hf import attach_ulysses
from lightning_zero.sequence.parallel import SequenceParallel, groups_for
from lightning_zero.sharding import collectives
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.stage3_setup import ShardedModule
from lightning_zero.sharding.topology import Topology, topology_for


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism for the Trainer: optimizer state (stage 1), gradients (2) and parameters (3) sharded.

    Args:
        config: the typed configuration; ``ZeroConfig()`` by default (its ``timeout`` is the process group's).
        stage: shortcut that overrides ``config.stage``.
        accelerator: as ``DDPStrategy``'s (the Trainer sets it).
        parallel_devices: as ``DDPStrategy``'s (the Trainer sets them).
        cluster_environment: as ``DDPStrategy``'s (the Trainer sets it).
        checkpoint_io: as ``DDPStrategy``'s; the sharded checkpoints are written and read without it.
        precision_plugin: a ``ZeroPrecision``; Lightning's, from ``Trainer(precision=...)``, is converted to one.
        process_group_backend: as ``DDPStrategy``'s (None: "nccl" on CUDA, else "gloo").
        start_method: how Lightning starts the processes: "popen" (re-runs the script, as ddp) or "spawn" (tests).
        on_save_phase: ``on_save_phase(phase, path)`` at each point a save or removal reaches (checkpoint/save.py).

    Raises:
        TypeError: ``config`` is not a ``ZeroConfig``, or a ddp option (``find_unused_parameters``) is given.
        ValueError: a bad ``stage`` or precision; at set-up, a model, optimizer or group size it cannot run (says why).
        CheckpointError: a checkpoint that cannot be saved or loaded: the same one line on every rank.
        RuntimeError: with ``config.check_collectives``, ranks that issued different collectives (on every rank)."""

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
        on_save_phase: Observer | None = None,
    ) -> None:
        self.config = config_for(config, stage)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=self.config.timeout),
            start_method=start_method,
        )
        self.engine: ZeroEngine | None = None  # made with the process group (setup_environment), one per run
        self.topology = Topology(shard_rank=0, shard_size=1)  # likewise
        self.sequence_parallel: SequenceParallel | None = None  # likewise: config.sequence_parallel_size's groups
        self.checkpoints = TrainerCheckpoints(on_phase=on_save_phase)
        self.traffic = collectives.Traffic()  # what this strategy's collectives covered while it was set up
        self._construction: ShardedConstruction | None = None  # stage 3, from configure_model to set-up
        self._averaging: list[pl.Callback] = []  # while fitting: Lightning's weight averaging, sharded
        self._observing = ExitStack()  # set-up to teardown: self.traffic, the collective log if asked, HF models' SP

    @classmethod
    def from_deepspeed_config(cls, source: Any, *, ignore: tuple[str, ...] = ()) -> ZeroStrategy:
        """The strategy (fp16 loss scaling included) the DeepSpeed JSON ``source`` (path or dict) describes, less
        the top-level keys in ``ignore``; a key it does not support or a bad value raises a ValueError naming it."""
        return deepspeed.strategy(cls, source, ignore=ignore)

    @classmethod
    def trainer_kwargs_from_deepspeed(cls, source: Any, *, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
        """``Trainer`` kwargs (strategy, precision or fp16 plugin, clipping, accumulation) from ``source``, as above."""
        return deepspeed.trainer_kwargs(cls, source, ignore=ignore)

    @property
    def precision_plugin(self) -> ZeroPrecision:
        """Ours: the plugin Lightning builds from ``Trainer(precision=...)`` is turned into a ZeroPrecision."""
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = as_zero_precision(plugin)

    def setup_distributed(self) -> None:
        """Lightning's, except under torchrun's agent store: one store prefix per attempt (resilience/elastic.py)."""
        self.set_world_ranks()
        backend, timeout = self._get_process_group_backend(), timedelta(seconds=self.config.timeout)
        start_process_group(backend, self.global_rank, self.world_size, timeout, self.root_device)
        super().setup_distributed()  # finds the group made above, if any

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.lightning_module is not None:  # before the callbacks' setup, in which they would copy the model
            self._averaging = shard_averaging_callbacks(self.lightning_module.trainer.callbacks)  # averaging.py
        self.topology = topology_for(self.topology, self.config, self.global_rank, self.world_size, self.num_processes)
        self.sequence_parallel = groups_for(self.sequence_parallel, self.config, timeout=self._timeout)
        built = self.engine.sharded_init_peak_bytes if self.engine is not None else None  # stays readable in later runs
        self.engine = ZeroEngine(
            self.config, self.topology, self.root_device, rank=self.global_rank, sharded_init_peak_bytes=built
        )

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        precision, fitting = self.precision_plugin, trainer.state.fn == TrainerFn.FITTING
        precision.device = precision.device or self.root_device.type
        if fitting and self._layer_sync:
            self.model = apply_layer_sync(self._layer_sync, self.model, self.root_device)
        self.model, construction = place_module(
            self.model, precision, stage=self.config.stage, device=self.root_device, construction=self._construction
        )
        self._construction, module = None, self.lightning_module
        self._observing.close()
        self._observing.enter_context(collectives.observing(self.traffic))
        self._observing.callback(attach_ulysses(module, self.sequence_parallel))  # (HF models: sequence/hf.py)
        self.engine.record_collectives(self._observing)
        on_meta = any(p.is_meta for p in module.parameters())
        if self.config.stage == 3:
            if fitting and not on_meta:
                self.setup_optimizers(trainer)  # first, so that units can follow the optimizers (several of them)
            dtype = stage3_param_dtype(precision, self.config.gather_dtype)
            optimizers = self.optimizers
            self.engine.shard(module, training=fitting, dtype=dtype, construction=construction, optimizers=optimizers)
        if fitting:
            ensure_preemption_callback(trainer, save=self.config.checkpoint_on_signal)  # resilience/preemption.py
            if self.config.stage < 3 or on_meta:
                self.setup_optimizers(trainer)
            # stage 1 reduces in the backward of a step's last micro-batch, which only automatic optimization tells
            marks, group = module.automatic_optimization, self.topology.shard_group
            average = partial(attach_average, self._averaging, module, group=group)
            self.optimizers = self.engine.wrap(module, self.optimizers, marks_micro_batches=marks, make_average=average)
            if precision.skip_on_device:  # schedulers then step as under torch's GradScaler
                check_skip_on_device(self.optimizers, self.config.fused_step)
            elif precision.scaler is not None:
                hold_schedulers_on_skipped_steps(self.lr_scheduler_configs, self.optimizers)
        self.setup_precision_plugin()

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 builds ``configure_model``'s modules for real but never whole (sharding/construct.py)."""
        if self.config.stage != 3:
            yield
            return
        self._construction = self.engine.construction()
        with self._construction:
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """A step ends after its backward, or under manual optimization with this call ([Note] in engine.py)."""
        self.engine.check_collectives(f"before global step {self.lightning_module.trainer.global_step}")
        self.engine.begin_training_forward()
        output = super().training_step(*args, **kwargs)
        self.engine.end_training_forward(step_ends=not self.lightning_module.automatic_optimization)
        self.checkpoints.training_step_ended()
        return output

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's micro-batches before the step's last: stage 1 only accumulates gradients locally."""
        with self.engine.no_sync():
            yield

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
        trainer = self.lightning_module.trainer

        def last() -> bool:  # this rank's loop has run out of batches
            return trainer._active_loop is not None and trainer._active_loop.batch_progress.is_last_batch

        where = f"before global step {trainer.global_step}"
        return self.engine.forward_only(step, *args, last=last, checked_as=where, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.checkpoints.training_batch_starts()  # see [Note: generators across a resume]

    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer
        end_on_signal_outside_training(trainer)  # see resilience/preemption.py
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.checkpoints.fit_validation_starts()  # see [Note: generators across a resume]
        if (
            trainer.state.fn == TrainerFn.FITTING
            and not trainer.sanity_checking
            and not trainer.fit_loop.epoch_loop._should_accumulate()  # Lightning's condition for the hook
            and not is_overridden("on_validation_model_zero_grad", self.lightning_module)
        ):
            # as Lightning's default hook released ddp's gradients: ours too (SWA's BatchNorm epoch applies none)
            self.engine.release_gradients()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.checkpoints.fit_validation_ended(self.engine, self.world_size)  # [Note: generators across a resume]

    def on_test_start(self) -> None:
        super().on_test_start()
        end_on_signal_outside_training(self.lightning_module.trainer)

    def on_predict_start(self) -> None:
        super().on_predict_start()
        end_on_signal_outside_training(self.lightning_module.trainer)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The sampler's ``num_replicas`` and ``rank``: the ranks of a sequence-parallel group are one replica."""
        return self.sequence_parallel.sampler_kwargs() if self.sequence_parallel else super().distributed_sampler_kwargs

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: a sharded checkpoint is loaded into the units, which exist after set-up."""
        return True

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # sharded: each rank writes its own part in save_checkpoint; nothing is gathered

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What Lightning's checkpoint holds of the model: the state dict by reference, nothing gathered or copied
        (``save_checkpoint`` writes each rank's shards; stage 3's sharded parameters are in it as themselves)."""
        module = self.lightning_module
        return self.engine.checkpoint_state_dict(module) if self.engine is not None else module.state_dict()

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole state dict on every rank, on the CPU, in fp32 (the masters), one unit at a time. Collective."""
        return self.engine.full_state_dict(self.lightning_module)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Writes the checkpoint as a directory: each rank its own shards (collective; see checkpoint/format.py)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        module, optimizers, world_size = self.lightning_module, self.optimizers, self.world_size
        self.checkpoints.save(
            self.engine, checkpoint, filepath, module=module, optimizers=optimizers, world_size=world_size
        )

    def finish_saves(self) -> None:
        """Waits for a save finishing in the background (``ZeroConfig(async_save=True)``); raises its error."""
        if self.engine is not None:
            self.engine.finish_saves()

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k: hidden first, then deleted, so a half-removed one is never visible; after the
        save that replaces it has succeeded, when saves finish in the background."""
        self.checkpoints.remove(self.engine, filepath, rank=self.global_rank)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Opens a sharded checkpoint directory (any world size and stage), a plain Lightning checkpoint file (ddp's,
        one device's) or a DCP directory (FSDP2's). Pickled state: ``weights_only=True`` (the module's hyper-parameter
        dataclasses allowed) unless ``weights_only=False`` (Lightning does not pass on ``trainer.fit``'s)."""
        module, trusted = self.lightning_module, weights_only is False
        return self.checkpoints.open(
            self.engine, checkpoint_path, module=module, optimizers=self.optimizers, trusted=trusted
        )

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The weights (and weight average) of the checkpoint ``load_checkpoint`` opened; the arguments are unused."""
        self.checkpoints.load_model(self.lightning_module)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The optimizers' sharded state from the checkpoint ``load_checkpoint`` opened (``checkpoint`` unused)."""
        self.checkpoints.load_optimizers(self.optimizers)

    @contextmanager
    def gathered_parameters(
        self, *targets: Module | Parameter, modifier_rank: int | None = None
    ) -> Generator[list[Parameter], None, None]:
        """The parameters of ``targets`` whole inside the block (collective; see lightning_zero.gathered_parameters)."""
        with self.engine.gathered_parameters(targets, modifier_rank) as params:
            yield params

    def gather_module(self, device: str | torch.device = "cpu") -> pl.LightningModule:
        """Stage 3, after ``fit``/``validate``/...: the LightningModule made whole on ``device`` (collective)."""
        module = self.lightning_module
        if self.engine is not None:
            self.engine.gather_module(module, torch.device(device))
        return module.to(device)

    def parameter_norms(self, norm_type: float = 2.0) -> dict[str, Any]:
        """Each parameter's ``norm_type``-norm and the total, from the shards (collective; anywhere)."""
        return self.engine.parameter_norms(self.lightning_module, norm_type)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's persistent bytes by category (see ``ZeroEngine.memory_bytes``)."""
        return self.engine.memory_bytes()

    @property
    def peak_gathered_bytes(self) -> int | None:
        """Stage 3: the most bytes of whole units at once during the last run (set at teardown)."""
        return self.engine.peak_gathered_bytes if self.engine is not None else None

    @property
    def sharded_init_peak_bytes(self) -> int | None:
        """Stage 3 built sharded: the most bytes whole at once while building (construct.py)."""
        return self.engine.sharded_init_peak_bytes if self.engine is not None else None

    def on_exception(self, exception: BaseException) -> None:
        """A lost peer ends this rank with one line (resilience/peer_failure.py); other errors go on to teardown."""
        loggers = self.lightning_module.trainer.loggers if self.lightning_module is not None else ()
        exit_if_peer_failed(exception, rank=self.global_rank, world_size=self.world_size, loggers=loggers)
        super().on_exception(exception)

    def teardown(self) -> None:
        """Releases hooks; a stage-3 module stays sharded where it is, nothing gathered, even after an error."""
        module, failed = self.lightning_module, None
        try:
            if self.engine is not None:
                self.engine.teardown()
        except Exception as error:  # (a background save's failure: raised once everything else is released)
            failed = error
        self._release(module)
        if failed is not None:
            raise failed

    def _release(self, module: pl.LightningModule | None) -> None:
        self.checkpoints.clear()
        detach_average(self._averaging)
        self._averaging = []
        self._observing.close()
        sharded = module is not None and ShardedModule.of(module) is not None  # (by this run or an earlier one)
        if module is None or not (sharded or any(p.is_meta for p in module.parameters())):
            super().teardown()
            return
        # Lightning moves it to the CPU: not a sharded one (it stays put), nor one a failed set-up left on meta
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``zero1``, ``zero2`` and ``zero3`` (this class at that stage); ``import lightning_zero`` does."""
        for stage, what in ((1, "optimizer state"), (2, "optimizer state and gradients"), (3, "everything")):
            strategy_registry.register(
                f"zero{stage}",
                cls,
                description=f"ZeRO stage {stage}: {what} sharded across data-parallel ranks",
                stage=stage,
            )

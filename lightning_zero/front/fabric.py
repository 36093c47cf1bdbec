"""ZeroFabricStrategy: the ZeRO engine behind Lightning Fabric (``Fabric(strategy="zero1"|"zero2"|"zero3")``); the
step's boundaries a Fabric program marks (engine.py's [Note]) and its checkpoints: the class's docstring.

[Note: several models]
Each model set up (``fabric.setup`` or ``fabric.setup_module``: a student and its frozen teacher) gets an engine
of its own, with its own units and, at stage 3, its own schedule: a model set up without optimizers has no
optimizer state, and at stage 3 its parameters are sharded and gathered by its schedule alone, whenever it is
called (inside another model's step too: its gathers follow its own calls, the same on every rank, and touch
no other engine's bookkeeping). A parameter belongs to one engine: models that share one are set up as one
module. A backward belongs to the engines whose models ran a training forward since the last backward (a loss
made through none of them: the engines with optimizers); ``no_backward_sync``, ``clip_gradients``, the step
and the state dict go to the model's or optimizer's own engine. A checkpoint holds one model, with its own
optimizers (as Lightning's FSDP and DeepSpeed strategies for Fabric): a checkpoint directory is one model's
shards, which the Trainer, ``consolidate`` and ``load_pretrained`` read as that model.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy, _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.checkpoint.hugging_face import HUGGING_FACE
from lightning_zero.config import ZeroConfig
from lightning_zero.engine import ZeroEngine
from lightning_zero.front.precision import ZeroPrecision, as_zero_precision, check_skip_on_device, stage3_param_dtype
from lightning_zero.front.prepare import check_not_shared, config_for, construction_of, place_module
from lightning_zero.resilience.elastic import start_process_group
from lightning_zero.sequence.hf import attach_ulysses
from lightning_zero.sequence.parallel import SequenceParallel, groups_for
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.stage3_setup import ShardedModule
from lightning_zero.sharding.topology import Topology, topology_for
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer

INTERNAL_KEYS = (
    "state_dict",
    "optimizer_states",
    "optimizer_groups",
    "lr_schedulers",
    "pytorch-lightning_version",
    ZeroPrecision.__qualname__,
    HUGGING_FACE,
)


class ZeroModule(Module):
    """The module ``fabric.setup`` returns (inside Fabric's wrapper): each call is a forward its engine knows of;
    a training one is reported to ``trains(engine)`` (the strategy's: that engine's step has begun)."""

    def __init__(self, module: Module, engine: ZeroEngine, trains: Callable[[ZeroEngine], None]) -> None:
        super().__init__()
        self.module = module
        self.engine = [engine]  # (in a list: not a submodule)
        self.trains = trains
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine[0]
        self.calls += 1
        where = f"before call {self.calls} of the model"
        if not torch.is_grad_enabled():  # (whatever the mode: a model in eval() mode may still be trained)
            return engine.forward_only(self.module, *args, checked_as=where, **kwargs)
        engine.check_collectives(where)
        engine.begin_training_forward()
        self.trains(engine)
        output = self.module(*args, **kwargs)
        engine.end_training_forward()
        return output


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """``module``: the ``ZeroModule`` (Fabric passes what ``setup`` returned), whose engine skips its sync."""
        return module.engine[0].no_sync() if enabled else nullcontext()


def _zero(optimizer: Any) -> ZeroOptimizer:
    optimizer = getattr(optimizer, "optimizer", optimizer) if not isinstance(optimizer, ZeroOptimizer) else optimizer
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"expected an optimizer set up by fabric.setup under a ZeRO strategy, got {type(optimizer)}")
    return optimizer


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO data parallelism for Lightning Fabric: ``Fabric(strategy="zero2")``, or this class for options.

    A Fabric program marks the step's boundaries itself: each call of the model ``fabric.setup`` returns is a
    forward (a training one when gradients are enabled), ``fabric.backward`` the backward, ``optimizer.step()`` the
    step, and ``fabric.no_backward_sync(model, enabled=...)`` the micro-batches before a step's last. Forward-only
    calls (under ``torch.no_grad()``) must run as many times on every rank under stage 3 (as under FSDP): Fabric has
    no loop that could tell when a rank ran out of batches. Each model set up (``fabric.setup``, or
    ``fabric.setup_module`` for a frozen teacher) gets an engine of its own (the module's [Note: several models]).

    Checkpoints are the Trainer's format: ``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})``
    writes each rank's shards and the other entries (with the keys a Trainer resumes from); ``fabric.load`` reads
    a Fabric or Trainer checkpoint at any world size and stage, restores ``state``'s objects and returns the other
    entries. A checkpoint holds one model, with its own optimizers. Both are collective: every rank calls them.

    Args:
        config: the typed configuration; ``ZeroConfig()`` by default (its ``timeout`` is the process group's).
        stage: shortcut that overrides ``config.stage``.
        accelerator: as ``DDPStrategy``'s (Fabric sets it).
        parallel_devices: as ``DDPStrategy``'s (Fabric sets them).
        cluster_environment: as ``DDPStrategy``'s (Fabric sets it).
        checkpoint_io: as ``DDPStrategy``'s; the sharded checkpoints are written and read without it.
        precision: a ``ZeroPrecision``; Fabric's, from ``Fabric(precision=...)``, is converted to one.
        process_group_backend: as ``DDPStrategy``'s (None: "nccl" on CUDA, else "gloo").
        start_method: how the processes are started: "popen" (re-runs the script) or "spawn", "fork", "forkserver".

    Raises:
        TypeError: ``config`` is not a ``ZeroConfig``; ``fabric.save`` given ``storage_options`` or a ``filter``;
            an optimizer not set up by ``fabric.setup`` under this strategy.
        ValueError: a bad ``stage`` or precision; at set-up, a model, optimizer or group size it cannot run, or a
            model sharing parameters with one set up before; ``fabric.save``/``load`` of several models at once;
            ``clip_gradients`` with a ``norm_type`` other than 2.
        RuntimeError: ``clip_gradients(max_norm=...)`` on a non-finite norm (with ``error_if_nonfinite``).
        CheckpointError: a checkpoint that cannot be saved or loaded: the same one line on every rank.
        KeyError: ``fabric.load(path, state)`` (``strict=True``) of a checkpoint lacking an entry of ``state``.
    """

    def __init__(
        self,
        config: ZeroConfig | None = None,
        *,
        stage: int | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.config = config_for(config, stage)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=self.config.timeout),
            start_method=start_method,
        )
        self._backward_sync_control = _NoSync()
        self.topology = Topology(shard_rank=0, shard_size=1)
        self.sequence_parallel: SequenceParallel | None = None  # config.sequence_parallel_size's groups (set-up)
        self.engine: ZeroEngine | None = None  # the first model's (see [Note: several models])
        self.engines: list[ZeroEngine] = []  # one per set-up, in order (a failed one's too: torn down at the end)
        self.models: list[ZeroModule] = []  # the models set up, each with its engine
        self._training: list[ZeroEngine] = []  # engines whose model ran a training forward since the last backward
        self._constructions: list[ShardedConstruction] = []  # stage 3: init_module's, until their models are set up
        self._steps = 0  # optimizer steps taken (for messages)
        self._observing = ExitStack()  # set-up to teardown: the collective log if asked, HF models' SP attention

    @property
    def precision(self) -> ZeroPrecision:
        """Ours: the plugin Fabric builds from ``Fabric(precision=...)`` is turned into a ZeroPrecision."""
        if not isinstance(self._precision, ZeroPrecision):
            self._precision = ZeroPrecision("32-true")
        return self._precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = as_zero_precision(plugin)

    def _setup_distributed(self) -> None:
        """Fabric's, after the same process-group start as the Trainer's (resilience/elastic.py)."""
        self._set_world_ranks()
        timeout = timedelta(seconds=self.config.timeout)
        start_process_group(
            self._get_process_group_backend(), self.global_rank, self.world_size, timeout, self.root_device
        )
        super()._setup_distributed()  # finds the group made above, if any

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.precision.device is None:
            self.precision.device = self.root_device.type
        self.topology = topology_for(self.topology, self.config, self.global_rank, self.world_size, self.num_processes)
        self.sequence_parallel = groups_for(self.sequence_parallel, self.config, timeout=self._timeout)
        self.engine = self._new_engine()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``fabric.setup_dataloaders``' sampler's ``num_replicas`` and ``rank``: a sequence-parallel group is one."""
        return self.sequence_parallel.sampler_kwargs() if self.sequence_parallel else super().distributed_sampler_kwargs

    def _new_engine(self) -> ZeroEngine:
        return ZeroEngine(self.config, self.topology, self.root_device, rank=self.global_rank)

    # --- set-up ------------------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: stage 3 builds the module sharded, never whole (sharding/construct.py)."""
        if self.config.stage != 3:
            return super().module_init_context(empty_init)
        return self._constructing()

    @contextmanager
    def _constructing(self) -> Generator[None, None, None]:
        construction = self.engine.construction()  # (made of the engines' topology and device: any engine's)
        self._constructions.append(construction)
        with ExitStack() as stack:
            stack.enter_context(self.root_device)
            stack.enter_context(construction)
            yield

    def module_to_device(self, module: Module) -> None:
        check_not_shared(module, [model.module for model in self.models])  # (before .to() reads a sharded one)
        on_meta = any(p.is_meta for p in module.parameters())  # (materialized at set-up)
        constructed = construction_of(module, self._constructions) is not None
        if ShardedModule.of(module) is None and not constructed and not on_meta:
            module.to(self.root_device)

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None):
        module, engine = self._prepare(module, training=True, optimizers=optimizers)
        zero = engine.wrap(module, optimizers)
        if self.precision.skip_on_device:
            check_skip_on_device(zero, self.config.fused_step)
        return self._set_up(module, engine), zero, scheduler

    def setup_module(self, module: Module) -> Module:
        """A module set up without optimizers: evaluated, or a frozen teacher (stage 3: sharded for it)."""
        return self._set_up(*self._prepare(module, training=False, optimizers=[]))

    def _prepare(self, module: Module, *, training: bool, optimizers: list[Optimizer]) -> tuple[Module, ZeroEngine]:
        """``module`` placed (stage 3: sharded) by an engine of its own (see [Note: several models])."""
        check_not_shared(module, [model.module for model in self.models])
        engine = self._new_engine() if self.engines else self.engine
        self.engines.append(engine)
        engine.record_collectives(self._observing)
        self._observing.callback(attach_ulysses(module, self.sequence_parallel))  # (HF models: sequence/hf.py)
        construction = construction_of(module, self._constructions)
        stage, device = self.config.stage, self.root_device
        module, construction = place_module(
            module, self.precision, stage=stage, device=device, construction=construction
        )
        if stage == 3:
            dtype = stage3_param_dtype(self.precision, self.config.gather_dtype)
            engine.shard(module, training=training, dtype=dtype, construction=construction, optimizers=optimizers)
        self._constructions = [c for c in self._constructions if c.managed]  # (what still builds another model)
        return module, engine

    def _set_up(self, module: Module, engine: ZeroEngine) -> ZeroModule:
        model = ZeroModule(module, engine, self._trains)
        self.models.append(model)
        return model

    def _trains(self, engine: ZeroEngine) -> None:
        if engine not in self._training:
            self._training.append(engine)

    def _model_of(self, module: Module) -> ZeroModule:
        """A model set up here, given as Fabric's wrapper, ours, or the module itself."""
        module = getattr(module, "_forward_module", module)  # (Fabric's wrapper)
        found = [model for model in self.models if module is model or module is model.module]
        if not found:
            raise ValueError(f"this {type(module).__name__} was not set up by fabric.setup under this strategy")
        return found[0]

    # --- steps -------------------------------------------------------------------------------------
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """The backward of the engines whose models ran a training forward since the last backward (for a loss
        made through none: of those with optimizers; see [Note: several models])."""
        engines = self._training or [engine for engine in self.engines if engine.optimizers]
        self._training = []
        for engine in engines:
            engine.before_backward(tensor)
        optimizers = [optimizer for engine in engines for optimizer in engine.optimizers]
        self.precision.scale_loss(tensor, optimizers).backward(*args, **kwargs)
        for engine in engines:
            engine.after_backward()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._steps += 1
        return self.precision.zero_step(_zero(optimizer), step_number=self._steps, **kwargs)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        if float(norm_type) != 2.0:
            raise ValueError(f"the ZeRO strategies clip by the L2 norm (norm_type=2), got norm_type={norm_type}")
        zero = _zero(optimizer)
        self.precision.clip_grad_by_norm(zero, max_norm)
        norm = self.precision.last_grad_norm
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"the total norm of the gradients is non-finite ({float(norm)}), so it cannot be clipped"
            )
        return norm

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.clip_grad_by_value(_zero(optimizer), clip_val)

    # --- checkpoints -------------------------------------------------------------------------------
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The whole state dict on every rank (fp32 masters where training is mixed). Collective."""
        model = self._model_of(module)
        return model.engine[0].full_state_dict(model.module)

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: dict | None = None
    ) -> None:
        """Writes ``state`` as a sharded checkpoint directory (collective: every rank calls it)."""
        if storage_options is not None or filter:
            raise TypeError("the ZeRO strategies save sharded checkpoints: storage_options and filter are not taken")
        engine, module, optimizers = self._stateful(state)
        other = {k: v for k, v in state.items() if not isinstance(v, (Module, Optimizer))}
        checkpoint = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in other.items()}
        checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)  # what a Trainer resuming it reads
        if optimizers:  # (their state itself is in the shards; no scheduler state: a Fabric program keeps its own)
            checkpoint.update(optimizer_states=[{} for _ in optimizers], lr_schedulers=[])
        if optimizers and self.precision.state_dict():  # the loss scale: the optimizers' (another model's load
            checkpoint[ZeroPrecision.__qualname__] = self.precision.state_dict()  # must not set it)
        engine.save(checkpoint, path, module=module, optimizers=optimizers)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restores the model, optimizers and stateful objects in ``state`` from a sharded checkpoint (the
        Trainer's or Fabric's, any world size and stage); returns the other entries. Collective."""
        state = state if isinstance(state, dict) else {"model": state} if isinstance(state, Module) else {}
        engine, module, optimizers = self._stateful(state)
        for any_engine in self.engines:  # (a save of ours may still be finishing in the background)
            any_engine.finish_saves()
        named = module if module is not None else next((m.module for m in self.models if m.engine[0] is engine), None)
        restore = engine.load(path, module=named, optimizers=optimizers, trusted=weights_only is False)
        saved = dict(restore.lightning)
        other = [k for k, v in state.items() if not isinstance(v, (Module, Optimizer))]
        missing = [k for k in other if k not in saved]
        if len(optimizers) > restore.optimizer_count:
            missing.append(f"the state of {len(optimizers)} optimizers (it has {restore.optimizer_count})")
        if strict and missing:
            raise KeyError(f"{path}: the checkpoint has no {missing}; it has {sorted(saved)}")
        if module is not None:
            restore.model(module)
        restore.optimizers(optimizers)
        if optimizers:
            self.precision.load_state_dict(saved.get(ZeroPrecision.__qualname__, {}))
        for key in other:  # as Fabric's own load: stateful objects load theirs, plain values are replaced
            if key in saved and isinstance(state[key], _Stateful):
                state[key].load_state_dict(saved.pop(key))
            elif key in saved:
                state[key] = saved.pop(key)
        return {k: v for k, v in saved.items() if k not in INTERNAL_KEYS and not k.startswith("averaged")}

    def _stateful(self, state: dict[str, Any]) -> tuple[ZeroEngine, Module | None, list[ZeroOptimizer]]:
        """The engine a checkpoint's ``state`` is of, its model (if in it) and optimizers: one model's, with its
        own optimizers (see [Note: several models]); raised on every rank alike, before anything is written."""
        models = {k: self._model_of(v) for k, v in state.items() if isinstance(v, Module)}
        if len(models) > 1:
            raise ValueError(
                f"a ZeRO checkpoint holds one model, got {len(models)} ({', '.join(models)}): save each model with"
                " its own optimizers to a path of its own (fabric.save(path / 'student', {'model': student,"
                " 'optimizer': optimizer}); fabric.save(path / 'teacher', {'model': teacher})), and load each so"
            )
        optimizers = {k: _zero(v) for k, v in state.items() if isinstance(v, Optimizer)}
        owners = [model.engine[0] for model in models.values()]
        owners += [next((e for e in self.engines if o in e.optimizers), None) for o in optimizers.values()]
        if any(owner is None or owner is not owners[0] for owner in owners):
            raise ValueError(
                f"a ZeRO checkpoint holds one model with its own optimizers; {[*models, *optimizers]} are not all"
                " of one model set up here"
            )
        engine = owners[0] if owners else self.engine
        return engine, next((model.module for model in models.values()), None), list(optimizers.values())

    def teardown(self) -> None:
        """Every engine's (each released, whatever another raised), then Fabric's."""
        with ExitStack() as releasing:
            releasing.callback(super().teardown)
            releasing.callback(self._observing.close)
            for engine in [self.engine, *self.engines[1:]] if self.engine is not None else []:  # (engines[0]: engine)
                releasing.callback(engine.teardown)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``zero1``, ``zero2`` and ``zero3`` (this class at that stage); ``import lightning_zero`` does."""
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"zero{stage}", cls, description=f"ZeRO stage {stage} (lightning_zero)", stage=stage
            )

"""ZeroFabricStrategy: the ZeRO engine behind Lightning Fabric (``Fabric(strategy="zero1"|"zero2"|"zero3")``).

A Fabric program marks the step's boundaries itself (engine.py's [Note: the step's boundaries]): each call
of the model set up by ``fabric.setup`` is a forward (a training one when gradients are enabled),
``fabric.backward`` the backward, ``optimizer.step()`` the step, and
``fabric.no_backward_sync(model, enabled=...)`` the micro-batches before a step's last. Forward-only calls
(under ``torch.no_grad()``) must run as many times on every rank under stage 3 (as under FSDP): Fabric has
no loop that could tell when a rank ran out of batches. One model per strategy: set up several as one module.

Checkpoints are the Trainer's format (checkpoint/format.py): ``fabric.save(path, {"model": model,
"optimizer": optimizer, "step": 3})`` writes each rank's shards and the other entries into ``lightning.pt``,
with the keys a Trainer resumes from (``optimizer_states``, the precision plugin's state); ``fabric.load``
reads a checkpoint of either, at any world size and stage, and returns what it did not restore.
"""

from __future__ import annotations

from collections.abc import Generator
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

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.checkpoint.hugging_face import HUGGING_FACE
from lightning_zero.config import ZeroConfig
from lightning_zero.engine import ZeroEngine
from lightning_zero.front.precision import ZeroPrecision, as_zero_precision, check_skip_on_device, stage3_param_dtype
from lightning_zero.front.prepare import config_for, place_module
from lightning_zero.resilience.elastic import start_process_group
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
    """The module ``fabric.setup`` returns (inside Fabric's wrapper): each call is a forward the engine knows of."""

    def __init__(self, module: Module, engine: ZeroEngine) -> None:
        super().__init__()
        self.module = module
        self.engine = [engine]  # (in a list: not a submodule)
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine[0]
        self.calls += 1
        where = f"before call {self.calls} of the model"
        if not torch.is_grad_enabled():  # (whatever the mode: a model in eval() mode may still be trained)
            return engine.forward_only(self.module, *args, checked_as=where, **kwargs)
        engine.check_collectives(where)
        engine.begin_training_forward()
        output = self.module(*args, **kwargs)
        engine.end_training_forward()
        return output


class _NoSync(_BackwardSyncControl):
    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self.strategy.engine.no_sync() if enabled else nullcontext()


def _zero(optimizer: Any) -> ZeroOptimizer:
    optimizer = getattr(optimizer, "optimizer", optimizer) if not isinstance(optimizer, ZeroOptimizer) else optimizer
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"expected an optimizer set up by fabric.setup under a ZeRO strategy, got {type(optimizer)}")
    return optimizer


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO data parallelism for Fabric. Args: as ``ZeroStrategy``'s (``config``, ``stage``, ``start_method``)."""

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
        self._backward_sync_control = _NoSync(self)
        self.topology = Topology(shard_rank=0, shard_size=1)
        self.engine: ZeroEngine | None = None
        self._construction: ShardedConstruction | None = None  # stage 3, from fabric.init_module to set-up
        self._steps = 0  # optimizer steps taken (for messages)
        self._observing = ExitStack()  # from set-up to teardown: with config.check_collectives, the collective log

    @property
    def precision(self) -> ZeroPrecision:
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
        self.engine = ZeroEngine(self.config, self.topology, self.root_device, rank=self.global_rank)

    # --- set-up ------------------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: stage 3 builds the module sharded, never whole (sharding/construct.py)."""
        if self.config.stage != 3:
            return super().module_init_context(empty_init)
        return self._constructing()

    @contextmanager
    def _constructing(self) -> Generator[None, None, None]:
        self._construction = self.engine.construction()
        with ExitStack() as stack:
            stack.enter_context(self.root_device)
            stack.enter_context(self._construction)
            yield

    def module_to_device(self, module: Module) -> None:
        on_meta = any(p.is_meta for p in module.parameters())  # (materialized at set-up)
        if ShardedModule.of(module) is None and self._construction is None and not on_meta:
            module.to(self.root_device)

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None):
        module = self._prepare(module, training=True, optimizers=optimizers)
        zero = self.engine.wrap(module, optimizers)
        if self.precision.skip_on_device:
            check_skip_on_device(zero, self.config.fused_step)
        return ZeroModule(module, self.engine), zero, scheduler

    def setup_module(self, module: Module) -> Module:
        """A module set up without optimizers: evaluated (stage 3: sharded for it)."""
        return ZeroModule(self._prepare(module, training=False, optimizers=[]), self.engine)

    def _prepare(self, module: Module, *, training: bool, optimizers: list[Optimizer]) -> Module:
        if self.engine.module is not None:
            raise RuntimeError(
                "a ZeRO Fabric strategy sets up one model (its engine shards it and steps its optimizers); got a"
                " second fabric.setup: put the models in one nn.Module and set that up once"
            )
        self.engine.record_collectives(self._observing)
        construction, self._construction = self._construction, None
        stage, device = self.config.stage, self.root_device
        module, construction = place_module(
            module, self.precision, stage=stage, device=device, construction=construction
        )
        if stage == 3:
            dtype = stage3_param_dtype(self.precision, self.config.gather_dtype)
            self.engine.shard(module, training=training, dtype=dtype, construction=construction, optimizers=optimizers)
        return module

    # --- steps -------------------------------------------------------------------------------------
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        self.engine.before_backward(tensor)
        self.precision.scale_loss(tensor, self.engine.optimizers).backward(*args, **kwargs)
        self.engine.after_backward()

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
        return self.engine.full_state_dict(module)

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: dict | None = None
    ) -> None:
        """Writes ``state`` as a sharded checkpoint directory (collective: every rank calls it)."""
        if storage_options is not None or filter:
            raise TypeError("the ZeRO strategies save sharded checkpoints: storage_options and filter are not taken")
        module, optimizers = self._stateful(state)
        other = {k: v for k, v in state.items() if not isinstance(v, (Module, Optimizer))}
        checkpoint = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in other.items()}
        checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)  # what a Trainer resuming it reads
        if optimizers:  # (their state itself is in the shards; no scheduler state: a Fabric program keeps its own)
            checkpoint.update(optimizer_states=[{} for _ in optimizers], lr_schedulers=[])
        if self.precision.state_dict():
            checkpoint[ZeroPrecision.__qualname__] = self.precision.state_dict()
        self.engine.save(checkpoint, path, module=module, optimizers=optimizers)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restores the model, optimizers and stateful objects in ``state`` from a sharded checkpoint (the
        Trainer's or Fabric's, any world size and stage); returns the other entries. Collective."""
        state = state if isinstance(state, dict) else {"model": state} if isinstance(state, Module) else {}
        module, optimizers = self._stateful(state)
        self.engine.finish_saves()  # (one of ours may still be finishing in the background)
        loaded = checkpoint_io.open_checkpoint(
            path,
            rank=self.global_rank,
            world_size=self.world_size,
            optimizer_names=[o.param_names() for o in optimizers],
            model_names=list(self.engine.module.state_dict(keep_vars=True)),
            weights_only=weights_only is not False,
        )
        saved = dict(loaded.lightning)
        other = [k for k, v in state.items() if not isinstance(v, (Module, Optimizer))]
        missing = [k for k in other if k not in saved]
        if len(optimizers) > len(loaded.meta.optimizers):
            missing.append(f"the state of {len(optimizers)} optimizers (it has {len(loaded.meta.optimizers)})")
        if strict and missing:
            raise KeyError(f"{path}: the checkpoint has no {missing}; it has {sorted(saved)}")
        if module is not None:
            checkpoint_io.load_model(loaded, module, self.engine.units, group=self.topology.shard_group)
        for index, optimizer in enumerate(optimizers[: len(loaded.meta.optimizers)]):
            checkpoint_io.load_optimizer(loaded, index, optimizer)
        self.precision.load_state_dict(saved.get(ZeroPrecision.__qualname__, {}))
        for key in other:  # as Fabric's own load: stateful objects load theirs, plain values are replaced
            if key in saved and isinstance(state[key], _Stateful):
                state[key].load_state_dict(saved.pop(key))
            elif key in saved:
                state[key] = saved.pop(key)
        return {k: v for k, v in saved.items() if k not in INTERNAL_KEYS and not k.startswith("averaged")}

    def _stateful(self, state: dict[str, Any]) -> tuple[Module | None, list[ZeroOptimizer]]:
        modules = [v.module if isinstance(v, ZeroModule) else v for v in state.values() if isinstance(v, Module)]
        if len(modules) > 1 or (modules and modules[0] is not self.engine.module):
            raise ValueError("a ZeRO checkpoint holds the one module set up by fabric.setup; got other modules")
        return (modules[0] if modules else None), [_zero(v) for v in state.values() if isinstance(v, Optimizer)]

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.teardown()
        self._observing.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"zero{stage}", cls, description=f"ZeRO stage {stage} (lightning_zero)", stage=stage
            )

"""ZeroEngine: ZeRO data parallelism for one module and its optimizers, with nothing of Lightning in it.

Three front doors drive it: ``ZeroStrategy`` (the Trainer), ``ZeroFabricStrategy`` (Fabric) and
``lightning_zero.initialize`` (a plain PyTorch script under torchrun). The engine owns what sharding needs:
the flat units, the gradient reducer, the ZeroOptimizers around the user's optimizers, stage 3's runtime,
the post-step gathers of stages 1 and 2, buffer broadcasts and the sharded state checkpoints save.

[Note: the step's boundaries]
Sharding needs to know where a training step starts and ends, which only the front door knows: stage 3
gathers the root unit for a whole step and serves the units this rank did not run once the forward ends;
stage 1 reduces in the backward of a step's last micro-batch; buffers are broadcast before a forward that
follows a synchronized training forward (sharding/buffer_sync.py). So a front door calls, per micro-batch:
``begin_training_forward`` before the forward, ``end_training_forward`` after it, ``before_backward`` /
``after_backward`` around the backward, and enters ``no_sync`` for the micro-batches before a step's last;
forward-only work (evaluation) goes through ``forward_only``. The same events on every rank give the same
collectives on every rank.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_zero.checkpoint import save as checkpoint_save
from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.memory import persistent_bytes
from lightning_zero.sharding import collectives
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.backward_end import BackwardEnd
from lightning_zero.sharding.buffer_sync import BufferSync
from lightning_zero.sharding.build import (
    check_optimizer_params,
    trainable_units,
    units_per_param_group,
    wrap_optimizers,
)
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.full_state import full_state_dict, needs_masters, parameter_norms
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.param_gather import ParamGathers, runs_compiled_code
from lightning_zero.sharding.placement import Join, Replicated, Sharded
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.stage3_setup import (
    ShardedModule,
    default_init,
    initialize_sharded,
    install_load_hooks,
    shard_module,
)
from lightning_zero.sharding.topology import Topology
from lightning_zero.sharding.unit_index import UnitIndex
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


class ZeroEngine:
    """Args:
    config: the typed configuration (its ``stage`` chooses what is sharded).
    topology: the process groups (sharding/topology.py), made once the default group exists.
    device: where the module computes.
    rank: this process's global rank (for error messages).
    """

    def __init__(self, config: ZeroConfig, topology: Topology, device: torch.device, *, rank: int = 0) -> None:
        self.config, self.topology, self.device, self.rank = config, topology, device, rank
        self.module: Module | None = None
        self.units: list[FlatUnit] = []
        self.optimizers: list[ZeroOptimizer] = []
        self.reducer: GradReducer | None = None  # while training
        self.placement: Replicated | Sharded = Replicated()  # see [Note: placements] in sharding/placement.py
        self.backward_end = BackwardEnd()
        self.buffer_sync: BufferSync | None = None  # while training, with config.broadcast_buffers
        self.blocked = False  # inside no_sync: a micro-batch before the step's last
        self.load_hooks: list = []  # stages 1 and 2: load_state_dict reaches the masters
        self.average: WeightAverage | None = None  # a weight average kept sharded (sharding/averaging.py)
        self.collective_log: list | None = None  # with config.check_collectives: every collective issued
        self._checked = 0  # how much of it every rank has agreed on
        self.sharded_init_peak_bytes: int | None = None  # stage 3 built sharded: see construct.py
        self.peak_gathered_bytes: int | None = None  # stage 3: most bytes of whole units at once, at teardown
        self.background = _background_saves(config, topology)  # with config.async_save

    # --- set-up ------------------------------------------------------------------------------------
    def construction(self) -> ShardedConstruction:
        """Stage 3: a context in which modules are built sharded, never whole (sharding/construct.py)."""
        return ShardedConstruction(
            rank=self.topology.shard_rank,
            world_size=self.topology.shard_size,
            device=self.device,
            max_whole_numel=self.config.max_live_parameters,
            group=self.topology.shard_group,
        )

    def shard(
        self,
        module: Module,
        *,
        training: bool,
        dtype: torch.dtype | None,
        construction: ShardedConstruction | None = None,
        optimizers: Sequence[Optimizer] = (),
    ) -> None:
        """Stage 3: shards ``module`` into units (kept if an earlier run sharded it), whose units follow
        ``optimizers``' parameters; parameters on the meta device are initialized sharded
        (``module.init_module(generator)`` if it has one). ``dtype``: the shards' (None: the module's)."""
        self.module = module
        sharded = ShardedModule.of(module)
        rank, size = self.topology.shard_rank, self.topology.shard_size
        if sharded is not None:  # trained, then evaluated (or trained again): keep the shards
            sharded.check(world_size=size, rank=rank)
            if training:
                for unit in sharded.units:
                    if unit.requires_grad:
                        unit.make_trainable(**self.config.unit_options(unit.param_dtype))
        else:
            on_meta = any(p.is_meta for p in module.parameters())
            holder = {id(p): k for k, o in enumerate(optimizers) for g in o.param_groups for p in g["params"]}
            sharded = shard_module(
                module,
                self.config,
                rank=rank,
                world_size=size,
                device=self.device,
                dtype=dtype,
                construction=construction,
                holder=holder if training else None,
            )
            if construction is not None:
                self.sharded_init_peak_bytes = construction.peak_bytes
            if on_meta:
                init = getattr(module, "init_module", default_init)
                self.sharded_init_peak_bytes = initialize_sharded(module, sharded.units, init, device=self.device)
                module.to(self.device)
        self.units = sharded.units
        runtime = Stage3Runtime(
            sharded.units,
            sharded.modules,
            max_live_parameters=self.config.max_live_parameters,
            prefetch_bucket_size=self.config.prefetch_bucket_size,
            param_persistence_threshold=self.config.param_persistence_threshold,
            backward_end=self.backward_end,
            group=self.topology.shard_group,
            quantize_block=self.config.quantization_block_size if self.config.quantized_weights else None,
            node=self._secondary_partition(),
        )
        runtime.install_access_hooks(module)
        self.placement = Sharded(runtime)

    def _secondary_partition(self) -> tuple[int, int, Any] | None:
        """hpZ's (node rank, node size, node group) when asked for and there is more than one node."""
        if not self.config.secondary_partition:
            return None
        if self.topology.cross_group is None:  # one node: the backward's gathers stay in it anyway
            if self.rank == 0:
                warnings.warn(
                    "zero.secondary_partition: the run has one node (zero.node_size = the world size), so every"
                    " gather stays inside it already; the secondary partition is off",
                    stacklevel=2,
                )
            return None
        return self.topology.node_rank, self.topology.node_size, self.topology.node_group

    @property
    def stage3(self) -> Stage3Runtime | None:
        """Stage 3's runtime while the module is sharded (for introspection: memory, tests)."""
        return self.placement.runtime

    @property
    def gathers(self) -> ParamGathers | None:
        """Stages 1 and 2 while training: the post-step parameter all-gathers (for introspection)."""
        return self.placement.gathers

    def wrap(self, module: Module, optimizers: Sequence[Optimizer], *, marks_micro_batches: bool = True) -> list:
        """Flat units for the optimizers' parameters (stages 1 and 2; stage 3's come from ``shard``), one
        gradient reducer, and a ZeroOptimizer around each optimizer, returned. ``marks_micro_batches``: the
        front door enters ``no_sync`` for the micro-batches before a step's last (else stage 1 cannot know
        which backward is a step's last, and reduces in every one)."""
        self.module = module
        self.buffer_sync = BufferSync(module) if self.config.broadcast_buffers else None
        names = check_optimizer_params(module, optimizers, rank=self.rank)
        if self.placement.units_from_optimizers:
            shard = {"rank": self.topology.shard_rank, "world_size": self.topology.shard_size}
            self.units = units_per_param_group(optimizers, names, self.config, **shard)
            UnitIndex(self.units).attach(module)
            self.load_hooks = install_load_hooks(module, self.units)
        self.optimizers, self.reducer, gathers = wrap_optimizers(
            optimizers,
            [u for u in self.units if u.trainable],  # stage 3's frozen units need no gradients
            names,
            self.config,
            world_size=self.topology.shard_size,
            backward_end=self.backward_end,
            model=module,
            topology=self.topology,
            activate=self.activate,
        )
        if self.background is not None:  # a background save's snapshot is taken before the state changes
            for optimizer in self.optimizers:
                optimizer.register_step_pre_hook(lambda *_: self.background.wait_snapshot())
        # torch.compile would trace the post-step gathers' overlapping mode and recompile as it comes and goes
        overlap = self.config.overlap_param_gather and not runs_compiled_code(module)
        self.placement.attach(self.reducer, gathers, overlap=overlap)
        self.reducer.accumulating = not marks_micro_batches
        return self.optimizers

    def activate(self, params: list[Parameter]) -> tuple[dict, dict]:
        """``ZeroOptimizer.add_param_group``: gives ``params`` master weights and gradients from now on
        (stage 3: their frozen units become trainable; stages 1-2: they get a unit of their own)."""
        self.before_weights_change()  # (a background save may be copying the units it changes)
        names = {p: n for n, p in self.module.named_parameters()}
        shard = {"rank": self.topology.shard_rank, "world_size": self.topology.shard_size}
        unit_location = UnitIndex.of(self.module)
        units = trainable_units(params, names, self.config, unit_location, **shard)
        if self.placement.units_from_optimizers:  # units of their own
            self.units += units
            unit_location.add(units)
            self.load_hooks += install_load_hooks(self.module, units)
        self.reducer.add_units(units)
        self.placement.add_units(units)
        if self.average is not None:
            self.average.units_changed()
        return {p: unit_location(p) for p in params}, names

    def record_collectives(self, stack: ExitStack) -> None:
        """With ``config.check_collectives`` (a debug mode): records every collective until ``stack`` closes."""
        self.collective_log, self._checked = None, 0
        if self.config.check_collectives:
            self.collective_log = stack.enter_context(collectives.record())

    def check_collectives(self, where: str) -> None:
        """With ``config.check_collectives``: every rank's collectives since the last check must be the same, or
        every rank raises one error naming the first difference and ``where`` (e.g. "before global step 3")."""
        if self.collective_log is None:
            return
        sequence = self.collective_log[self._checked :]
        self._checked = len(self.collective_log)
        digest = hashlib.sha1(repr(sequence).encode()).hexdigest()  # not hash(): salted per process
        digests = collectives.all_gather_object((len(sequence), digest))
        if len(set(digests)) > 1:
            problem = collectives.first_divergence(collectives.all_gather_object(sequence))
            raise RuntimeError(f"the ranks issued different collectives {where}: {problem}")

    # --- steps (see [Note: the step's boundaries]) -------------------------------------------------
    def begin_training_forward(self) -> None:
        if self.background is not None:  # a failed background save raises here, on every rank alike
            self.background.poll()
        if self.buffer_sync is not None:  # see [Note: when buffers are broadcast] in sharding/buffer_sync.py
            self.buffer_sync.forward_starts(training=True, synchronized=not self.blocked)
        if any(unit.data_replaced() for unit in self.units):  # (pointer checks; a post-step gather must land first)
            self.settle()
        self.placement.begin_step()

    def end_training_forward(self, *, step_ends: bool = False) -> None:
        """After a training forward; ``step_ends``: its backward happened inside it (manual optimization)."""
        self.placement.end_forward(step_ends=step_ends)

    def before_backward(self, loss: torch.Tensor) -> None:
        self.backward_end.arm_on(loss)  # the end-of-backward callback belongs to this backward

    def after_backward(self) -> None:
        """After a step's backward (not under manual optimization, whose step ends with its forward)."""
        self.placement.end_step()

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """The micro-batches before a step's last: stage 1 only accumulates gradients locally."""
        blocked, self.blocked = self.blocked, True
        accumulating = self.reducer.accumulating if self.reducer is not None else None
        if self.reducer is not None:
            self.reducer.accumulating = True
        try:
            yield
        finally:
            self.blocked = blocked
            if self.reducer is not None:
                self.reducer.accumulating = accumulating

    def forward_only(
        self,
        step: Callable,
        *args: Any,
        last: Callable[[], bool] | None = None,
        checked_as: str = "before a forward-only step",
        **kwargs: Any,
    ) -> Any:
        """One forward-only step (evaluation). Stage 3: with ``last`` (whether this rank ran out of batches after
        this one) a step of a Join (see [Note: uneven inputs] in sharding/stage3.py); without, every rank must
        run as many. With ``config.check_collectives`` the ranks' collectives are compared first (``checked_as``
        names the place), by a rank that has run out too, at each step the others run."""
        self.settle()
        if self.buffer_sync is not None:
            self.buffer_sync.forward_starts(training=False, synchronized=False)
        check = functools.partial(self.check_collectives, checked_as)
        if last is None or isinstance(self.placement, Replicated):
            check()
            return self.placement.forward_only(step, args, kwargs, join=None)
        join = Join(self._count_ranks_with_batch, last, check)
        return self.placement.forward_only(step, args, kwargs, join=join)

    def _count_ranks_with_batch(self, has_batch: int) -> int:
        flag = torch.tensor([has_batch], dtype=torch.int32, device=self.device)
        return int(collectives.all_reduce(flag, torch.distributed.ReduceOp.SUM).item())

    def settle(self) -> None:
        """Waits for the post-step parameter all-gathers still running (before anything reads parameters), and keeps
        a ``.data`` user code replaced (sharding/param_writes.py's [Note: a replaced .data])."""
        self.placement.settle()
        for unit in self.units:
            unit.take_replaced()

    def before_weights_change(self) -> None:
        """Before anything but the optimizer step writes the masters (the averaging callbacks' swaps): the
        parameter all-gathers settled and a background save's snapshot taken (background.py's Note)."""
        self.settle()
        if self.background is not None:
            self.background.wait_snapshot()

    def release_gradients(self) -> None:
        """Drops the gradients accumulated so far (as ``module.zero_grad()`` drops ddp's)."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    # --- reading the model ---------------------------------------------------------------------------
    def full_state_dict(self, module: Module) -> dict[str, torch.Tensor]:
        """The whole state dict on every rank, in fp32 where training is mixed (the masters): the module's own
        where it is whole and fp32 already, else gathered onto the CPU one unit at a time. Collective."""
        self.settle()
        if isinstance(self.placement, Replicated) and not any(needs_masters(u) for u in self.units):
            return module.state_dict()
        group, hold = self.topology.shard_group, self.placement.holding
        return full_state_dict(module, self.units, hold, group=group, host_group=self.topology.host(group))

    def checkpoint_state_dict(self, module: Module) -> dict[str, Any]:
        """The state dict by reference, nothing copied or gathered: what a checkpoint's Lightning state holds
        (the units' values are written from the shards, per rank). Stage 3's sharded parameters are in it as
        themselves: reading one outside a step raises (sharding/sharded_param.py)."""
        self.settle()
        return self.placement.checkpoint_state_dict(module)

    def parameter_norms(self, module: Module, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
        """Each parameter's norm and the total, from the shards (nothing gathered). Collective."""
        self.settle()
        host = self.topology.host(self.topology.shard_group)
        return parameter_norms(module, self.units, float(norm_type), group=host)

    @contextmanager
    def gathered_parameters(
        self, targets: Sequence[Module | Parameter], modifier_rank: int | None = None
    ) -> Generator[list[Parameter], None, None]:
        """The parameters of ``targets`` (modules, with their submodules, or parameters) whole inside the block,
        outside the steps too, like DeepSpeed's ``GatheredParameters`` and FSDP's ``summon_full_params``.
        Collective: enter it on every rank with the same targets (stage 3 gathers their units, one all-gather
        each, and frees them after; stages 1 and 2 hold every parameter whole already). Writes made inside are
        kept: each written tensor's values become every rank's, master weights included, those of the lowest
        rank that wrote it, or of ``modifier_rank`` when given (sharding/param_writes.py). Yields the parameters."""
        params = list(dict.fromkeys(p for t in targets for p in (t.parameters() if isinstance(t, Module) else [t])))
        with self.placement.gathered_parameters(self.module, params, modifier_rank):
            yield params

    def gather_module(self, module: Module, device: torch.device) -> None:
        """Stage 3, between runs: makes ``module`` whole on ``device``, one unit at a time. Collective."""
        if isinstance(self.placement, Sharded):
            self.peak_gathered_bytes = self.placement.runtime.peak_gathered_bytes
            self.placement, self.units = self.placement.gather_module(module, device), []

    def save(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        *,
        module: Module,
        optimizers: Sequence[ZeroOptimizer],
        synchronous: bool = False,
    ) -> None:
        """Writes ``checkpoint`` (the front door's own state) and each rank's shards of ``module``, ``optimizers``
        and the weight average as a checkpoint directory (collective; checkpoint/save.py); in the background with
        ``config.async_save`` unless ``synchronous``."""
        self.settle()
        if self.background is not None:
            self.background.wait()  # at most one save in flight
        checkpoint_save.save(
            checkpoint,
            path,
            model=module,
            units=self.units,
            optimizers=optimizers,
            stage=self.config.stage,
            rank=self.rank,
            world_size=self.topology.shard_size,
            shard_rank=self.topology.shard_rank,
            writes_shards=self.topology.writes_checkpoint_shards,
            consolidated=self.config.save_consolidated,
            average=self.average,
            background=None if synchronous else self.background,
        )

    def after_saves(self, then: Callable[[], None]) -> None:
        """Runs ``then`` once the save in flight has succeeded (background saves), else now."""
        if self.background is not None:
            self.background.defer(then)
        else:
            then()

    def finish_saves(self) -> None:
        """Waits for a background save in flight (raising its error): before an exit that must leave it done."""
        if self.background is not None:
            self.background.wait()

    def memory_bytes(self) -> dict[str, int]:
        """This rank's persistent bytes by category, device and ``host_*`` (see ``memory.persistent_bytes``;
        stage 3's units gathered for a moment: ``peak_gathered_bytes``), and ``weight_average`` while a
        weight average is kept (this rank's share, sharding/averaging.py)."""
        offloaded = self.config.offload_optimizer != "none"
        totals = persistent_bytes(self.units, self.optimizers, self.module, offloaded=offloaded)
        if self.average is not None:
            totals["weight_average"] = self.average.nbytes()
        if self.stage3 is not None and self.stage3.node is not None:  # held between a forward and its backward
            size = self.topology.node_size
            totals["secondary_partition"] = sum(
                u.flat_param.numel() // size * u.flat_param.element_size() for u in self.units
            )
        return totals

    # --- the end -----------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Releases hooks; a stage-3 module stays sharded where it is (nothing is gathered, even after an
        error): ``full_state_dict`` or ``gather_module`` make it whole when asked. A background save in flight
        is finished first; its error is raised once everything is released."""
        try:
            self.finish_saves()
        finally:
            if self.background is not None:
                self.background.release()
            self._release()

    def _release(self) -> None:
        module = self.module
        if self.stage3 is not None:
            self.peak_gathered_bytes = self.stage3.peak_gathered_bytes
        self.placement.teardown(module)
        if self.reducer is not None:
            self.reducer.remove_hooks()
            self.reducer = None
        for handle in self.load_hooks:
            handle.remove()
        self.load_hooks = []
        self.buffer_sync = None
        self.average = None


def _background_saves(config: ZeroConfig, topology: Topology) -> BackgroundSaves | None:
    """With ``config.async_save``: the writer and its own group of every rank (collective: made at set-up)."""
    if not config.async_save:
        return None
    many = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    timeout = timedelta(seconds=config.timeout)  # (torch's default would leave a lost peer's save waiting 30 min)
    group = torch.distributed.new_group(backend="gloo", timeout=timeout) if many else None
    return BackgroundSaves(group, poll_group=topology.host_world)

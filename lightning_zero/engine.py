"""ZeroEngine: ZeRO data parallelism for one module and its optimizers, with nothing of Lightning in it.

Three front doors drive it: ``ZeroStrategy`` (the Trainer), ``ZeroFabricStrategy`` (Fabric) and
``lightning_zero.initialize`` (a plain PyTorch script under torchrun). The engine builds, once and in order, what
sharding needs (the units, the post-step gathers, the gradient reducer, the placement, the ZeroOptimizers; see the
README's "How it works") and saves and loads their sharded state for every door.

[Note: the step's boundaries]
Sharding needs to know where a training step starts and ends, which only the front door knows: stage 3 gathers the root
unit for a whole step and serves the units this rank did not run once the forward ends; stage 1 reduces in the backward
of a step's last micro-batch; buffers are broadcast before a forward that follows a synchronized training forward
(sharding/buffer_sync.py). So a front door calls, per micro-batch: ``begin_training_forward`` before the forward,
``end_training_forward`` after it, ``before_backward`` / ``after_backward`` around the backward, and enters ``no_sync``
for the micro-batches before a step's last; forward-only work (evaluation) goes through ``forward_only``. Each call
moves the engine's ``StepState`` (sharding/step_state.py's [Note: the step's phases]), which raises on a call out of
order; the same events on every rank give the same collectives on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_zero.activations.checkpointing import UnitCheckpoints, checkpoint_units
from lightning_zero.checkpoint.background import background_saves
from lightning_zero.checkpoint.io import open_checkpoint
from lightning_zero.checkpoint.restore import Restore
from lightning_zero.checkpoint.save import Observer, SaveJob
from lightning_zero.checkpoint.save_state import SaveSpec
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.memory import engine_bytes
from lightning_zero.sharding import collectives
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.backward_end import BackwardEnd
from lightning_zero.sharding.buffer_sync import BufferSync
from lightning_zero.sharding.build import (
    check_optimizer_params,
    check_units_follow_optimizers,
    make_reducer,
    replicated_training,
    wrap_optimizers,
)
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.full_state import full_state_dict, needs_masters, parameter_norms
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.param_gather import ParamGathers
from lightning_zero.sharding.placement import Join, Replicated, Sharded, count_ranks_with_batch
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.stage3_start import shard_or_reuse, start_runtime
from lightning_zero.sharding.step_state import StepState
from lightning_zero.sharding.swapped import check_nvme_path
from lightning_zero.sharding.topology import Topology
from lightning_zero.sharding.unit_set import ParamActivation, UnitSet, before_weights_change, settle
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


class ZeroEngine:
    """Args: ``config``, the typed configuration (its ``stage`` chooses what is sharded); ``topology``, the process
    groups (sharding/topology.py), made once the default group exists; ``device``, where the module computes; ``rank``,
    this process's global rank (errors); ``sharded_init_peak_bytes``: building the model sharded in an earlier run."""

    def __init__(
        self,
        config: ZeroConfig,
        topology: Topology,
        device: torch.device,
        *,
        rank: int = 0,
        sharded_init_peak_bytes: int | None = None,
    ) -> None:
        self.config, self.topology, self.device, self.rank = config, topology, device, rank
        self.module: Module | None = None
        self.unit_set = UnitSet()
        self.optimizers: list[ZeroOptimizer] = []
        self.reducer: GradReducer | None = None  # while training
        self.step = StepState()  # see [Note: the step's phases] in sharding/step_state.py
        self.placement: Replicated | Sharded = Replicated(self.step)  # see [Note: placements] in sharding/placement.py
        self.backward_end = BackwardEnd()
        self.buffer_sync: BufferSync | None = None  # while training, with config.broadcast_buffers
        self.average: WeightAverage | None = None  # a weight average kept sharded (sharding/averaging.py)
        self.activations: UnitCheckpoints | None = None  # while training, with config.activation_checkpointing
        self.collective_check = collectives.SequenceCheck(None)  # with config.check_collectives
        self.sharded_init_peak_bytes = sharded_init_peak_bytes  # stage 3 built sharded (construct.py)
        self.peak_gathered_bytes: int | None = None  # stage 3: most bytes of whole units at once, at teardown
        self.background = background_saves(config.async_save, config.timeout, topology.host_world)
        check_nvme_path(config, topology.host_world)  # (before anything is built: one line on every rank)

    @property
    def units(self) -> list[FlatUnit]:
        """The flat units: the unit set's, which grows as parameters join training."""
        return self.unit_set.units

    # --- set-up ------------------------------------------------------------------------------------
    def construction(self) -> ShardedConstruction:
        """Stage 3: a context in which modules are built sharded, never whole (sharding/construct.py)."""
        rank, size, group = self.topology.shard_rank, self.topology.shard_size, self.topology.shard_group
        largest = self.config.max_live_parameters
        return ShardedConstruction(rank=rank, world_size=size, device=self.device, max_whole_numel=largest, group=group)

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
        options = {"training": training, "dtype": dtype, "construction": construction, "optimizers": optimizers}
        sharded, built_peak = shard_or_reuse(module, self.config, self.topology, self.device, **options)
        if built_peak is not None:
            self.sharded_init_peak_bytes = built_peak
        self.unit_set.use(sharded.units)
        if training:  # the schedule releases units to the reducer as their gradients complete
            names = list(dict.fromkeys(p for _, p in module.named_parameters()))
            trainable = [u for u in sharded.units if u.trainable]
            self.reducer = make_reducer(
                trainable, names, self.config, step=self.step, backward_end=self.backward_end, model=module,
                topology=self.topology,
            )  # fmt: skip
        runtime = start_runtime(
            module, sharded, self.config, self.topology, step=self.step, reducer=self.reducer,
            backward_end=self.backward_end, rank=self.rank,
        )  # fmt: skip
        self.placement = Sharded(runtime)

    @property
    def stage3(self) -> Stage3Runtime | None:
        """Stage 3's runtime while sharded, else None (introspection: memory, tests)."""
        return self.placement.runtime

    @property
    def gathers(self) -> ParamGathers | None:
        """Stages 1 and 2 while training: the post-step all-gathers, else None."""
        return self.placement.gathers

    def wrap(
        self,
        module: Module,
        optimizers: Sequence[Optimizer],
        *,
        marks_micro_batches: bool = True,
        make_average: Callable[..., WeightAverage | None] | None = None,
    ) -> list:
        """Flat units for the optimizers' parameters (stages 1 and 2; stage 3's come from ``shard``), one gradient
        reducer and a ZeroOptimizer around each optimizer, returned. ``marks_micro_batches``: the front door enters
        ``no_sync`` before a step's last micro-batch (else stage 1 cannot tell a step's last backward, and reduces at
        the step). ``make_average(units, settle=...)``: a callback's weight average, if any (sharding/averaging.py)."""
        self.module = module
        self.buffer_sync = BufferSync(module) if self.config.broadcast_buffers else None
        names = check_optimizer_params(module, optimizers, rank=self.rank)
        self.activations = checkpoint_units(module, self.config, self.device)
        gathers = None
        if self.placement.units_from_optimizers:  # stages 1 and 2: a unit per param group, gathered after a step
            units, gathers, self.reducer = replicated_training(
                module, optimizers, names, self.config, self.topology, step=self.step, backward_end=self.backward_end,
                marks_micro_batches=marks_micro_batches,
            )  # fmt: skip
            self.unit_set.use(units, module)
            self.placement = Replicated(self.step, gathers)
        else:  # stage 3
            check_units_follow_optimizers(optimizers, [u for u in self.units if u.trainable])
        trainable = [u for u in self.units if u.trainable]  # stage 3's frozen units need no gradients
        settle = functools.partial(before_weights_change, self.placement, self.unit_set, self.background)
        self.average = make_average(self.units, settle=settle) if make_average is not None else None
        activation = ParamActivation(
            config=self.config, module=module, unit_set=self.unit_set, reducer=self.reducer, placement=self.placement,
            average=self.average, before_change=settle, rank=self.topology.shard_rank,
            world_size=self.topology.shard_size,
        )  # fmt: skip
        self.optimizers = wrap_optimizers(
            optimizers, trainable, names, self.reducer, config=self.config, topology=self.topology, gathers=gathers,
            activation=activation,
        )  # fmt: skip
        if self.background is not None:  # a background save's snapshot is taken before the state changes
            for optimizer in self.optimizers:
                optimizer.register_step_pre_hook(lambda *_: self.background.wait_snapshot())
        return self.optimizers

    def record_collectives(self, stack: ExitStack) -> None:
        """With ``config.check_collectives``: records every collective until ``stack`` closes (see ``check_...``)."""
        self.collective_check = collectives.SequenceCheck(stack if self.config.check_collectives else None)

    def check_collectives(self, where: str) -> None:
        """With ``config.check_collectives``: every rank's collectives since the last check must be the same, or
        every rank raises one error naming the first difference and ``where`` (e.g. "before global step 3")."""
        self.collective_check.check(where)

    def begin_training_forward(self) -> None:
        """Before each training micro-batch's forward (see [Note: the step's boundaries])."""
        if self.background is not None:  # a failed background save raises here, on every rank alike
            self.background.poll()
        if self.buffer_sync is not None:  # see [Note: when buffers are broadcast] in sharding/buffer_sync.py
            self.buffer_sync.forward_starts(training=True, synchronized=not self.step.in_no_sync)
        if any(unit.data_replaced() for unit in self.units):  # (pointer checks; a post-step gather must land first)
            self.settle()
        self._end_open_step("begin_training_forward")
        self.step.advance("begin_training_forward")
        self.placement.begin_step()

    def _end_open_step(self, event: str) -> None:
        """Before a step (``event``): the last one ends if its forward gave no backward (training_step gave None)."""
        self.backward_end.forget_raised()
        self.step.ready_for(event)
        if self.step.ends_open_step:
            self.placement.end_step()

    def end_training_forward(self, *, step_ends: bool = False) -> None:
        """After a training forward; ``step_ends``: its backward happened inside it (manual optimization)."""
        self.step.ready_for(event := "end_step_in_forward" if step_ends else "end_training_forward")
        self.placement.end_forward(step_ends=step_ends)  # (inside the step still: stage 3 serves the rest of it)
        self.step.advance(event)

    def before_backward(self, loss: torch.Tensor) -> None:
        """Before the backward of ``loss``: the end-of-backward callback is armed on it."""
        self.backward_end.forget_raised()  # (a backward that raised left its reductions half done)
        self.step.advance("before_backward")
        self.backward_end.arm_on(loss)  # the end-of-backward callback belongs to this backward

    def after_backward(self) -> None:
        """After a step's backward (not under manual optimization, whose step ends with its forward)."""
        self.step.ready_for("after_backward")
        self.placement.end_step()
        self.step.advance("after_backward")

    def no_sync(self) -> AbstractContextManager:
        """The micro-batches before a step's last: stage 1 only accumulates gradients locally."""
        return self.step.no_sync()

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
        join = None
        if last is None or isinstance(self.placement, Replicated):
            check()
        else:
            join = Join(functools.partial(count_ranks_with_batch, device=self.device), last, check)
        self._end_open_step("begin_forward_only")
        self.step.advance("begin_forward_only")
        try:
            return self.placement.forward_only(step, args, kwargs, join=join)
        finally:
            self.step.advance("end_forward_only")

    def settle(self) -> None:
        """Before anything reads parameters: pending post-step gathers waited for, replaced ``.data`` kept."""
        settle(self.placement, self.unit_set)

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
        """The parameters of ``targets`` (modules, with their submodules, or parameters) whole inside the block, outside
        the steps too (DeepSpeed's ``GatheredParameters``, FSDP's ``summon_full_params``); collective: the same targets
        on every rank. Writes made inside are kept: each written tensor's values become every rank's (masters included),
        those of the lowest rank that wrote it or of ``modifier_rank`` (sharding/param_writes.py). Yields them."""
        params = list(dict.fromkeys(p for t in targets for p in (t.parameters() if isinstance(t, Module) else [t])))
        with self.placement.gathered_parameters(self.module, params, modifier_rank):
            yield params

    def gather_module(self, module: Module, device: torch.device) -> None:
        """Stage 3, between runs: makes ``module`` whole on ``device``, one unit at a time. Collective."""
        if isinstance(self.placement, Sharded):
            self.peak_gathered_bytes = self.placement.runtime.peak_gathered_bytes
            self.placement = self.placement.gather_module(module, device)
            self.unit_set.use([])

    def save(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        *,
        module: Module,
        optimizers: Sequence[ZeroOptimizer],
        synchronous: bool = False,
        on_phase: Observer | None = None,
    ) -> None:
        """Writes ``checkpoint`` (the front door's own state) and each rank's shards of ``module``, ``optimizers`` and
        the weight average as a checkpoint directory (collective; checkpoint/save.py's ``SaveJob``); in the background
        with ``config.async_save`` unless ``synchronous``. ``on_phase``: save.py's [Note: observing a save]."""
        self.settle()
        if self.background is not None:
            self.background.wait()  # at most one save in flight
        spec = SaveSpec(
            model=module, units=self.units, optimizers=optimizers, stage=self.config.stage, rank=self.rank,
            topology=self.topology, consolidated=self.config.save_consolidated, average=self.average,
        )  # fmt: skip
        background = None if synchronous else self.background
        SaveJob(checkpoint, path, spec, background=background, on_phase=on_phase).run()

    def load(
        self, path: Any, *, module: Module | None, optimizers: Sequence[ZeroOptimizer], trusted: bool = False
    ) -> Restore:
        """Opens the checkpoint ``path`` (a directory of any world size and stage, a plain Lightning file or a DCP
        directory) for ``module`` and ``optimizers`` once a save in flight has finished: every rank checks it, all raise
        the first problem (collective; checkpoint/io.py). Returns what restores their sharded state, each part when the
        front door asks (checkpoint/restore.py). Pickled state is loaded with ``weights_only`` unless ``trusted``."""
        self.finish_saves()
        self.settle()
        model_names = list(module.state_dict(keep_vars=True)) if module is not None else None
        loaded = open_checkpoint(
            path, rank=self.rank, world_size=self.topology.shard_size * self.topology.replicas,
            optimizer_names=[o.param_names() for o in optimizers], model_names=model_names, weights_only=not trusted,
        )  # fmt: skip
        return Restore(loaded, units=self.units, group=self.topology.shard_group, average=self.average)

    def after_saves(self, then: Callable[[], None]) -> None:
        """Runs ``then`` once the save in flight has succeeded (background saves), else now."""
        self.background.defer(then) if self.background is not None else then()

    def finish_saves(self) -> None:
        """Waits for a background save in flight (raising its error): before an exit that must leave it done."""
        if self.background is not None:
            self.background.wait()

    def memory_bytes(self) -> dict[str, int]:
        """This rank's persistent bytes by category, device and ``host_*`` (planning/memory.py's ``engine_bytes``; with
        ``config.offload_activations``, ``host_activations``: the constant host pool)."""
        node_size = self.topology.node_size if self.stage3 is not None and self.stage3.node is not None else None
        offloaded = self.config.offload_optimizer != "none"
        totals = engine_bytes(self.units, self.optimizers, self.module, self.average, offloaded, node_size)
        return totals | (self.activations.memory_bytes() if self.activations is not None else {})

    def teardown(self) -> None:
        """At the end: releases hooks; a stage-3 module stays sharded where it is (nothing is gathered, even after an
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
        self.unit_set.release()
        self.step.reset()
        self.buffer_sync = self.average = None
        if self.activations is not None:  # (its hooks off the model)
            self.activations.remove()
        self.activations = None

"""Where a module's parameter values are between steps: the one thing the engine does differently by stage.

[Note: placements]
``Replicated``: every rank holds every parameter whole. Stages 1 and 2 for their whole life, and a
stage-3 module before it is sharded (while it is built) or after ``gather_module`` made it whole again.
The units are the optimizers' parameter groups (the engine makes them); after a step each rank's updated
chunks are all-gathered (``ParamGathers``, the post-step gathers), which must land before anything reads
the parameters (``settle``).

``Sharded`` (stage 3): each rank holds its shards of units made per module subtree
(``shard_module``); a unit is gathered while in use, following the schedule (``Stage3Runtime``), and each
unit's own state says where its values are (``UnitState``).

The engine calls the same methods on either, at the step's boundaries (see [Note: the step's boundaries]
in engine.py) and when the model is read; the stage decides which placement the engine starts with and
``shard`` / ``gather_module`` move it from one to the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module, Parameter

from lightning_zero.sharding import collectives, param_writes
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.param_gather import ParamGathers
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.stage3_setup import ShardedModule, gather_module
from lightning_zero.sharding.step_state import StepState
from lightning_zero.sharding.unit_index import UnitIndex


@dataclass(frozen=True)
class Join:
    """Uneven forward-only steps: ``count(has_batch)`` is how many ranks have a batch (collective), ``last()``
    whether this rank's batches ran out with this step; ``check()`` runs at every step on every rank, one that
    has run out included (the collective check of ``ZeroConfig.check_collectives``)."""

    count: Callable[[int], int]
    last: Callable[[], bool]
    check: Callable[[], None]


def count_ranks_with_batch(has_batch: int, *, device: torch.device) -> int:
    """A ``Join``'s ``count``: how many ranks have a batch (collective)."""
    flag = torch.tensor([has_batch], dtype=torch.int32, device=device)
    return int(collectives.all_reduce(flag, torch.distributed.ReduceOp.SUM).item())


class Replicated:
    """Every parameter whole on every rank (see [Note: placements])."""

    runtime: Stage3Runtime | None = None
    units_from_optimizers = True  # the engine makes one unit per optimizer parameter group

    def __init__(self, step: StepState, gathers: ParamGathers | None = None) -> None:
        """``step``: the engine's step state; ``gathers``: while training, the post-step gathers (param_gather.py)."""
        self.step, self.gathers = step, gathers

    def add_units(self, units: Sequence[FlatUnit]) -> None:
        """Units added to training (``add_param_group``): their post-step gathers are waited for on use too."""
        if self.gathers is not None:
            self.gathers.add_units(units)

    def settle(self) -> None:
        """Waits for the post-step gathers still running (before anything reads parameters)."""
        if self.gathers is not None:
            self.gathers.wait_all()

    def begin_step(self) -> None:
        """Before a training forward: nothing to gather, every parameter is whole."""
        pass

    def end_forward(self, *, step_ends: bool) -> None:
        """After a training forward: waits for the post-step gathers it did not read (``settle``)."""
        self.settle()  # what the forward did not read (see [Note: post-step gathers])

    def end_step(self) -> None:
        """After the step's backward (or a forward that gave none): nothing to free."""
        pass

    def forward_only(self, step: Callable, args: tuple, kwargs: dict, *, join: Join | None) -> Any:
        """Runs ``step(*args, **kwargs)``: with every parameter whole there is nothing to gather (``join`` unused)."""
        return step(*args, **kwargs)

    def holding(self, unit: FlatUnit) -> AbstractContextManager:
        """A context that does nothing: ``unit`` is whole already."""
        return contextlib.nullcontext()

    def checkpoint_state_dict(self, module: Module) -> dict[str, Any]:
        """``module``'s own state dict (every parameter is whole here)."""
        return module.state_dict()

    @contextmanager
    def gathered_parameters(
        self, module: Module | None, params: list[Parameter], modifier_rank: int | None
    ) -> Generator[list[Parameter], None, None]:
        """See [Note: writes inside gathered_parameters] in param_writes.py. ``module`` is None where the engine
        holds none (stages 1 and 2 outside fit): no unit then holds the parameters."""
        self.settle()
        _refuse_modifier_in_forward_only(modifier_rank, self.step.evaluating)
        locate = UnitIndex.of(module) if module is not None else UnitIndex()
        located = [locate(p) for p in params]

        def adopt() -> None:
            for entry in located:
                if entry is not None:
                    entry[0].adopt(entry[1])

        def keep(index: int, writer: int) -> None:
            collectives.broadcast(params[index].data, src=writer)
            if located[index] is not None:
                located[index][0].write_owned(located[index][1], params[index].data)  # the master too

        agree = param_writes.agree_here if self.step.evaluating else param_writes.agree
        with param_writes.keeping_writes(params, adopt, keep, modifier_rank=modifier_rank, agree=agree):
            yield params

    def teardown(self, module: Module | None) -> None:
        """Waits for the post-step gathers and stops watching; drops ``module``'s unit index unless it stays sharded."""
        if self.gathers is not None:
            self.gathers.remove_hooks()  # waits for the gathers still running
            self.gathers = None
        if module is not None and ShardedModule.of(module) is None:  # (a failed stage-3 set-up keeps its shards)
            UnitIndex.detach(module)


def _refuse_quantized_writes(units: Sequence[FlatUnit]) -> None:
    if any(u.quantized_values for u in units):
        raise RuntimeError(
            "a parameter written inside gathered_parameters inside a step under ZeroConfig(quantized_weights=True):"
            " the step gathered these parameters as int8, and keeping the write would store the quantized values"
            " in the master weights; modify them between steps (where they are gathered exactly)"
        )


def _refuse_modifier_in_forward_only(modifier_rank: int | None, forward_only: bool) -> None:
    if modifier_rank is not None and forward_only:  # (every rank alike: the same code passes the same rank)
        raise RuntimeError(param_writes.FORWARD_ONLY_WRITE)


class Sharded:
    """Stage 3: each rank its shards, units gathered while in use (see [Note: placements])."""

    units_from_optimizers = False  # the units come from sharding the module

    def __init__(self, runtime: Stage3Runtime) -> None:
        self.runtime = runtime
        self.gathers = None

    def add_units(self, units: Sequence[FlatUnit]) -> None:
        """Nothing to do: units made trainable are the runtime's already."""
        pass  # (frozen units made trainable: the runtime has them already)

    def settle(self) -> None:
        """Nothing to wait for: stage 3 has no post-step gathers."""
        pass

    def begin_step(self) -> None:
        """Before a training forward: the runtime gathers the root unit for the step."""
        self.runtime.begin_step()

    def end_forward(self, *, step_ends: bool) -> None:
        """After a training forward: the runtime serves the units this rank did not run, and ends the step if
        ``step_ends`` (its backward ran inside the forward)."""
        self.runtime.end_forward()
        if step_ends:
            self.runtime.end_step()

    def end_step(self) -> None:
        """After the step's backward (or a forward that gave none): the runtime frees what is not persistent."""
        self.runtime.end_step()

    def forward_only(self, step: Callable, args: tuple, kwargs: dict, *, join: Join | None) -> Any:
        """One forward-only step; with ``join`` a step of a Join (see [Note: uneven inputs] in stage3.py)."""
        if join is not None:
            join.count(1)
            join.check()
        self.runtime.begin_step()
        try:
            output = step(*args, **kwargs)
            self.runtime.end_forward()
        finally:
            self.runtime.end_step()
        if join is not None and join.last():
            while join.count(0) > 0:  # others still have batches: issue what their forwards issue
                join.check()
                self.runtime.shadow_step()
        return output

    def holding(self, unit: FlatUnit) -> AbstractContextManager:
        """A context that keeps ``unit`` gathered inside it (``Stage3Runtime.gathered``)."""
        return self.runtime.gathered(unit)

    def checkpoint_state_dict(self, module: Module) -> dict[str, Any]:
        """Every entry of the state dict by reference: what no unit shards as it is, and each sharded
        parameter itself, whose values read outside a step raise (sharded_param.py)."""
        owned = {id(p) for unit in self.runtime.units for p in unit.params}
        return {k: v if id(v) in owned else v.detach() for k, v in module.state_dict(keep_vars=True).items()}

    @contextmanager
    def gathered_parameters(
        self, module: Module | None, params: list[Parameter], modifier_rank: int | None
    ) -> Generator[list[Parameter], None, None]:
        """See [Note: writes inside gathered_parameters] in param_writes.py."""
        _refuse_modifier_in_forward_only(modifier_rank, self.runtime.forward_only_step)
        with self.runtime.gathered_params(params) as units:
            if modifier_rank is not None:
                _refuse_quantized_writes(units)

            held = [(unit, k) for unit in units for k in range(len(unit.params))]  # their parameters, whole

            def adopt() -> None:
                for unit, k in held:
                    unit.adopt(k)

            def keep(index: int, writer: int) -> None:
                unit, k = held[index]
                _refuse_quantized_writes([unit])  # (on every rank: the writers are agreed)
                collectives.broadcast(unit.params[k].data, src=writer)  # whole: each rank keeps its pieces
                unit.write_owned(k, unit.params[k].data)

            tensors = [unit.params[k] for unit, k in held]
            agree = self.runtime.agree_on_writers
            with param_writes.keeping_writes(tensors, adopt, keep, modifier_rank=modifier_rank, agree=agree):
                yield params

    def gather_module(self, module: Module, device: torch.device) -> Replicated:
        """Makes ``module`` whole on ``device``, one unit at a time (collective); it is then replicated."""
        if self.runtime.in_step:
            raise RuntimeError("gather_module() is for after a run, not inside a step")
        self.teardown(module)  # (called inside a run too: its hooks would shard the module again)
        gather_module(self.runtime, device)
        ShardedModule.detach(module)
        return Replicated(self.runtime.step)

    def teardown(self, module: Module | None) -> None:
        """Releases the hooks; the module stays sharded (``ShardedModule`` keeps the units)."""
        self.runtime.abandon()
        if module is not None:
            self.runtime.remove_hooks(module)

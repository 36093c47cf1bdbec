"""An average of the model's weights (EMA, SWA) kept sharded like the fp32 master weights: 4Ψ/N bytes per rank.

[Note: what is averaged]
ddp averages every parameter and buffer of its module (``torch.optim.swa_utils.AveragedModel``, a whole copy on
every rank). Here each rank averages what it holds of the weights that train, its pieces of the fp32 masters
(exactly the values ddp's fp32 parameters hold: the 16-bit copies of mixed precision are not what trains), and
of frozen stage-3 units its pieces of their shards; parameters of no unit and buffers are whole on every rank
and averaged whole. Averaging is elementwise, so each element of the average is computed from the same values
by the same functions as ddp's, and equals it bitwise: the update is torch's own ``AveragedModel`` (its
``avg_fn``, ``multi_avg_fn`` and ``use_buffers``) over a module whose parameters are these pieces, or
Lightning's SWA rule (``update_swa``).

[Note: writing the average into the model]
A swap or copy writes the master pieces (or frozen shards) and makes the parameters follow them
(``FlatUnit.follow_master``: all-gathers at stages 1-2, the shard refreshed and a gathered unit gathered again
at stage 3). Collective: every rank does it at the same callback hook. Pending post-step gathers are waited on
first (``settle``), so nothing half-written is read or overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter, ParameterList
from torch.optim.swa_utils import AveragedModel

from lightning_zero.sharding.flat_unit import FlatUnit


def _fp32(values: Sequence[Tensor]) -> list[Tensor]:
    """The values to average in fp32: what has no fp32 master (a frozen 16-bit weight) as an fp32 copy, so that
    its average is not rounded to 16 bits at every update (ddp's weights are fp32)."""
    return [v.float() if v.is_floating_point() and v.dtype != torch.float32 else v for v in values]


class _Pieces(Module):
    """The weights this rank averages, as one module's parameters and buffers (aliases, nothing copied)."""

    def __init__(self, weights: Sequence[Tensor], buffers: Sequence[Tensor]) -> None:
        super().__init__()
        self.weights = ParameterList([Parameter(w.detach(), requires_grad=False) for w in weights])
        for i, b in enumerate(buffers):
            self.register_buffer(f"b{i}", b.detach())


class WeightAverage:
    """This rank's share of an average of ``model``'s weights (see the Notes above), keyed by parameter name
    (this rank's piece of a sharded one, flat; a whole one as it is) and buffer name."""

    def __init__(
        self,
        model: Module,
        units: Sequence[FlatUnit],
        *,
        group=None,
        settle: Callable[[], None] = lambda: None,
        exported: bool = True,
        use_buffers: bool = True,
        device: torch.device | None = None,
        **averaging: Any,
    ) -> None:
        """``group``: the group the units are sharded over; ``settle``: waits for the parameters' pending
        writes; ``exported``: whether checkpoints present the average as the model's weights (format.py);
        ``averaging``: ``AveragedModel``'s ``avg_fn`` / ``multi_avg_fn``; ``device``: where the average
        lives (default: with the weights)."""
        self.model, self.units, self.group, self.settle = model, units, group, settle
        self.exported = exported
        self.use_buffers, self.device, self.averaging = use_buffers, device, averaging
        self.names: list[str] = []
        self.averaged: AveragedModel | None = None
        self._build()

    # --- what is averaged --------------------------------------------------------------------------
    def _current(self) -> tuple[list[str], list[Tensor]]:
        """(parameter names, this rank's current values of them: the fp32 masters' pieces of what trains), in the
        model's parameter order."""
        where = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        pieces = {id(u): {pc.param: pc for pc in u.layout.pieces(u.rank)} for u in self.units}
        names, values = [], []
        for name, p in self.model.named_parameters():
            if id(p) not in where:
                names.append(name)
                values.append(p.detach())
                continue
            unit, index = where[id(p)]
            if unit.trainable and unit.training.swap is not None:
                raise ValueError(
                    "weight averaging reads the fp32 master weights every update, which offload_optimizer nvme keeps"
                    " on disk: use offload_optimizer cpu (or none) with weight averaging"
                )
            piece = pieces[id(unit)].get(index)
            if piece is None:
                continue  # no element of it on this rank
            lo, n = piece.partition_offset, piece.numel
            names.append(name)
            values.append(unit.training.master_view(lo, n) if unit.trainable else unit.param_shard[lo : lo + n])
        return names, values

    def _buffers(self) -> list[Tensor]:
        return [b.detach() for b in self.model.buffers()]

    def _build(self) -> None:
        """The average, started from the current weights (as ``AveragedModel`` starts from a copy); entries
        averaged before keep their values: a parameter that moved into a unit (``add_param_group``) keeps
        this rank's piece of its whole average."""
        before = self.state() if self.averaged is not None else None
        count = self.averaged.n_averaged.clone() if self.averaged is not None else None
        self.names, values = self._current()
        self.averaged = AveragedModel(
            _Pieces(_fp32(values), self._buffers()), device=self.device, use_buffers=self.use_buffers, **self.averaging
        )
        if before is not None:
            numels = {n: p.numel() for n, p in self.model.named_parameters()}

            def read(name: str, lo: int, hi: int, out: Tensor) -> None:  # a whole average, or this rank's piece
                saved = before[name].reshape(-1)
                out.copy_(saved[lo:hi] if saved.numel() == numels[name] else saved)

            self.load(read, before)
            self.averaged.n_averaged.copy_(count)

    def units_changed(self) -> None:
        """Units were added (``add_param_group`` at stages 1-2): their parameters are averaged as pieces now."""
        self._build()

    def _pairs(self, with_buffers: bool) -> list[tuple[Tensor, Tensor]]:
        names, current = self._current()
        if names != self.names:
            raise RuntimeError(f"internal: the averaged weights {self.names} are not the model's now, {names}")
        averaged = [p.detach() for p in self.averaged.module.weights]
        pairs = list(zip(averaged, current))
        if with_buffers:
            pairs += list(zip(self.averaged.module.buffers(), self._buffers()))
        return pairs

    # --- averaging ---------------------------------------------------------------------------------
    def update_parameters(self, model: Module | None = None) -> None:
        """One update by ``AveragedModel``'s rule (``model``: the strategy's module, as Lightning passes it)."""
        self.settle()
        names, current = self._current()
        if names != self.names:
            raise RuntimeError(f"internal: the averaged weights {self.names} are not the model's now, {names}")
        self.averaged.update_parameters(_Pieces(_fp32(current), self._buffers()))

    def update_swa(self, avg_fn: Callable[[Tensor, Tensor, Tensor], Tensor], n_averaged: Tensor) -> None:
        """One update by Lightning's ``StochasticWeightAveraging.update_parameters`` rule (parameters only), which
        counts ``n_averaged`` up."""
        self.settle()
        for averaged, current in self._pairs(with_buffers=False):
            value = current.to(averaged.device, averaged.dtype)
            averaged.copy_(value if n_averaged == 0 else avg_fn(averaged, value, n_averaged.to(averaged.device)))
        n_averaged += 1

    @property
    def n_averaged(self) -> Tensor:
        """How many updates the average has taken (``AveragedModel``'s counter, a tensor updated in place)."""
        return self.averaged.n_averaged

    # --- into the model ----------------------------------------------------------------------------
    @torch.no_grad()
    def swap(self) -> None:
        """Exchanges the average and the model's weights and buffers (collective, see the Note)."""
        self.settle()
        for averaged, current in self._pairs(with_buffers=True):
            kept = averaged.clone()
            averaged.copy_(current)
            current.copy_(kept)
        self._follow()

    @torch.no_grad()
    def copy_to_model(self, *, buffers: bool = True) -> None:
        """Writes the average into the model's weights (and ``buffers``) (collective, see the Note)."""
        self.settle()
        for averaged, current in self._pairs(with_buffers=buffers):
            current.copy_(averaged)
        self._follow()

    def _follow(self) -> None:
        for unit in self.units:
            if unit.trainable:
                unit.follow_master(group=self.group)
            elif unit.gathered:  # a frozen stage-3 unit kept whole: gathered again from the written shard
                unit.unshard(async_op=False, group=self.group)

    # --- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """The averaged values by parameter name (pieces flat) and by the state dict's buffer keys (a
        non-persistent buffer is averaged, as ``AveragedModel`` averages it, but in no state dict)."""
        out = dict(zip(self.names, (p.detach() for p in self.averaged.module.weights)))
        persistent = self.model.state_dict(keep_vars=True).keys()
        named = zip((k for k, _ in self.model.named_buffers()), self.averaged.module.buffers())
        out.update((k, v) for k, v in named if k in persistent)
        return out

    def partitions(self, units: Sequence[FlatUnit]) -> list[Tensor]:
        """Each unit's averaged partition on the CPU, in fp32, laid out as its master partition (padding zero)."""
        state, out = self.state(), []
        for unit in units:
            partition = torch.zeros(unit.layout.partition_numel)
            for piece in unit.layout.pieces(unit.rank):
                lo = piece.partition_offset
                partition[lo : lo + piece.numel] = state[unit.names[piece.param]]
            out.append(partition)
        return out

    def whole(self) -> dict[str, Tensor]:
        """The averaged parameters of no unit and the buffers, by state-dict key (replicated on every rank)."""
        sharded = {n for u in self.units for n in u.names}
        return {k: v for k, v in self.state().items() if k not in sharded}

    @torch.no_grad()
    def load(self, read: Callable[[str, int, int, Tensor], None], buffers: dict[str, Tensor]) -> None:
        """Sets the average from a checkpoint: ``read(name, lo, hi, out)`` copies elements [lo, hi) of a
        parameter's averaged values into ``out``; ``buffers`` by key."""
        where = {n: (u, i) for u in self.units for i, n in enumerate(u.names)}
        for name, averaged in zip(self.names, self.averaged.module.weights):
            lo = 0
            if name in where:  # this rank's piece
                unit, index = where[name]
                lo = next(pc.lo for pc in unit.layout.pieces(unit.rank) if pc.param == index)
            flat = averaged.detach().view(-1)
            read(name, lo, lo + flat.numel(), flat)
        for (key, _), averaged in zip(self.model.named_buffers(), self.averaged.module.buffers()):
            if key in buffers:  # (a non-persistent buffer is in no state dict)
                averaged.copy_(buffers[key])

    @torch.no_grad()
    def restart(self) -> None:
        """The average starts again from the current weights (a checkpoint without one), its count kept."""
        for averaged, current in self._pairs(with_buffers=True):
            averaged.copy_(current)

    # What Lightning's callbacks call on the object they hold as their averaged model (the state travels in
    # the checkpoint's shards, written by the strategy, not in the callback's state).
    def state_dict(self) -> dict[str, Any]:
        """Nothing: the average is saved in the checkpoint's shards by the strategy, not in the callback's state."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """An earlier version's SWA checkpoint keeps the whole averaged module in the callback's state."""
        if state_dict:
            self.load(lambda name, lo, hi, out: out.copy_(state_dict[name].reshape(-1)[lo:hi]), state_dict)

    def to(self, device: Any) -> WeightAverage:
        """Itself, unmoved: the average stays where it was built (``device``), whatever a callback asks."""
        return self

    def nbytes(self) -> int:
        """This rank's share of the average in bytes, as ``state`` holds it (the memory report's ``weight_average``)."""
        return sum(t.numel() * t.element_size() for t in self.state().values())

"""The whole model's state dict from its flat units, gathered one unit at a time, and its parameters' norms,
gathered not at all (collectives both).

A parameter that trains in 16 bits is taken from its fp32 master partitions (what the optimizer steps and
what checkpoints hold), as ddp returns its fp32 weights: the 16-bit copy the forward reads would lose the
low bits of every weight. Any other parameter is taken as it is (a frozen one cast to 16 bits by stage 3
stays so: it has no master), stage 3 gathering its unit for the moment of the copy. Peak memory: the
state dict on the CPU plus one unit (one bucket, for masters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.swapped import resident


def needs_masters(unit: FlatUnit) -> bool:
    """Whether ``unit``'s weights are read from its masters: it trains, in 16 bits (the same on every rank)."""
    return unit.trainable and unit.training.master is not None and unit.param_dtype != torch.float32


def gather_masters(unit: FlatUnit, *, group=None) -> Iterator[tuple[int, Tensor]]:
    """(index in the unit, the parameter's whole fp32 master weights, flat, on the CPU), one bucket's all-gather at a
    time: every rank's chunk of a bucket, in rank order, is the bucket's flat values, and a parameter lies in
    one bucket (layout.py). Memory: one bucket on the device and on the CPU besides the values yielded."""
    partition = unit.training.master_partition()
    layout = unit.layout
    for bucket in layout.buckets:
        chunk = partition[bucket.partition_offset : bucket.partition_offset + bucket.chunk_numel]
        gathered = torch.empty(bucket.numel, dtype=torch.float32, device=partition.device)
        collectives.all_gather(gathered, chunk, async_op=False, group=group)
        values = gathered.cpu()
        for i in range(bucket.first_param, bucket.end_param):
            lo = layout.offsets[i] - bucket.start
            yield i, values[lo : lo + layout.numels[i]].clone()


def full_state_dict(
    model: Module,
    units: Sequence[FlatUnit],
    hold: Callable[[FlatUnit], AbstractContextManager],
    *,
    group=None,
    host_group=None,
) -> dict[str, Tensor]:
    """The unsharded state dict (keys as ``model.state_dict()``; tied keys share a tensor), on the CPU.
    ``hold(unit)``: keeps a unit's parameters whole inside it (stage 3 gathers them, placement.py);
    ``group``/``host_group``: the groups the masters are sharded over (the host one for masters on the host)."""
    entries = model.state_dict(keep_vars=True)
    owner = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
    out = {k: v.detach().to("cpu", copy=True) for k, v in entries.items() if id(v) not in owner}
    for unit in units:
        keys = {k: owner[id(v)][1] for k, v in entries.items() if owner.get(id(v), (None,))[0] is unit}
        if needs_masters(unit):
            with resident(unit):
                on_host = unit.training.master_partition().device.type == "cpu"
                masters = gather_masters(unit, group=host_group if on_host else group)
                values = {i: v.view(unit.shapes[i]) for i, v in masters}
        else:
            with hold(unit):
                values = {i: unit.params[i].detach().to("cpu", copy=True) for i in set(keys.values())}
        out.update({k: values[i] for k, i in keys.items()})
    return {k: out[k] for k in entries}


def parameter_norms(model: Module, units: Sequence[FlatUnit], norm_type: float, *, group=None) -> dict[str, Tensor]:
    """Each parameter's ``norm_type``-norm and their total, keyed as Lightning's ``grad_norm`` keys its results
    (``weight_{p}_norm/<name>``, ``weight_{p}_norm_total``), with nothing gathered: every rank sums its pieces
    (the fp32 masters of what trains, the shards of what stage 3 keeps frozen) and one all-reduce of the
    partial sums, on the host over ``group`` (a CPU group), adds them up. Parameters of no unit are whole on
    every rank and read in place. Collective: call it on every rank."""
    if not 0 < norm_type < float("inf"):
        raise ValueError(f"norm_type must be a finite number > 0, got {norm_type!r}")
    names, partials = [], []
    for unit in units:
        sums = torch.zeros(len(unit.params), dtype=torch.float64)
        with resident(unit):
            for piece in unit.layout.pieces(unit.rank):
                lo, n = piece.partition_offset, piece.numel
                values = unit.training.master_view(lo, n) if unit.trainable else unit.param_shard[lo : lo + n]
                sums[piece.param] += values.double().abs().pow(norm_type).sum().cpu()
        names += unit.names
        partials.append(sums)
    summed = torch.cat(partials) if partials else torch.zeros(0, dtype=torch.float64)
    collectives.all_reduce(summed, dist.ReduceOp.SUM, group=group)
    owned = {id(p) for u in units for p in u.params}
    whole = [(n, p) for n, p in model.named_parameters() if id(p) not in owned]
    names += [n for n, _ in whole]
    local = [p.detach().double().abs().pow(norm_type).sum().cpu().reshape(1) for _, p in whole]
    summed = torch.cat([summed, *local])
    key = f"weight_{float(norm_type)}_norm"
    out = {f"{key}/{name}": s.pow(1.0 / norm_type).float() for name, s in zip(names, summed)}
    out[f"{key}_total"] = summed.sum().pow(1.0 / norm_type).float()
    return out

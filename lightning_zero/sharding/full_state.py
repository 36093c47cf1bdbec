"""The whole model's state dict from its flat units, gathered one unit at a time (collective).

A parameter that trains under mixed precision is taken from its fp32 master partitions (what the
optimizer steps and what checkpoints hold), as ddp returns its fp32 weights: the 16-bit copy the forward
reads would lose the low bits of every weight. Any other parameter is taken as it is, stage 3 gathering
its unit for the moment of the copy. Peak memory: the state dict on the CPU plus one unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import Module

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.stage3 import Stage3Runtime


def needs_masters(unit: FlatUnit) -> bool:
    """Whether ``unit``'s weights are read from its masters: it trains, in 16 bits (the same on every rank)."""
    return unit.master is not None and unit.param_dtype != torch.float32


def gather_masters(unit: FlatUnit, *, group=None) -> Tensor:
    """The unit's fp32 master weights, every rank's partition, laid out as its flat buffer, on the CPU.

    Rank r's partition is chunk r of every bucket, bucket after bucket (layout.py): after one all-gather
    of the partitions each bucket's chunks are copied back into place."""
    partition = unit.master_partition()
    world = unit.layout.world_size
    gathered = torch.empty(world * partition.numel(), dtype=torch.float32, device=partition.device)
    collectives.all_gather(gathered, partition, async_op=False, group=group)
    by_rank = gathered.view(world, -1).cpu()  # [world, partition_numel]
    flat = torch.empty(unit.layout.total_numel, dtype=torch.float32)
    for bucket in unit.layout.buckets:
        chunks = by_rank[:, bucket.partition_offset : bucket.partition_offset + bucket.chunk_numel]
        flat[bucket.start : bucket.start + bucket.numel].view(world, -1).copy_(chunks)
    return flat


def full_state_dict(
    model: Module, units: Sequence[FlatUnit], runtime: Stage3Runtime | None, *, group=None, host_group=None
) -> dict[str, Tensor]:
    """The unsharded state dict (keys as ``model.state_dict()``; tied keys share a tensor), on the CPU.
    ``runtime``: stage 3's, which gathers a unit's parameters; ``group``/``host_group``: the groups the
    masters are sharded over (the host one for masters in host memory)."""
    entries = model.state_dict(keep_vars=True)
    owner = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
    out = {k: v.detach().to("cpu", copy=True) for k, v in entries.items() if id(v) not in owner}
    for unit in units:
        keys = {k: owner[id(v)][1] for k, v in entries.items() if owner.get(id(v), (None,))[0] is unit}
        if needs_masters(unit):
            on_host = unit.master_partition().device.type == "cpu"
            flat = gather_masters(unit, group=host_group if on_host else group)
            offsets, numels = unit.layout.offsets, unit.layout.numels
            values = {i: flat[offsets[i] : offsets[i] + numels[i]].view(unit.shapes[i]) for i in set(keys.values())}
        else:
            with runtime.gathered(unit) if runtime is not None else contextlib.nullcontext():
                values = {i: unit.params[i].detach().to("cpu", copy=True) for i in set(keys.values())}
        out.update({k: values[i] for k, i in keys.items()})
    return {k: out[k] for k in entries}

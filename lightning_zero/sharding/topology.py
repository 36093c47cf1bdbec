"""Which ranks shard together: the whole world, or (hybrid sharding) groups of K consecutive ranks whose
states are replicas of each other.

[Note: hybrid sharding]
With ``ZeroConfig(shard_group_size=K)`` the N ranks form N / K shard groups of K consecutive ranks
(``"node"``: the ranks of one node, so K = devices per node). Inside a shard group everything is as
in plain ZeRO over K ranks: the layouts partition over K, gradients are reduce-scattered and parameters
all-gathered on the shard group. Rank s of every shard group holds the same partition, and the
"replicate group" of those N / K ranks all-reduces it once per optimizer step, at the step (an event
every rank reaches in the same order, after the last micro-batch's reductions): the sum over replicas,
divided by their number, is the average over all N ranks. Bytes per rank per step across shard
groups: 2 * (R - 1) / R times the partition (Psi / K elements) for a ring all-reduce over R = N / K
replicas, instead of the ~2 Psi a world-wide reduce-scatter and all-gather send across nodes.
Decisions that must be global (which parameters got a gradient anywhere, fp16 overflow) are made on
the world or after the replica sum, so every rank takes the same step. A checkpoint is written by
the first shard group (its files are the ranks' partitions over K ranks) and loads at any K and world
size, like any other.

[Note: making groups]
``torch.distributed.new_group`` is collective over the whole world: every rank creates every group, in
the same order, even those it is not in (``new_subgroups_by_enumeration`` does exactly that). The
host (gloo) groups that offloaded state reduces on are made the same way, here, when the backend is not
gloo: ``collectives.host_group`` would otherwise make one lazily, on one group's ranks only.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_zero.sharding import collectives


@dataclass(frozen=True)
class Topology:
    """This rank's place: rank ``shard_rank`` of a shard group of ``shard_size`` ranks (the layouts'
    rank and world size), in replica ``replica`` of ``replicas``. Without hybrid sharding both groups are
    None (the shard group is the world, and there are no replicas)."""

    shard_rank: int
    shard_size: int
    replica: int = 0
    replicas: int = 1
    shard_group: Any = None
    replicate_group: Any = None

    @property
    def writes_checkpoint_shards(self) -> bool:
        """The first shard group writes the checkpoint's shards; the other replicas hold the same."""
        return self.replica == 0


def resolve_shard_size(setting: int | str | None, *, world_size: int, local_world_size: int) -> int:
    """K for ``ZeroConfig.shard_group_size``: None is the world, "node" the ranks of one node."""
    size = world_size if setting is None else local_world_size if setting == "node" else setting
    if world_size % size:
        raise ValueError(
            f"zero.shard_group_size must divide the world size {world_size}, got {setting!r}"
            + (f" ({size} ranks per node)" if setting == "node" else "")
        )
    return size


_MADE: dict[tuple, Topology] = {}  # (default group, shard size) -> the topology made for it


def make_topology(
    setting: int | str | None, *, rank: int, world_size: int, local_world_size: int, timeout: timedelta | None = None
) -> Topology:
    """The topology for ``setting`` (collective when hybrid and not made before on this process group: see
    [Note: making groups]); its groups time out after ``timeout`` like the world's."""
    size = resolve_shard_size(setting, world_size=world_size, local_world_size=local_world_size)
    collectives.host_group(None, timeout=timeout)  # the world's gloo twin under NCCL, with this timeout
    if size == world_size:
        return Topology(shard_rank=rank, shard_size=world_size)
    key = (id(dist.distributed_c10d._get_default_group()), size)
    if key not in _MADE:  # every Trainer call sets the strategy up again: the groups are made once
        if not _MADE:
            atexit.register(_destroy)
        _MADE[key] = _make(rank, world_size, size, timeout)
    return _MADE[key]


def _destroy() -> None:
    """At exit, before the interpreter tears its modules down: left to that teardown, a gloo subgroup's
    threads were sometimes destroyed unjoined (the process aborts: "terminate called without an active
    exception", about 1 exit in 6 under torchrun). Local: no collective."""
    groups = [g for t in _MADE.values() for g in (t.shard_group, t.replicate_group)]
    groups += [collectives.host_group(g) for g in groups if collectives.host_group(g) is not g]
    _MADE.clear()
    for group in groups:
        if dist.is_initialized():
            dist.destroy_process_group(group)


def _make(rank: int, world_size: int, size: int, timeout: timedelta | None) -> Topology:
    replicas = world_size // size
    shards = [list(range(r * size, (r + 1) * size)) for r in range(replicas)]
    copies = [list(range(s, world_size, size)) for s in range(size)]
    shard_group = _subgroups(shards, "shard", timeout)
    replicate_group = _subgroups(copies, "replicate", timeout)
    return Topology(
        shard_rank=rank % size,
        shard_size=size,
        replica=rank // size,
        replicas=replicas,
        shard_group=shard_group,
        replicate_group=replicate_group,
    )


def _subgroups(ranks: list[list[int]], role: str, timeout: timedelta | None):
    """This rank's group among ``ranks`` (and its gloo twin for host tensors when the backend is not gloo)."""
    mine, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
    collectives.name_group(mine, role)
    if "gloo" not in str(dist.get_backend()):
        host, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout, backend="gloo")
        collectives.name_group(host, role)
        collectives.set_host_group(mine, host)
    return mine

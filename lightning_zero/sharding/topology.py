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
host (gloo) groups that host tensors (offloaded state, flags kept on the host) reduce on are made the same
way, here, when the backend is not gloo. A topology belongs to the strategy that made it; its groups live as
long as the default process group they were made on (destroying that destroys them: resilience/elastic.py).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


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
    # A weak reference to the default process group the groups were made on: a strong one would keep that group
    # and its gloo threads alive past destroy_process_group, and a thread that frees a finished collective's
    # tensor while the interpreter exits aborts the process ("terminate called without an active exception").
    world: weakref.ref | None = None
    host_world: Any = None  # the gloo twins of the world, shard and replicate groups (themselves under gloo)
    host_shard: Any = None
    host_replicate: Any = None
    # ZeRO++'s two levels (hpZ, qgZ): this rank is rank ``node_rank`` of the ``node_size`` consecutive ranks of
    # its node (``node_group``; None: the world), and ``cross_group`` joins the ranks of the same node rank on
    # every node (None when there is one node).
    node_rank: int = 0
    node_size: int = 1
    node_group: Any = None
    cross_group: Any = None

    def host(self, group) -> Any:
        """The group over the same ranks as ``group`` (None: the world) that takes CPU tensors."""
        for made, host in (
            (None, self.host_world),
            (self.shard_group, self.host_shard),
            (self.replicate_group, self.host_replicate),
        ):
            if group is made:
                return host
        raise ValueError(f"{group} is none of this topology's groups")

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


def make_topology(
    setting: int | str | None,
    *,
    rank: int,
    world_size: int,
    local_world_size: int,
    timeout: timedelta | None = None,
    node_size: int | None = None,
) -> Topology:
    """The topology for ``setting`` on the default process group (collective: see [Note: making groups]);
    its groups time out after ``timeout`` like the world's. ``node_size``: ZeRO++'s ranks per node (None:
    no node groups)."""
    if node_size is not None:
        topology = _shards(setting, rank, world_size, local_world_size, timeout)
        return _with_nodes(topology, rank, world_size, node_size, timeout)
    return _shards(setting, rank, world_size, local_world_size, timeout)


def _with_nodes(topology: Topology, rank: int, world_size: int, node_size: int, timeout: timedelta | None) -> Topology:
    if world_size % node_size:
        raise ValueError(f"zero.node_size must divide the world size {world_size}, got {node_size}")
    nodes = world_size // node_size
    if nodes == 1:
        return dataclasses.replace(topology, node_rank=rank, node_size=node_size)
    by_node = [list(range(n * node_size, (n + 1) * node_size)) for n in range(nodes)]
    across = [list(range(j, world_size, node_size)) for j in range(node_size)]
    node_group, _ = dist.new_subgroups_by_enumeration(by_node, timeout=timeout, group_desc="node")
    cross_group, _ = dist.new_subgroups_by_enumeration(across, timeout=timeout, group_desc="cross")
    return dataclasses.replace(
        topology, node_rank=rank % node_size, node_size=node_size, node_group=node_group, cross_group=cross_group
    )


def _shards(
    setting: int | str | None, rank: int, world_size: int, local_world_size: int, timeout: timedelta | None
) -> Topology:
    size = resolve_shard_size(setting, world_size=world_size, local_world_size=local_world_size)
    world = weakref.ref(dist.distributed_c10d._get_default_group())
    twins = "gloo" not in str(dist.get_backend())
    host_world = dist.new_group(backend="gloo", timeout=timeout) if twins else None
    if size == world_size:
        return Topology(shard_rank=rank, shard_size=world_size, world=world, host_world=host_world)
    replicas = world_size // size
    shards = [list(range(r * size, (r + 1) * size)) for r in range(replicas)]
    copies = [list(range(s, world_size, size)) for s in range(size)]
    shard_group, host_shard = _subgroups(shards, "shard", timeout, twins)
    replicate_group, host_replicate = _subgroups(copies, "replicate", timeout, twins)
    return Topology(
        shard_rank=rank % size,
        shard_size=size,
        replica=rank // size,
        replicas=replicas,
        shard_group=shard_group,
        replicate_group=replicate_group,
        world=world,
        host_world=host_world,
        host_shard=host_shard,
        host_replicate=host_replicate,
    )


def _subgroups(ranks: list[list[int]], role: str, timeout: timedelta | None, twins: bool) -> tuple[Any, Any]:
    """This rank's group among ``ranks``, named by its role (see collectives.group_role), and its gloo twin for
    host tensors (the group itself under gloo)."""
    mine, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout, group_desc=role)
    if not twins:
        return mine, mine
    host, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout, backend="gloo", group_desc=role)
    return mine, host


def topology_for(topology: Topology, config: Any, rank: int, world_size: int, local_world_size: int) -> Topology:
    """``topology`` if it was made on the current default process group, else a new one for ``config``'s
    ``shard_group_size`` (made once per process group: fit, then test keep it). Collective with hybrid
    sharding: every rank calls it at the same point."""
    if topology.world is not None and topology.world() is dist.distributed_c10d._get_default_group():
        return topology
    zero_plus_plus = config.secondary_partition or config.quantized_gradients
    return make_topology(
        config.shard_group_size,
        rank=rank,
        world_size=world_size,
        local_world_size=local_world_size,
        timeout=timedelta(seconds=config.timeout),
        node_size=(config.node_size or local_world_size) if zero_plus_plus else None,
    )

"""Sequence parallelism as a model and its data use it: the groups, a rank's slice, its positions, its attention.

[Note: sequence-parallel groups]
``sequence_parallel(K)`` splits the world into groups of K consecutive ranks. The ranks of a group hold the same
samples and each the slice of their sequence at its place in the group (``split``: positions ``r*S/K`` to
``(r+1)*S/K``, ``positions`` their global indices), and attention runs across the group (``attention``: Ulysses,
ulysses.py). The N/K groups are the data-parallel replicas: a sampler gives replica ``data_rank`` of
``data_size`` its samples. ZeRO shards the model states over all N ranks as before, the sequence-parallel ranks
included (as DeepSpeed does): to it they are data-parallel ranks, and averaging their gradients over N is exact
when each rank's loss is the mean over its slice and the slices are equally long, since the N/K replicas' means
of K equal slices are the replicas' whole-sequence means. So a sequence length K does not divide is refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.config import ZeroConfig
from lightning_zero.sequence.ulysses import ulysses_attention
from lightning_zero.sharding import collectives


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place: slice ``rank`` of ``size`` in its sequence-parallel ``group``, in data-parallel replica
    ``data_rank`` of ``data_size`` (see [Note: sequence-parallel groups])."""

    group: Any
    rank: int
    size: int
    data_rank: int
    data_size: int
    world: Any = None  # a weak reference to the default process group the groups were made on

    def sampler_kwargs(self) -> dict[str, int]:
        """A distributed sampler's: the ranks of a group read the same samples (its replica's)."""
        return {"num_replicas": self.data_size, "rank": self.data_rank}

    def split(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's slice of ``tensor``'s sequence dimension ``dim`` (pad sequences to a multiple of the size:
        a group that cannot split its batch raises there alone, and the others wait for it)."""
        length = tensor.shape[dim]
        if length % self.size:
            raise ValueError(f"a sequence of {length} tokens does not split into sequence_parallel_size {self.size}")
        return tensor.narrow(dim, self.rank * (length // self.size), length // self.size).contiguous()

    def positions(self, length: int, device: torch.device | None = None) -> Tensor:
        """The global positions of this rank's slice, ``length`` tokens long (the slice's length, not the whole's)."""
        return torch.arange(self.rank * length, (self.rank + 1) * length, device=device)

    def check_sliced(self, tokens: Tensor) -> None:
        """Refuses, on every rank of the group, inputs that are the same on all of them: the whole sequence given
        where each rank's slice (``split``) was due, which would train on the sequence repeated K times. Collective
        over the group (an all-gather of ``tokens``): a model calls it once, on its first input."""
        gathered = torch.empty((self.size, *tokens.shape), dtype=tokens.dtype, device=tokens.device)
        collectives.all_gather(gathered, tokens.contiguous(), async_op=False, group=self.group)
        if bool((gathered == gathered[:1]).all()):
            raise ValueError(
                f"the {self.size} ranks of a sequence-parallel group got the same tokens: give each rank its slice of"
                " the sequence (sequence.split(tokens))"
            )

    def slice_mean(self, total: Tensor, count: Tensor) -> Tensor:
        """This rank's loss from its slice's sum of losses ``total`` over its ``count`` real tokens: the group's mean
        over its real tokens (``mean_over_tokens`` over the group, whose ranks hold the same samples, so it runs in
        any step, uneven evaluation included), times K, so that the ranks' average over the group is that mean."""
        return mean_over_tokens(total, count, world_size=self.size, group=self.group)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, attention: Callable[..., Tensor], **kwargs: Any) -> Tensor:
        """``attention`` over the group's whole sequence for this rank's slices ``[B, heads, S/K, D]``."""
        return ulysses_attention(q, k, v, attention, group=self.group, **kwargs)


def sequence_parallel(size: int, *, timeout: Any = None) -> SequenceParallel:
    """The groups of ``size`` consecutive ranks (collective: every rank calls it, after the process group exists)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
        raise ValueError(f"sequence_parallel_size must be an integer >= 1 that divides the {world} ranks, got {size!r}")
    groups = [list(range(start, start + size)) for start in range(0, world, size)]
    group, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout, group_desc="sequence")
    default = weakref.ref(dist.distributed_c10d._get_default_group())
    return SequenceParallel(group, rank % size, size, rank // size, world // size, default)


def groups_for(made: SequenceParallel | None, config: ZeroConfig, *, timeout: Any = None) -> SequenceParallel | None:
    """``config.sequence_parallel_size``'s groups: ``made`` if it was made on the current default process group
    (fit, then test), else new ones (collective); None for a size of 1."""
    size = config.sequence_parallel_size
    if size == 1:
        return None
    if made is not None and made.world is not None and made.world() is dist.distributed_c10d._get_default_group():
        return made
    return sequence_parallel(size, timeout=timeout)


def token_mean(losses: Tensor, kept: Tensor, *, world_size: int, group: Any = None) -> Tensor:
    """The mean of ``losses`` over the tokens ``kept`` marks on every rank of ``group`` (the global batch's real
    tokens: padding and masked targets left out), as each rank's loss: ``world_size * sum(kept losses) / count``,
    so that averaging the ranks' gradients (as ZeRO does) gives that mean's, and averaging the ranks' values (a
    logged ``sync_dist`` mean) gives the mean itself. A rank's slices hold different numbers of real tokens; the mean
    of per-rank means would weigh them wrongly. Collective: every rank calls it once per micro-batch (so not in an
    evaluation step whose ranks hold different numbers of batches: a rank that ran out replays only the engine's own
    collectives, as with ``self.log(sync_dist=True)`` under ddp)."""
    return mean_over_tokens(losses.masked_fill(~kept, 0).sum(), kept.sum(), world_size=world_size, group=group)


def mean_over_tokens(total: Tensor, count: Tensor, *, world_size: int, group: Any = None) -> Tensor:
    """``token_mean`` from this rank's sum of losses ``total`` over its ``count`` real tokens (a tiled loss's)."""
    count = collectives.all_reduce(count.to(total.dtype), dist.ReduceOp.SUM, group=group)
    return total * world_size / count

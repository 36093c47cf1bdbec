"""Data order that a checkpoint can resume in the middle of an epoch, at any world size.

Lightning saves the state of a training dataloader that has ``state_dict``/``load_state_dict`` (torchdata's
``StatefulDataLoader``) into the checkpoint's loop state and restores it on resume, so the epoch continues
where it stopped instead of starting over. What the loader saves about the order is its sampler's state.
A ``DistributedSampler``'s position is per rank ("this rank took 40 indices"), which only means the same
thing at the same world size; ``ResumableSampler``'s position is the whole world's.

[Note: the resumable order]
Every epoch is one permutation of the dataset, drawn from ``seed + epoch`` exactly as DistributedSampler
draws it, and the world walks it in strides of W: rank r takes positions begin + r, begin + r + W, ...
When every rank has taken k indices, positions [0, begin + kW) have been consumed, whichever ranks took
them, and that count is the state. Resumed on W' ranks, rank r takes begin' + r, begin' + r + W', ... of the
same permutation: nothing consumed is seen again and nothing is skipped (``drop_last`` drops the tail that
does not divide evenly, as DistributedSampler does; without it the tail is padded from the front). With
begin = 0 the order is DistributedSampler's own, so switching to it changes nothing in a fresh run.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

# torchdata 0.11 calls torch.set_vital on every iterator, which torch 2.13 deprecates with a warning per
# process that users cannot act on; only that warning is silenced.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class ResumableSampler(DistributedSampler):
    """DistributedSampler's order whose state is the world's position in the epoch (see the module Note).

    Lightning leaves it in place (it is a DistributedSampler) and calls ``set_epoch``. The rank, world size
    and seed default to the process group's (one process without one) and ``PL_GLOBAL_SEED``, read when the
    sampler is used, so it can be made before the process group exists.

    Use it (usually through ``resumable_loader``) for a training loader that a checkpoint taken in the middle
    of an epoch resumes exactly, at the same or another world size: its ``state_dict`` is the whole world's
    position in the epoch's permutation, which a torchdata ``StatefulDataLoader`` saves in the checkpoint.
    With nothing resumed, its order is ``DistributedSampler``'s own.

    Args:
        dataset: the dataset to sample (sized).
        shuffle: draw each epoch's permutation from ``seed + epoch``, as DistributedSampler; False: in order.
        seed: the permutations' seed; None: ``PL_GLOBAL_SEED`` (what ``seed_everything`` set), else 0.
        drop_last: drop the tail that does not divide evenly over the ranks; False: pad it from the front.
        num_replicas: the ranks sharing the data; None: the process group's world size (1 without one).
        rank: this process's rank among them; None: its rank in the process group (0 without one).

    Raises:
        ValueError: ``load_state_dict`` of a state saved for another dataset size or seed (a different order),
            or of a position outside the dataset.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        # Not DistributedSampler.__init__: it reads the world size now, and a loader is often made before
        # the process group exists (in the script Lightning launches on every rank). Read when iterated.
        self.dataset, self.shuffle, self.drop_last, self.epoch = dataset, shuffle, drop_last, 0
        self._replicas, self._rank, self._seed = num_replicas, rank, seed
        self._begin = 0  # position in the permutation where this epoch's iteration started
        self._taken = 0  # indices this rank has taken since then
        self._resume: dict[str, int] | None = None  # a loaded state, used by the next iteration of its epoch
        self._epoch_set = False  # set_epoch was called: a loaded state of another epoch has nothing to resume

    @property
    def seed(self) -> int:
        """The permutations' seed: the one given, else ``seed_everything``'s (``PL_GLOBAL_SEED``), else 0."""
        return self._seed if self._seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    @property
    def num_replicas(self) -> int:
        """The ranks sharing the data: the one given, else the process group's world size (1 without one)."""
        if self._replicas is not None:
            return self._replicas
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        """This process's rank among them: the one given, else its process group rank (0 without one)."""
        if self._rank is not None:
            return self._rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def num_samples(self) -> int:
        """Indices per rank in a whole epoch (Lightning counts an epoch's batches from it)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return n // self.num_replicas if self.drop_last else -(-n // self.num_replicas)

    @property
    def total_size(self) -> int:
        """Indices per epoch over all the ranks (padding included, as DistributedSampler's)."""
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def _permutation(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:  # a generator: the position is read when the first index is asked for
        resume, self._resume = self._resume, None
        begin = resume["consumed"] if resume is not None and resume["epoch"] == self.epoch else 0
        order = self._permutation()
        remaining = order[begin:]
        per_rank = len(remaining) // self.num_replicas if self.drop_last else -(-len(remaining) // self.num_replicas)
        total = per_rank * self.num_replicas
        if len(remaining) < total:  # pad from the front of the permutation, as DistributedSampler does
            remaining += (order * math.ceil(total / max(len(order), 1)))[: total - len(remaining)]
        self._begin, self._taken = begin, 0
        for index in remaining[self.rank : total : self.num_replicas]:
            self._taken += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        self._epoch_set = True
        if epoch != self.epoch:  # a new epoch: nothing of it is consumed yet, whatever the last one reached
            self._begin, self._taken = 0, 0
            if self._resume is not None and self._resume["epoch"] != epoch:
                self._resume = None
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """The world's position: the epoch, the indices of its permutation consumed by all the ranks together,
        the dataset's size and the seed (a loaded state not yet iterated: that state)."""
        if self._resume is not None:  # loaded, not iterated yet
            return dict(self._resume)
        consumed = min(self._begin + self._taken * self.num_replicas, len(self.dataset))  # type: ignore[arg-type]
        return {"epoch": self.epoch, "consumed": consumed, "dataset_size": len(self.dataset), "seed": self.seed}  # type: ignore[arg-type]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes the next iteration of ``state``'s epoch where the world left it, at any world size; a state of
        an epoch other than the one ``set_epoch`` has already set is ignored (that epoch starts afresh).

        Args:
            state: what ``state_dict`` returned.

        Raises:
            ValueError: ``state`` was saved for another dataset size or seed, or its position is outside the
                dataset.
        """
        size = len(self.dataset)  # type: ignore[arg-type]
        if state.get("dataset_size") != size or state.get("seed") != self.seed:
            raise ValueError(
                f"cannot resume the data order: it was saved for {state.get('dataset_size')} samples with seed"
                f" {state.get('seed')}, this sampler has {size} samples with seed {self.seed} (a different order)"
            )
        if not 0 <= int(state["consumed"]) <= size:
            raise ValueError(f"cannot resume the data order at position {state['consumed']} of {size}")
        if self._epoch_set and int(state["epoch"]) != self.epoch:
            return  # Lightning moved on to the next epoch (a checkpoint at an epoch's last batch): start it
        self._resume = {k: int(v) for k, v in state.items()}
        self.epoch = self._resume["epoch"]


class ResumableDataLoader(StatefulDataLoader):
    """torchdata's StatefulDataLoader whose iterator starts when the first batch is asked for.

    [Note: the iterator starts at the first batch]
    Lightning makes the training loader's iterator at set-up and calls ``set_epoch`` after it. With
    workers, torchdata's iterator takes its first indices as it is made, so the sampler would be read
    before it knows the epoch: resumed from a checkpoint taken at an epoch's last batch, Lightning goes on
    with the next epoch (``set_epoch(e + 1)``) over an iterator already holding epoch e's empty rest, and
    a whole epoch is skipped. (Resumed from a checkpoint that Lightning's own counters place inside epoch
    e, as after a chain of resumes, it calls ``set_epoch(e)`` and the rest is rightly empty.) Started at
    the first ``next``, the iterator hands the sampler its saved state (and takes indices) after
    ``set_epoch``, with or without workers, and the sampler resumes the position only if it is of the
    epoch Lightning set.
    """

    def __iter__(self) -> Iterator:
        return _StartsAtFirstBatch(self)


class _StartsAtFirstBatch:
    def __init__(self, loader: ResumableDataLoader) -> None:
        self._loader, self._iterator = loader, None

    def __iter__(self) -> _StartsAtFirstBatch:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = StatefulDataLoader.__iter__(self._loader)
        return next(self._iterator)


def resumable_loader(
    dataset: Sized,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    drop_last: bool = True,
    **loader_kwargs: Any,
) -> ResumableDataLoader:
    """A training loader that a mid-epoch checkpoint resumes exactly, at the same or another world size:
    torchdata's StatefulDataLoader (Lightning saves its state; see ``ResumableDataLoader``) over a
    ``ResumableSampler``.

    ``drop_last`` applies to the sampler (the tail that does not divide evenly over the ranks) and to the
    batches, so every rank runs the same number of steps. The loader draws its workers' base seed from a
    generator of its own, not from torch's global one, so that making an iterator (Lightning makes one at
    set-up and at each epoch) draws nothing that a resumed run would draw at another point.

    Args:
        dataset: the training dataset (sized).
        batch_size: samples per batch on each rank.
        shuffle: a new permutation every epoch (from ``seed + epoch``); False: in order.
        seed: the permutations' seed; None: ``PL_GLOBAL_SEED``, else 0. The loader's own generator (the workers'
            base seed) starts from it (0 for None) unless ``loader_kwargs`` gives a ``generator``.
        drop_last: drop the tail that does not divide evenly over the ranks and the last incomplete batch.
        **loader_kwargs: more arguments of the loader (``num_workers``, ``collate_fn``, ``generator``, ...).

    Returns:
        The loader, to return from ``train_dataloader`` (Lightning leaves its sampler in place).

    Raises:
        TypeError: ``loader_kwargs`` holds ``sampler`` (this function makes it).
        ValueError: ``loader_kwargs`` holds ``batch_sampler``, which excludes ``batch_size`` and ``sampler``.

    Example:
        ```python
        def train_dataloader(self):
            return lightning_zero.resumable_loader(self.dataset, batch_size=8, num_workers=2)
        ```
    """
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(0 if seed is None else seed))
    sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
    return ResumableDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)

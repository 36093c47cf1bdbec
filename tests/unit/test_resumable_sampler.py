"""The resumable sampler's position, in one process: it is the world's (any world size resumes it), and a position
saved at an epoch's end resumes the next epoch whole, with or without workers (resuming runs:
tests/dist/test_resume_mid_epoch.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_zero.resilience.resumable_data import ResumableSampler, resumable_loader


def test_sampler_position_is_the_worlds():
    """Unit level: from the start it is DistributedSampler's order; 4 ranks take 5 indices each, then 2 or 3
    ranks take the rest of the permutation."""
    data = list(range(50))
    for rank in range(3):
        ours, torchs = (
            ResumableSampler(data, num_replicas=3, rank=rank, seed=3),
            DistributedSampler(data, 3, rank, seed=3),
        )
        ours.set_epoch(1), torchs.set_epoch(1)
        assert list(ours) == list(torchs) and len(ours) == len(torchs)
    taken, states = [], []
    for rank in range(4):
        sampler = ResumableSampler(data, num_replicas=4, rank=rank, seed=3, drop_last=True)
        sampler.set_epoch(2)
        it = iter(sampler)
        taken += [next(it) for _ in range(5)]
        states.append(sampler.state_dict())
    assert all(s == states[0] for s in states) and states[0]["consumed"] == 20
    for world in (2, 3):
        rest = []
        for rank in range(world):
            sampler = ResumableSampler(data, num_replicas=world, rank=rank, seed=3, drop_last=True)
            sampler.load_state_dict(states[0])
            sampler.set_epoch(2)
            rest += list(sampler)
        assert len(set(taken + rest)) == len(taken + rest) == 20 + 30 // world * world
    with pytest.raises(ValueError, match="saved for 50 samples with seed 3, this sampler has 49 samples"):
        ResumableSampler(data[:49], seed=3).load_state_dict(states[0])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_position_saved_at_the_end_of_an_epoch_resumes_the_next_whole(workers):
    """Lightning makes the loader's iterator at set-up and then calls set_epoch: e + 1 after a checkpoint at
    epoch e's last batch, or e when its own counters put the checkpoint inside epoch e (after a chain of
    resumes), and then e + 1. Either way the next epoch comes whole, with or without workers (which take
    indices as soon as their iterator starts: see [Note: the iterator starts at the first batch])."""
    data = TensorDataset(torch.arange(40))
    loader = resumable_loader(data, 4, seed=5, num_workers=workers)
    loader.sampler.set_epoch(0)
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(10)]  # the last batch, and no StopIteration yet: as Lightning
    state = loader.state_dict()
    assert loader.sampler.state_dict()["consumed"] == 40
    loader.sampler.set_epoch(1)  # a new epoch: its position is 0 until it is iterated
    assert loader.sampler.state_dict()["consumed"] == 0

    def resume(*epochs: int) -> list[list[int]]:
        resumed = resumable_loader(data, 4, seed=5, num_workers=workers)
        resumed.load_state_dict(state)
        batches = []
        for epoch in epochs:
            it = iter(resumed)
            resumed.sampler.set_epoch(epoch)
            batches.append([b[0].tolist() for b in it])
        return batches

    (next_epoch,) = resume(1)
    assert len(next_epoch) == 10 and sorted(sum(next_epoch, [])) == list(range(40)) and next_epoch != first
    assert resume(0, 1) == [[], next_epoch]

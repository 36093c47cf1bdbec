"""Resuming from a checkpoint taken in the middle of an epoch (resumable_loader, the saved random
generators): bitwise equal to the uninterrupted run at the same world size for stages 1, 2 and 3, and on
another world size the epoch continues with exactly the samples not yet seen."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from tests.support.helpers import relative_error
from tests.support.resume_model import ACCUMULATE, SAMPLES, STEPS_PER_EPOCH, ResumeModule, final_state, make_trainer
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_zero.resumable_data import ResumableSampler, resumable_loader
from lightning_zero.sharding import collectives

STEPS, CKPT_STEP = 10, 6  # step 6 is half-way through the second epoch (4 steps each)


def _exact_worker(rank: int, world: int, root) -> None:
    for stage in (1, 2, 3):
        pl.seed_everything(0)
        whole = ResumeModule()
        # validation runs right after the step-6 checkpoint (every 4 micro-batches = 2 steps) in this run
        # only: the resumed one starts after it
        trainer = make_trainer(stage, world, STEPS, dirpath=root / f"stage{stage}", val_check_interval=4)
        trainer.fit(whole)
        expected = final_state(trainer)

        pl.seed_everything(0)  # the resumed run starts from the seed: the checkpoint must restore the rest
        resumed = ResumeModule()
        trainer = make_trainer(stage, world, STEPS, val_check_interval=4)
        trainer.fit(resumed, ckpt_path=str(root / f"stage{stage}" / f"epoch=1-step={CKPT_STEP}.ckpt"))
        got = final_state(trainer)

        n = (STEPS - CKPT_STEP) * ACCUMULATE
        assert resumed.seen == whole.seen[-n:], f"stage {stage}: other samples after resuming"
        assert resumed.losses == whole.losses[-n:], (
            f"stage {stage}: losses after resuming differ {resumed.losses} {whole.losses[-n:]}"
        )
        for name, value in expected.items():
            assert torch.equal(value, got[name]), f"stage {stage}: {name} differs after resuming"


def test_mid_epoch_resume_is_bitwise_exact(ranks, tmp_path):
    assert CKPT_STEP % STEPS_PER_EPOCH != 0
    ranks(_exact_worker, 2, tmp_path)


def _world_worker(rank: int, world: int, root, stage: int, ckpt) -> None:
    pl.seed_everything(0)
    module = ResumeModule(dropout=0.0)  # dropout masks depend on how samples fall on ranks
    trainer = make_trainer(stage, world, STEPS, dirpath=None if ckpt else root / "ckpts")
    trainer.fit(module, ckpt_path=ckpt)
    state = final_state(trainer)
    seen = collectives.all_gather_object(module.seen)  # [rank][micro-batch] -> sample ids
    if rank == 0:
        torch.save({"state": state, "seen": seen}, root / f"world{world}.pt")


def _epoch_samples(seen: list[list[list[int]]], first: int, last: int) -> list[int]:
    """Every sample the world's micro-batches ``first`` to ``last`` (exclusive) held, over all ranks."""
    return [i for per_rank in seen for batch in per_rank[first:last] for i in batch]


def test_resume_on_fewer_ranks_continues_the_epoch(ranks, tmp_path):
    ranks(_world_worker, 4, tmp_path, 2, None)
    ckpt = str(tmp_path / "ckpts" / f"epoch=1-step={CKPT_STEP}.ckpt")
    ranks(_world_worker, 2, tmp_path, 3, ckpt)  # and another stage
    ranks(_world_worker, 3, tmp_path, 1, ckpt)
    whole = torch.load(tmp_path / "world4.pt")
    epoch_start = STEPS_PER_EPOCH * ACCUMULATE  # the interrupted epoch's first micro-batch
    done = CKPT_STEP * ACCUMULATE
    before = _epoch_samples(whole["seen"], epoch_start, done)
    for world in (2, 3):
        resumed = torch.load(tmp_path / f"world{world}.pt")
        rest = (STEPS_PER_EPOCH * 2 - CKPT_STEP) * ACCUMULATE  # micro-batches left in the epoch
        after = _epoch_samples(resumed["seen"], 0, rest)
        assert sorted(before + after) == list(range(SAMPLES)), f"{world} ranks: a sample repeated or skipped"
        for name, value in whole["state"].items():
            error = relative_error(resumed["state"][name], value)
            assert error <= 1e-5, f"4 -> {world} ranks: {name} off by {error:.2e}"


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

"""Resuming from a checkpoint taken in the middle of an epoch (resumable_loader, the saved random
generators): the uninterrupted run, with dropout and validation (which draws from the same generators),
equals ddp's; the resumed one is bitwise equal to the uninterrupted run at the same world size for stages 1,
2 and 3 (the checkpoint saved right before a validation records the generators as it left them), and so is
resuming again from the epoch-end checkpoint that the resumed run wrote (where Lightning's epoch counter
lags: see [Note: the iterator starts at the first batch]); on another world size the epoch continues with
exactly the samples not yet seen."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_zero.sharding import collectives
from tests.support.compare import final_state, relative_error
from tests.support.resume_model import ACCUMULATE, SAMPLES, STEPS_PER_EPOCH, ResumeModule, make_trainer

STEPS, CKPT_STEP = 10, 6  # step 6 is half-way through the second epoch (4 steps each)


def _exact_worker(rank: int, world: int, root) -> None:
    pl.seed_everything(0)
    ddp = ResumeModule()  # validation draws from the generators that dropout draws from: the same stream here
    make_trainer("ddp", world, STEPS, val_check_interval=4).fit(ddp)
    for stage in (1, 2, 3):
        pl.seed_everything(0)
        whole = ResumeModule()
        # validation runs right after the step-6 checkpoint (every 4 micro-batches = 2 steps) in this run
        # only: the resumed one starts after it
        trainer = make_trainer(stage, world, STEPS, dirpath=root / f"stage{stage}", val_check_interval=4)
        trainer.fit(whole)
        expected = final_state(trainer)
        assert relative_error(torch.tensor(whole.losses), torch.tensor(ddp.losses)) <= 1e-5, f"stage {stage}"
        for name, value in ddp.state_dict().items():
            err = relative_error(expected[name], value)
            assert err <= 1e-5, f"stage {stage}: {name} differs from ddp's by {err:.2e} (dropout with validation)"

        pl.seed_everything(0)  # the resumed run starts from the seed: the checkpoint must restore the rest
        resumed = ResumeModule()
        trainer = make_trainer(stage, world, STEPS, dirpath=root / f"resumed{stage}", val_check_interval=4)
        trainer.fit(resumed, ckpt_path=str(root / f"stage{stage}" / f"epoch=1-step={CKPT_STEP}.ckpt"))
        got = final_state(trainer)

        n = (STEPS - CKPT_STEP) * ACCUMULATE
        assert resumed.seen == whole.seen[-n:], f"stage {stage}: other samples after resuming"
        assert resumed.losses == whole.losses[-n:], (
            f"stage {stage}: losses after resuming differ {resumed.losses} {whole.losses[-n:]}"
        )
        for name, value in expected.items():
            assert torch.equal(value, got[name]), f"stage {stage}: {name} differs after resuming"

        pl.seed_everything(0)  # again, from the epoch-end checkpoint (step 8) the resumed run wrote
        again = ResumeModule()
        trainer = make_trainer(stage, world, STEPS, val_check_interval=4)
        trainer.fit(again, ckpt_path=str(root / f"resumed{stage}" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"))
        got = final_state(trainer)
        n = (STEPS - 2 * STEPS_PER_EPOCH) * ACCUMULATE
        assert again.seen == whole.seen[-n:], f"stage {stage}: other samples after resuming at the epoch's end"
        for name, value in expected.items():
            assert torch.equal(value, got[name]), f"stage {stage}: {name} differs after resuming at the epoch's end"


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

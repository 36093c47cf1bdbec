"""Lightning checkpoints of ZeRO runs hold the optimizer state in the unsharded layout, so they equal a
single-process run's and resume at another world size and stage (zero2 at 2 ranks -> zero1 at 4,
zero3 at 2) on the same trajectory."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import EquivalenceModule, make_trainer, relative_error, spawn_ranks, zero_strategy

HALF = 10  # optimizer steps per epoch; the checkpoint is taken after the first epoch


def _train_and_save(rank: int, world: int, ckpt) -> None:
    pl.seed_everything(0)
    trainer = make_trainer(zero_strategy(2, reduce_bucket_size=50), world, steps=HALF)
    trainer.fit(EquivalenceModule("toy", steps=HALF))
    trainer.save_checkpoint(ckpt)


def _resume(rank: int, world: int, ckpt, out, stage) -> None:
    pl.seed_everything(0)
    module = EquivalenceModule("toy", steps=HALF)
    trainer = make_trainer(zero_strategy(stage, reduce_bucket_size=30), world, steps=2 * HALF)
    trainer.fit(module, ckpt_path=ckpt)
    assert trainer.global_step == 2 * HALF
    if rank == 0:
        torch.save(module.state_dict(), out)


def _assert_close(actual, expected, what):
    err = relative_error(actual, expected)
    assert err <= 1e-5, f"{what} differs by {err:.2e} relative"


@pytest.mark.slow
def test_checkpoint_resumes_at_other_world_size_and_stage(tmp_path):
    ckpt, out = tmp_path / "zero.ckpt", tmp_path / "resumed.pt"
    spawn_ranks(_train_and_save, 2, ckpt)

    pl.seed_everything(0)
    reference = EquivalenceModule("toy", steps=HALF)
    ref_trainer = make_trainer("auto", 1, steps=HALF)
    ref_trainer.fit(reference)
    ref_trainer.save_checkpoint(tmp_path / "reference.ckpt")

    saved = torch.load(ckpt, weights_only=False)
    expected = torch.load(tmp_path / "reference.ckpt", weights_only=False)
    (opt,), (ref_opt,) = saved["optimizer_states"], expected["optimizer_states"]
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_opt["param_groups"]]
    assert [g["lr"] for g in opt["param_groups"]] == [g["lr"] for g in ref_opt["param_groups"]]
    assert opt["state"].keys() == ref_opt["state"].keys()
    for index, ref_state in ref_opt["state"].items():
        assert opt["state"][index]["step"] == ref_state["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt["state"][index][key].shape == ref_state[key].shape
            _assert_close(opt["state"][index][key], ref_state[key], f"state {index} {key}")
    for name, value in expected["state_dict"].items():
        _assert_close(saved["state_dict"][name], value, name)

    make_trainer("auto", 1, steps=2 * HALF).fit(reference, ckpt_path=tmp_path / "reference.ckpt")
    for world, stage in ((4, 1), (2, 3)):
        spawn_ranks(_resume, world, ckpt, out, stage)
        resumed = torch.load(out)
        for name, value in reference.state_dict().items():
            _assert_close(resumed[name], value, f"after resuming at world {world}, stage {stage}: {name}")

"""The optimizer state on NVMe (``offload_optimizer="nvme"``, issue 43), at 2 ranks.

- Stages 1, 2 and 3 (and stage 3 with ``offload_param="cpu"``), fp32 and bf16-mixed, with clipping by norm and
  gradient accumulation: the weights and Adam's moments after training equal those of the same run offloaded to
  host memory bitwise (AdamW is elementwise and both take the host kernel), ranks identical; the chunks are small,
  so every unit streams through several of them; nothing of the state stays in host memory between steps (the
  master is a placeholder without data, the optimizer's state holds only step counts).
- A bad ``nvme_path`` is one line, the same on every rank, before anything is built.
- A checkpoint written under NVMe offload resumes under zero2 without offload, and one written without offload
  resumes under NVMe offload, each bitwise equal to the uninterrupted run (``fused_step="always"``: the host kernel
  steps every run). The swap files are gone once the units are.
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.sharding.swapped import resident
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS = 4
CASES = [(1, "none", "32-true"), (2, "none", "32-true"), (3, "none", "32-true"), (3, "cpu", "32-true")]
CASES += [(2, "none", "bf16-mixed"), (3, "none", "bf16-mixed")]
NVME = {"nvme_buffer_numel": 1024, "nvme_buffer_count": 3}


class Moments(pl.Callback):
    """At the end of fit (before the units go): every piece's exp_avg and exp_avg_sq on this rank, by name."""

    def __init__(self) -> None:
        self.moments: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer, pl_module):
        (zero,) = trainer.strategy.optimizers
        for unit in zero.units:
            with resident(unit, zero.optimizer.state):
                for piece, tensor in zip(unit.training.pieces, unit.training.piece_tensors):
                    state = zero.optimizer.state[tensor]
                    name = unit.names[piece.param]
                    self.moments[name] = torch.cat([state["exp_avg"], state["exp_avg_sq"], state["step"].reshape(1)])
            if unit.training.swap is not None:  # between steps: nothing of the state in host memory
                assert unit.training.master.device.type == "meta"
                assert all(set(zero.optimizer.state[t]) == {"step"} for t in unit.training.piece_tensors)


def _fit(world, stage, offload_param, precision, offload, nvme_dir, *, steps=STEPS, **kwargs):
    """``steps`` optimizer steps over epochs of ``STEPS``; ``dirpath``: checkpoints at each epoch's end there."""
    pl.seed_everything(0)
    module = EquivalenceModule("gpt", steps=STEPS, lazy=stage == 3)
    config = dict(offload_optimizer=offload, offload_param=offload_param, reduce_bucket_size=3000)
    if offload == "nvme":
        config.update(nvme_path=str(nvme_dir), **NVME)
    moments, dirpath = Moments(), kwargs.pop("dirpath", None)
    callbacks = [moments] + ([ModelCheckpoint(dirpath, every_n_train_steps=STEPS, save_top_k=-1)] if dirpath else [])
    strategy = zero_strategy(stage, param_persistence_threshold=0, **config, **kwargs.pop("config", {}))
    trainer = make_trainer(
        strategy, world, steps=steps, clip=0.3, precision=precision, callbacks=callbacks,
        enable_checkpointing=bool(dirpath),
    )  # fmt: skip
    trainer.fit(module, ckpt_path=kwargs.pop("ckpt_path", None))
    state = {k: v.clone() for k, v in strategy.gather_module().state_dict().items()}
    return trainer, state, moments.moments


def _same_on_every_rank(state: dict) -> None:
    flat = torch.cat([v.float().reshape(-1) for v in state.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), "ranks differ"


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs by {(a[name] - b[name]).abs().max():.3e}"


def _worker(rank: int, world: int, tmp_path) -> None:
    nvme_dir = tmp_path / f"nvme{rank}"
    with pytest.raises(ValueError) as error:  # before anything is built, the same line on every rank
        _fit(world, 2, "none", "32-true", "nvme", nvme_dir)
    assert (
        str(error.value)
        == f"rank 0: nvme_path '{tmp_path}/nvme0' is not a directory (make it first, on the NVMe drive)"
    )
    nvme_dir.mkdir()
    for stage, offload_param, precision in CASES:
        what = f"stage {stage} offload_param={offload_param} {precision}"
        _, host_state, host_moments = _fit(world, stage, offload_param, precision, "cpu", nvme_dir)
        trainer, nvme_state, nvme_moments = _fit(world, stage, offload_param, precision, "nvme", nvme_dir)
        assert list(nvme_dir.iterdir()), "the swap files live as long as the units"
        _equal(nvme_state, host_state, what)
        _equal(nvme_moments, host_moments, what + " (moments)")
        _same_on_every_rank(nvme_state)
        del trainer
        gc.collect()
        assert not list(nvme_dir.iterdir()), "swap files left behind"


def test_nvme_optimizer_state_equals_host_offload_bitwise(ranks, tmp_path):
    ranks(_worker, 2, tmp_path)


def _resume_worker(rank: int, world: int, tmp_path) -> None:
    nvme_dir = tmp_path / f"nvme{rank}"
    nvme_dir.mkdir(exist_ok=True)
    every = {"config": {"fused_step": "always"}, "steps": 2 * STEPS}  # (the host kernel steps every unit)
    whole = {}
    for offload in ("none", "nvme"):  # checkpoints at the end of the first epoch
        _, whole[offload], _ = _fit(world, 2, "none", "32-true", offload, nvme_dir, dirpath=tmp_path / offload, **every)
        gc.collect()
    _equal(whole["nvme"], whole["none"], "uninterrupted")
    for first, then in (("nvme", "none"), ("none", "nvme")):
        ckpt = tmp_path / first / f"epoch=0-step={STEPS}.ckpt"
        _, resumed, _ = _fit(world, 2, "none", "32-true", then, nvme_dir, ckpt_path=ckpt, **every)
        _equal(resumed, whole[first], f"saved under {first}, resumed under {then}")


def test_nvme_checkpoints_resume_without_it_and_back_exactly(ranks, tmp_path):
    ranks(_resume_worker, 2, tmp_path)

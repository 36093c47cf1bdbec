"""The optimizer state on NVMe (``offload_optimizer="nvme"``, issue 43), at 2 ranks.

- Stages 1, 2 and 3 (and stage 3 with ``offload_param="cpu"``, and with ``offload_param="nvme"`` against
  ``offload_param="cpu"``), fp32 and bf16-mixed, with clipping by norm and
  gradient accumulation: the weights and Adam's moments after training equal those of the same run offloaded to
  host memory bitwise (AdamW is elementwise and both take the host kernel), ranks identical; the chunks are small,
  so every unit streams through several of them; nothing of the state stays in host memory between steps (the
  master is a placeholder without data, the optimizer's state holds only step counts); what a save writes of a unit
  is read into file mappings, equal to the state.
- A bad ``nvme_path`` is one line, the same on every rank, before anything is built; a disk error in one rank's step
  raises on every rank; AdamW state the optimizer held before set-up goes to the swap files and steps on exactly.
- A checkpoint written under NVMe offload resumes under zero2 without offload, and one written without offload
  resumes under NVMe offload, each bitwise equal to the uninterrupted run (``fused_step="always"``: the host kernel
  steps every run); one written by zero3 with its parameters on NVMe resumes under zero2 within 1e-5. The swap files
  are gone once the units are.
"""

from __future__ import annotations

import gc
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.checkpoint.snapshot import unit_payload
from lightning_zero.sharding.swapped import resident
from tests.support.compare import relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS = 4
CASES = [(1, "none", "32-true"), (2, "none", "32-true"), (3, "none", "32-true"), (3, "cpu", "32-true")]
CASES += [(2, "none", "bf16-mixed"), (3, "none", "bf16-mixed"), (3, "nvme", "32-true"), (3, "nvme", "bf16-mixed")]
NVME = {"nvme_buffer_numel": 1024, "nvme_buffer_count": 3}


class Moments(pl.Callback):
    """At the end of fit (before the units go): every piece's exp_avg and exp_avg_sq on this rank, by name."""

    def __init__(self, offload_param: str) -> None:
        self.offload_param = offload_param
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
                on_nvme = (
                    unit.param_shard is not None and unit.param_shard.is_meta
                )  # (a placeholder: stage 3's on NVMe)
                assert (unit.param_swap is not None) == on_nvme == (self.offload_param == "nvme")
                self._check_payload(unit, zero)

    def _check_payload(self, unit, zero) -> None:
        """What a save writes of a unit on NVMe: its master and moments in file mappings, equal to the resident ones."""
        payload = unit_payload(unit, zero, False, None, keep=None, empty=None)
        with resident(unit, zero.optimizer.state):
            assert torch.equal(payload["master"], unit.training.master) and payload["master"].is_shared()
            for piece, tensor in zip(unit.training.pieces, unit.training.piece_tensors):
                lo, hi = piece.partition_offset, piece.partition_offset + piece.numel
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(payload["state"][key][lo:hi], zero.optimizer.state[tensor][key])
                    assert payload["state"][key].is_shared()
                assert torch.equal(payload["scalars"][piece.param]["step"], zero.optimizer.state[tensor]["step"])


def _fit(world, stage, offload_param, precision, offload, nvme_dir, *, steps=STEPS, **kwargs):
    """``steps`` optimizer steps over epochs of ``STEPS``; ``dirpath``: checkpoints at each epoch's end there."""
    pl.seed_everything(0)
    module = EquivalenceModule("gpt", steps=STEPS, lazy=stage == 3)
    config = dict(offload_optimizer=offload, offload_param=offload_param, reduce_bucket_size=3000)
    if offload == "nvme":
        config.update(nvme_path=str(nvme_dir), **NVME)
    moments, dirpath = Moments(offload_param), kwargs.pop("dirpath", None)
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
        on_host = "cpu" if offload_param == "nvme" else offload_param  # (parameters on NVMe: against them on the host)
        _, host_state, host_moments = _fit(world, stage, on_host, precision, "cpu", nvme_dir)
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
    runs = {"zero2": (2, "none", "none"), "zero2 nvme": (2, "none", "nvme"), "zero3 nvme_param": (3, "nvme", "nvme")}
    whole = {}
    for name, (stage, offload_param, offload) in runs.items():  # checkpoints at the end of the first epoch
        dirpath = tmp_path / name.replace(" ", "-")
        _, whole[name], _ = _fit(world, stage, offload_param, "32-true", offload, nvme_dir, dirpath=dirpath, **every)
        gc.collect()
    _equal(whole["zero2 nvme"], whole["zero2"], "uninterrupted")
    for first, then in (("zero2 nvme", "zero2"), ("zero2", "zero2 nvme"), ("zero3 nvme_param", "zero2")):
        ckpt = tmp_path / first.replace(" ", "-") / f"epoch=0-step={STEPS}.ckpt"
        stage, offload_param, offload = runs[then]
        _, resumed, _ = _fit(world, stage, offload_param, "32-true", offload, nvme_dir, ckpt_path=ckpt, **every)
        if runs[first][0] == stage:  # the same arithmetic after the load: the same bits
            _equal(resumed, whole[first], f"saved under {first}, resumed under {then}")
        else:  # stage 3 reduces in other groupings than stage 2: the sums' rounding differs
            for key, value in whole[first].items():
                assert relative_error(resumed[key], value) <= 1e-5, f"saved under {first}, resumed under {then}: {key}"


def test_nvme_checkpoints_resume_without_it_and_back_exactly(ranks, tmp_path):
    ranks(_resume_worker, 2, tmp_path)


class HeldState(EquivalenceModule):
    """An optimizer that holds AdamW state when the strategy gets it (torch's ``load_state_dict`` before ``fit``)."""

    def configure_optimizers(self):
        config = super().configure_optimizers()
        optimizer = config["optimizer"] if isinstance(config, dict) else config[0][0]
        g = torch.Generator().manual_seed(1)
        for group in optimizer.param_groups:
            for p in group["params"]:
                moments = {k: torch.rand(p.shape, generator=g) for k in ("exp_avg", "exp_avg_sq")}
                optimizer.state[p] = {"step": torch.tensor(3.0), **moments}
        return config


class BreakSwapFile(pl.Callback):
    """On rank 1, before the second step: its first unit's swap file becomes a read-only /dev/null (a disk error)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == 1 and trainer.global_step == 1:
            (zero,) = trainer.strategy.optimizers
            broken = os.open(os.devnull, os.O_RDONLY)
            os.dup2(broken, zero.units[0].training.swap.file.fd)
            os.close(broken)


def _failure_worker(rank: int, world: int, tmp_path) -> None:
    nvme_dir = tmp_path / f"nvme{rank}"
    nvme_dir.mkdir(exist_ok=True)
    states = {}
    for offload in ("cpu", "nvme"):  # the held state steps on in the swap files as in host memory
        pl.seed_everything(0)
        strategy = zero_strategy(
            2, offload_optimizer=offload, **({"nvme_path": str(nvme_dir), **NVME} if offload == "nvme" else {})
        )
        make_trainer(strategy, world, steps=2).fit(HeldState("gpt", steps=2))
        states[offload] = {k: v.clone() for k, v in strategy.gather_module().state_dict().items()}
    _equal(states["nvme"], states["cpu"], "state held before set-up")
    pl.seed_everything(0)
    strategy = zero_strategy(2, offload_optimizer="nvme", nvme_path=str(nvme_dir), **NVME)
    with pytest.raises(OSError) as error:  # on every rank, the same line: none goes on to wait for the other
        make_trainer(strategy, world, steps=3, callbacks=[BreakSwapFile()]).fit(EquivalenceModule("gpt", steps=3))
    message = "rank 1: the optimizer step on NVMe failed: [Errno 5] the swap file ended at byte"  # (/dev/null reads 0)
    assert str(error.value).startswith(message), str(error.value)


def test_held_state_and_a_disk_error_in_the_step(ranks, tmp_path):
    ranks(_failure_worker, 2, tmp_path)

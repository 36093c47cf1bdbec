"""ZeRO-Offload: the master weights, optimizer state and reduced gradients in host memory.

- Training with ``offload_optimizer="cpu"`` (stages 1, 2, 3; stage 3 also with ``offload_param``) at 2
  and 4 ranks equals a single-process run (AdamW with two param groups, an LR schedule, clipping by
  norm and by value, gradient accumulation), ranks identical.
- What lives where: on this CPU machine the "device" is the CPU too, so the test checks that every
  offloaded buffer is an allocation of its own, that the optimizer steps views of the host master and
  keeps its state beside them, that the host AdamW kernel stepped every unit (torch's fused CPU AdamW
  with ``fused_step="never"``), and that ``memory_bytes`` counts them as host bytes and nothing of them
  on the device.
- Checkpoints: saved with offload, resumed exactly with offload; resumed without offload on 4 ranks,
  and a checkpoint saved without offload resumed with it on 4 ranks, within 1e-5 of an uninterrupted
  run. (fp16 overflow with offload: tests/test_fp16.py.)
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.kernels import host
from tests.support.compare import relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS = 8
CLIP = {"norm": 0.3, "value": 0.02}
RUNS = [
    (1, "none", "norm", "auto"),
    (2, "none", "norm", "auto"),
    (3, "none", "norm", "auto"),
    (3, "cpu", "norm", "auto"),
    (2, "none", "value", "auto"),
    (2, "none", "norm", "never"),  # torch's fused CPU AdamW steps instead of the host kernel
]
RUNS_AT_4 = RUNS[:3]  # (stage, offload_param, clipping algorithm, fused_step)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class CheckPlacement(pl.Callback):
    """At the end of fit: where the master, gradients and optimizer state live, and how they are counted."""

    def __init__(self, stage: int, offload_param: str, fused_step: str) -> None:
        self.stage, self.offload_param, self.fused_step = stage, offload_param, fused_step
        self.checked = False

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        (zero,) = strategy.optimizers
        device_buffers = {_storage(u.flat_param) for u in strategy.engine.units} - {0}  # stage 3: freed units have none
        device_buffers |= {_storage(u.training.flat_grad) for u in zero.units if u.training.flat_grad is not None}
        device_buffers |= {
            _storage(u.param_shard) for u in zero.units if self.offload_param == "none" and self.stage == 3
        }
        partition = sum(u.layout.partition_numel for u in zero.units)
        for unit in zero.units:
            assert unit.offload is not None and unit.training.master.device.type == "cpu"
            assert _storage(unit.training.master) not in device_buffers
            assert all(
                _storage(t) == _storage(unit.training.master) for t in unit.training.piece_tensors
            )  # the optimizer steps it
            assert unit.training.grad_partition.dtype == torch.float32  # stage 1 too: the step's partition, kept
            assert _storage(unit.training.grad_partition) not in device_buffers
        assert all(group["fused"] is True for group in zero.optimizer.param_groups)  # for what the kernel leaves
        stepped = set(zero.fused._moments) if zero.fused is not None else set()  # units the host kernel stepped
        kernel = host.available() and self.fused_step == "auto"
        assert stepped == ({id(u) for u in zero.units} if kernel else set()), (len(stepped), len(zero.units))
        state = [v for s in zero.state.values() for v in s.values() if torch.is_tensor(v)]
        assert state and all(v.device.type == "cpu" and _storage(v) not in device_buffers for v in state)
        mem = strategy.memory_bytes()
        assert mem["master"] == mem["optimizer_state"] == 0, mem
        assert mem["host_optimizer_state"] == zero.state_nbytes() > 0, mem
        shard_is_master = self.offload_param == "cpu"  # fp32 shards on the host are the master itself
        assert mem["host_master"] == (0 if shard_is_master else 4 * partition), mem
        assert mem["host_parameters"] == (4 * partition if shard_is_master else 0), mem
        padded = sum(u.layout.total_numel for u in zero.units)
        assert mem["gradients"] == (4 * padded if self.stage == 1 else 0), mem
        assert mem["host_gradients"] == 4 * partition, mem
        self.checked = True


def _offload(stage: int, offload_param: str = "none", **config) -> ZeroStrategy:
    config.setdefault("param_persistence_threshold", 0)
    return zero_strategy(stage, offload_optimizer="cpu", offload_param=offload_param, **config)


def _worker(rank: int, world: int, out_dir) -> None:
    for stage, offload_param, algorithm, fused_step in RUNS if world == 2 else RUNS_AT_4:
        pl.seed_everything(0)
        module = EquivalenceModule("gpt", steps=STEPS, lazy=stage == 3)
        placement = CheckPlacement(stage, offload_param, fused_step)
        strategy = _offload(stage, offload_param, reduce_bucket_size=3000, fused_step=fused_step)
        trainer = make_trainer(
            strategy, world, steps=STEPS, clip=CLIP[algorithm], gradient_clip_algorithm=algorithm, callbacks=[placement]
        )
        trainer.fit(module)
        assert placement.checked
        state = strategy.gather_module().state_dict()
        flat = torch.cat([v.reshape(-1) for v in state.values()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, flat) for g in gathered), "ranks differ"
        if rank == 0:
            torch.save(
                {"state": state, "norms": module.grad_norms},
                out_dir / f"{stage}-{offload_param}-{algorithm}-{fused_step}.pt",
            )


@functools.cache
def _reference(algorithm: str):
    pl.seed_everything(0)
    module = EquivalenceModule("gpt", steps=STEPS)
    make_trainer("auto", 1, steps=STEPS, clip=CLIP[algorithm], gradient_clip_algorithm=algorithm).fit(module)
    clipped = max(module.grad_norms) > CLIP["norm"] if algorithm == "norm" else max(module.grad_max) > CLIP["value"]
    assert clipped  # clipping is active
    return {k: v.clone() for k, v in module.state_dict().items()}, module.grad_norms


@pytest.mark.parametrize("world", [2, 4])
def test_offloaded_training_matches_single_process(ranks, world, tmp_path):
    ranks(_worker, world, tmp_path)
    for stage, offload_param, algorithm, fused_step in RUNS if world == 2 else RUNS_AT_4:
        ref_state, ref_norms = _reference(algorithm)
        result = torch.load(tmp_path / f"{stage}-{offload_param}-{algorithm}-{fused_step}.pt")
        for name, ref in ref_state.items():
            err = relative_error(result["state"][name], ref)
            what = f"stage {stage} offload_param={offload_param} {algorithm} fused_step={fused_step}"
            assert err <= 1e-5, f"{what}: {name} differs by {err:.2e}"
        assert relative_error(torch.tensor(result["norms"]), torch.tensor(ref_norms)) <= 1e-5


HALF = 4  # optimizer steps per epoch: checkpoints are taken at the epoch boundary


def _fit(world: int, strategy, *, dirpath=None, ckpt=None) -> dict:
    pl.seed_everything(0)
    module = EquivalenceModule("blocks", steps=HALF)
    callbacks = [ModelCheckpoint(dirpath, every_n_train_steps=HALF, save_top_k=-1)] if dirpath else []
    trainer = make_trainer(strategy, world, steps=2 * HALF, callbacks=callbacks, enable_checkpointing=bool(dirpath))
    trainer.fit(module, ckpt_path=ckpt)
    return {k: v.clone() for k, v in trainer.strategy.gather_module().state_dict().items()}


def _ckpt(dirpath) -> str:
    return str(dirpath / f"epoch=0-step={HALF}.ckpt")


def _save_worker(rank: int, world: int, root) -> None:
    for stage in (2, 3):  # saved with offload; resumed with it: exactly the uninterrupted run
        whole = _fit(world, _offload(stage, reduce_bucket_size=40), dirpath=root / f"offload-z{stage}")
        resumed = _fit(world, _offload(stage, reduce_bucket_size=40), ckpt=_ckpt(root / f"offload-z{stage}"))
        for name, value in whole.items():
            assert torch.equal(value, resumed[name]), f"stage {stage}: {name} differs after resuming"
    _fit(world, zero_strategy(3, param_persistence_threshold=0), dirpath=root / "plain-z3")


def _resume_worker(rank: int, world: int, root) -> None:
    results = {
        "offload-z2 -> zero1 without offload": _fit(world, zero_strategy(1), ckpt=_ckpt(root / "offload-z2")),
        "plain-z3 -> zero3 offload_param": _fit(world, _offload(3, "cpu"), ckpt=_ckpt(root / "plain-z3")),
    }
    if rank == 0:
        torch.save(results, root / "resumed.pt")


def test_checkpoints_move_between_offload_and_device_and_world_sizes(ranks, tmp_path):
    ranks(_save_worker, 2, tmp_path)
    ranks(_resume_worker, 4, tmp_path)
    pl.seed_everything(0)
    reference = EquivalenceModule("blocks", steps=HALF)
    make_trainer("auto", 1, steps=2 * HALF).fit(reference)
    for what, state in torch.load(tmp_path / "resumed.pt").items():
        for name, value in reference.state_dict().items():
            err = relative_error(state[name], value)
            assert err <= 1e-5, f"{what}: {name} differs from the uninterrupted run by {err:.2e}"


class StagedCopies(pl.Callback):
    """At the end: every unit's 16-bit parameters (stages 1 and 2: this rank's chunks of the flat buffer;
    stage 3: the shard) are exactly the host master cast, so the copy the host step wrote reached them."""

    checked = False

    def on_train_end(self, trainer, pl_module):
        for unit in trainer.strategy.optimizers[0].units:
            if unit.param_shard is not None:
                assert torch.equal(unit.param_shard, unit.training.master.to(unit.param_dtype))
                continue
            for bucket in unit.layout.buckets:
                assert torch.equal(unit.param_chunk(bucket), unit.training.master_chunk(bucket).to(unit.param_dtype))
        self.checked = True


def _fp16_worker(rank: int, world: int, out_dir) -> None:
    from lightning_zero import ZeroPrecision
    from lightning_zero.sharding.unit_training import UnitTraining

    staged = []
    stage_params = UnitTraining.stage_params
    UnitTraining.stage_params = lambda training, written: (staged.append(training), stage_params(training, written))[1]
    for stage, offload_param in ((1, "none"), (2, "none"), (3, "none"), (3, "cpu")):
        results = {}
        for offload in ("cpu", "none"):
            pl.seed_everything(0)
            module = EquivalenceModule("gpt", steps=STEPS, lazy=stage == 3)
            check = StagedCopies()
            strategy = zero_strategy(stage, reduce_bucket_size=3000, fused_step="never")
            if offload == "cpu":
                strategy = _offload(stage, offload_param, reduce_bucket_size=3000)
            trainer = make_trainer(strategy, world, steps=STEPS, callbacks=[check], plugins=[ZeroPrecision("16-mixed")])
            staged.clear()
            trainer.fit(module)
            assert check.checked
            units = len(trainer.strategy.optimizers[0].units)
            expected = STEPS * units if offload == "cpu" and offload_param == "none" else 0  # else: into host shards
            assert len(staged) == expected, (stage, offload, offload_param, len(staged), units)
            results[offload] = {k: v.float() for k, v in trainer.strategy.gather_module().state_dict().items()}
        for name, value in results["none"].items():
            err = relative_error(results["cpu"][name], value)
            assert err <= 2e-3, f"stage {stage} {offload_param}: {name} differs by {err:.2e}"  # fp16 rounding


@pytest.mark.skipif(not host.available(), reason="no C compiler to build the host kernel")
def test_offloaded_16_bit_parameters_come_back_from_the_host_step(ranks, tmp_path):
    """16-mixed with offload: the host kernel writes the fp16 copy in the step's pass, into a staging buffer
    (the CUDA path's steps, taken on the CPU) that becomes the parameters, or with ``offload_param`` into
    the host shards; training equals the run without offload (and without the host kernel) within fp16
    rounding."""
    ranks(_fp16_worker, 2, tmp_path)

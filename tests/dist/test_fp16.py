"""fp16 with dynamic loss scaling under ZeRO: overflow on one rank skips the step everywhere and
changes nothing (also with the optimizer offloaded), unscale + clip equals fp32 clipping of the
unscaled gradients, and the scaler and the fp32 master weights come back from a checkpoint."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero import LossScaleConfig, ZeroConfig, ZeroPrecision
from lightning_zero.sharding import collectives
from lightning_zero.sharding.backward_end import BackwardEnd
from lightning_zero.sharding.build import check_optimizer_params, make_reducer, units_per_param_group, wrap_optimizers
from lightning_zero.sharding.step_state import StepState
from lightning_zero.sharding.topology import make_topology
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer
from tests.support.compare import full_state
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

INJECT_AT, STEPS = 3, 6


class InjectOnRankOne(EquivalenceModule):
    """ToyNet whose rank 1 produces ``value`` in every gradient of optimizer step ``INJECT_AT`` or, with
    ``one_element``, in one element of one gradient only: after the reduce-scatter only the rank owning
    that element sees it, so the skip is global only through the overflow flag's all-reduce."""

    def __init__(self, value: float, one_element: bool = False) -> None:
        super().__init__("toy", steps=STEPS)
        self.value, self.one_element = value, one_element
        self._hook = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x, use_branch=True)
        if self.trainer.global_rank == 1 and self.global_step == INJECT_AT:
            if self.one_element:
                bias = self.net.out.bias
                self._hook = bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), self.value))
            else:
                logits.register_hook(lambda g: torch.full_like(g, self.value))
        return F.cross_entropy(logits.float(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _snapshot(trainer, module) -> dict[str, torch.Tensor]:
    (zero,) = trainer.strategy.optimizers
    state = [v.clone() for s in zero.state.values() for v in s.values()]
    return {
        "params": torch.cat([v.reshape(-1).float() for v in full_state(trainer.strategy).values()]),
        "master": torch.cat([u.training.master for u in zero.units]).clone(),
        "state": torch.cat([t.reshape(-1).float() for t in state]),
        "scheduler": torch.tensor(trainer.lr_scheduler_configs[0].scheduler.last_epoch),
    }


class WatchTheSkip(pl.Callback):
    def __init__(self, expected_scale: float, expected_hysteresis: int) -> None:
        self.expected = (expected_scale, expected_hysteresis)
        self.checked = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == INJECT_AT and batch_idx % trainer.accumulate_grad_batches == 0:
            self.before = _snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != INJECT_AT + 1 or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        after = _snapshot(trainer, pl_module)
        for key, value in self.before.items():
            assert torch.equal(after[key], value), f"{key} changed across the skipped step"
        scaler = trainer.strategy.precision_plugin.scaler
        assert scaler.skipped_steps == 1
        assert (scaler.scale, scaler.hysteresis) == self.expected
        assert trainer.callback_metrics["skipped_steps"] == 1
        assert trainer.callback_metrics["loss_scale"] == self.expected[0]
        gathered = [torch.empty_like(after["params"]) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, after["params"])
        assert all(torch.equal(g, after["params"]) for g in gathered)
        self.checked = True

    def on_train_end(self, trainer, pl_module):
        assert self.checked
        assert not torch.equal(_snapshot(trainer, pl_module)["params"], self.before["params"]), "training went on"


def _overflow_worker(rank: int, world: int) -> None:
    # inf with hysteresis 1: the scale halves at once; nan with the default hysteresis 2: it holds.
    # With the optimizer offloaded the overflow is found in the host partitions.
    # One element on one rank: the ranks must still agree (checked where the flag is returned, before the
    # collectives that depend on it would issue different sequences and fail as a mismatch).
    cases = [
        (float("inf"), LossScaleConfig(hysteresis=1), (2.0**15, 1), "none", False),
        (float("nan"), LossScaleConfig(), (2.0**16, 1), "none", False),
        (float("inf"), LossScaleConfig(hysteresis=1), (2.0**15, 1), "cpu", False),
        (float("inf"), LossScaleConfig(hysteresis=1), (2.0**15, 1), "none", True),
    ]
    prepare = ZeroOptimizer.prepare_grads

    def agreed(self, **kwargs):
        found = prepare(self, **kwargs)
        flags = collectives.all_gather_object(bool(found))
        assert len(set(flags)) == 1, f"the ranks disagree on skipping the fp16 step: found_inf by rank {flags}"
        return found

    for stage, (value, config, expected, offload, one_element) in itertools.product((1, 2, 3), cases):
        pl.seed_everything(0)
        trainer = make_trainer(
            zero_strategy(stage, reduce_bucket_size=50, offload_optimizer=offload),
            world,
            steps=STEPS,
            plugins=[ZeroPrecision("16-mixed", loss_scale=config)],
            callbacks=[WatchTheSkip(*expected)],
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ZeroOptimizer, "prepare_grads", agreed)
            trainer.fit(InjectOnRankOne(value, one_element))
        assert trainer.global_step == STEPS


def test_overflow_on_one_rank_skips_everywhere(ranks):
    ranks(_overflow_worker, 2)


def _clip_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    module = EquivalenceModule("toy").to(torch.float16)
    for p in module.parameters():
        dist.broadcast(p.data, 0)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    config = ZeroConfig(stage=2, reduce_bucket_size=40)
    topology = make_topology(None, rank=rank, world_size=world, local_world_size=world)
    names = check_optimizer_params(module, [optimizer], rank=rank)
    units = units_per_param_group([optimizer], names, config, rank=rank, world_size=world)
    reducer = make_reducer(
        units, list(names), config, step=StepState(), backward_end=BackwardEnd(), model=module, topology=topology
    )
    (zero,) = wrap_optimizers([optimizer], units, names, reducer, config=config, topology=topology)
    scale, max_norm = 2.0**10, 0.05
    x, y = module.data[rank * 8 : rank * 8 + 8]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(module.net(x, use_branch=True).float(), y)
    (loss * scale).backward()  # outside the Trainer: the end of backward reduces the last buckets itself
    assert not zero.prepare_grads(check_finite=True, loss_scale=scale)
    scaled = torch.cat([u.training.step_grad for u in zero.units]).clone()
    # Reference: the same reduced gradients, unscaled in fp32, clipped by torch over all ranks' pieces.
    holder = torch.zeros(scaled.numel() * world)
    holder.grad = torch.cat(collectives.all_gather_object(scaled)) / scale
    ref_norm = torch.nn.utils.clip_grad_norm_([holder], max_norm)
    reference = holder.grad
    assert ref_norm > max_norm, f"the test must clip, norm {ref_norm}"
    norm = zero.clip_grad_norm_(max_norm)
    zero.unscale_()
    mine = torch.cat([u.training.step_grad for u in zero.units])
    n = mine.numel()
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(mine, reference[rank * n : (rank + 1) * n], rtol=1e-6, atol=1e-12)
    reducer.remove_hooks()


def test_unscale_and_clip_equal_fp32_clipping_of_unscaled_gradients(ranks):
    ranks(_clip_worker, 2)


class CheckRestored(pl.Callback):
    def __init__(self, saved) -> None:
        self.saved = saved

    def on_train_start(self, trainer, pl_module):
        (zero,) = trainer.strategy.optimizers
        assert trainer.strategy.precision_plugin.scaler.state_dict() == self.saved["scaler"]
        assert torch.equal(torch.cat([u.training.master for u in zero.units]), self.saved["master"])


def _checkpoint_worker(rank: int, world: int, ckpt) -> None:
    config = LossScaleConfig(scale_window=2)
    pl.seed_everything(0)
    trainer = make_trainer(zero_strategy(2), world, steps=STEPS, plugins=[ZeroPrecision("16-mixed", loss_scale=config)])
    trainer.fit(EquivalenceModule("toy", steps=STEPS))
    trainer.save_checkpoint(ckpt)
    (zero,) = trainer.strategy.optimizers
    saved = {
        "scaler": trainer.strategy.precision_plugin.scaler.state_dict(),
        "master": torch.cat([u.training.master for u in zero.units]).clone(),
    }
    assert saved["scaler"]["scale"] != 2.0**16, "the scaler state must have moved for the test to mean anything"
    # The master weights carry more than the fp16 model weights: restoring them must be exact.
    assert not torch.equal(saved["master"], saved["master"].half().float())
    pl.seed_everything(1)
    resumed = make_trainer(
        zero_strategy(2),
        world,
        steps=STEPS + 1,
        plugins=[ZeroPrecision("16-mixed", loss_scale=config)],
        callbacks=[CheckRestored(saved)],
    )
    resumed.fit(EquivalenceModule("toy", steps=STEPS), ckpt_path=ckpt)


def test_scaler_and_master_weights_survive_a_checkpoint(ranks, tmp_path):
    ranks(_checkpoint_worker, 2, tmp_path / "fp16.ckpt")

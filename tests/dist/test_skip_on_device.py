"""fp16 steps skipped on the device (``LossScaleConfig(skip_on_device=True)``; loss_scaler.py's [Note: skipping
on the device]), at 2 ranks with an inf injected on rank 1 at one step:

- the loss scaler's transition from a device flag equals the one from the host's bool, table for table; the
  host's view of it comes exactly HOST_LAG updates late, so the error at the minimum scale comes at the same
  update on every rank; a checkpoint's state loaded over copies still in flight is what the host then sees;
- on the CUDA kernels (emulated), stages 2 and 3: the step after the first reads nothing on the host (every
  read of a tensor's value raises inside it), the skipped step leaves parameters, masters, moments and step
  counts as they were, the scaler backs off (logged HOST_LAG steps later), the step-wise LR scheduler
  advances on every step, and the run ends where the host-skipping run ends;
- through the kernels' reference: the same at stage 1; ToyNet with its branch unused on steps 2 and 5, so
  units fused for two steps (one device count shared by their pieces) then take the optimizer's own step
  (each piece its own count again, which then reads the flag), equals the host-skipping run; a checkpoint
  taken after the skip resumes exactly;
- without the fused step it is refused at setup, in one line.
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import LossScaleConfig, ZeroPrecision
from lightning_zero.front.loss_scaler import HOST_LAG
from lightning_zero.kernels import host
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer
from tests.support.compare import full_state
from tests.support.helpers import HOST_READS, EquivalenceModule, make_trainer, zero_strategy

INJECT_AT, STEPS = 3, 6  # StepLR's step_size is 7: both runs use the same learning rates, skip or not


class InjectOnRankOne(EquivalenceModule):
    """``kind``'s module whose rank 1 makes every gradient inf at optimizer step INJECT_AT; ToyNet's branch goes
    unused on steps 2 and 5."""

    def training_step(self, batch, batch_idx):
        if self.kind == "toy":
            x, y = batch
            loss = F.cross_entropy(self.net(x, use_branch=self.global_step % 3 != 2), y)
        else:
            loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == 1 and self.global_step == INJECT_AT:
            loss.register_hook(lambda g: torch.full_like(g, float("inf")))
        return loss


def _training_state(zero: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """This rank's masters and every piece's optimizer state (moments and step count), by piece and key."""
    state = {f"{i}/{k}": v.clone() for i, s in enumerate(zero.state.values()) for k, v in s.items()}
    return {"master": torch.cat([u.training.master for u in zero.units]).clone(), **state}


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    params = full_state(trainer.strategy).values()
    return {
        "params": torch.cat([v.reshape(-1).float() for v in params]),
        **_training_state(trainer.strategy.optimizers[0]),
    }


class WatchTheSkip(pl.Callback):
    """The skipped step changes nothing but the scaler; the hooks run on every step, skipped or not."""

    def __init__(self) -> None:
        self.checked, self.steps = False, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == INJECT_AT and batch_idx % trainer.accumulate_grad_batches == 0:
            self.before = _snapshot(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != INJECT_AT + 1 or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        after = _snapshot(trainer)
        for key, value in self.before.items():
            assert torch.equal(after[key], value), f"{key} changed across the skipped step"
        scaler = trainer.strategy.precision_plugin.scaler
        assert (scaler.skipped_steps, scaler.scale) == (1, 2.0**15)
        assert trainer.callback_metrics["skipped_steps"] == 0, "the host learns of the skip HOST_LAG steps late"
        self.checked = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1
        if self.steps == INJECT_AT + 1 + HOST_LAG:  # what the last step's _log saw: update INJECT_AT - 1
            assert trainer.callback_metrics["skipped_steps"] == 0

    def on_train_end(self, trainer, pl_module):
        assert STEPS - 1 - HOST_LAG == INJECT_AT  # the last step's _log saw the skipped step's update
        assert (trainer.callback_metrics["skipped_steps"], trainer.callback_metrics["loss_scale"]) == (1, 2.0**15)
        assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS, "the scheduler held on the skip"


@contextlib.contextmanager
def _no_host_reads():
    """Every read of a tensor's value on the host raises (on a GPU each would wait for it)."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"the step read a tensor on the host: Tensor.{name}")

        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _guard_steps(monkeypatch) -> None:
    """ZeroOptimizer.prepare_grads and .step read nothing from the second step on (the first moves the host
    step counts to the device)."""
    calls = {"step": 0}
    step, prepare = ZeroOptimizer.step, ZeroOptimizer.prepare_grads

    def guarded(method, counts):
        def run(self, *args, **kwargs):
            if counts:
                calls["step"] += 1
            with _no_host_reads() if calls["step"] > 1 else contextlib.nullcontext():
                return method(self, *args, **kwargs)

        return run

    monkeypatch.setattr(ZeroOptimizer, "prepare_grads", guarded(prepare, False))
    monkeypatch.setattr(ZeroOptimizer, "step", guarded(step, True))


def _fit(world, stage, kind, on_device, *, callbacks=(), ckpt=None, epoch=STEPS, **kwargs):
    pl.seed_everything(0)
    config = LossScaleConfig(hysteresis=1, skip_on_device=on_device)
    trainer = make_trainer(
        zero_strategy(stage, fused_step="always", reduce_bucket_size=1500, param_persistence_threshold=0),
        world,
        steps=STEPS,
        plugins=[ZeroPrecision("16-mixed", loss_scale=config)],
        callbacks=list(callbacks),
        **kwargs,
    )
    trainer.fit(InjectOnRankOne(kind, steps=epoch), ckpt_path=ckpt)
    assert trainer.global_step == STEPS
    return _training_state(trainer.strategy.optimizers[0])


def _assert_equal(run, other, what) -> None:
    assert run.keys() == other.keys(), what
    for key, value in other.items():
        assert torch.equal(run[key].cpu(), value.cpu()), f"{what}: {key} differs"


def _emulated_worker(rank: int, world: int) -> None:
    from tests.support import cuda_emulator

    with pytest.MonkeyPatch.context() as monkeypatch:
        cuda_emulator.emulate(monkeypatch)
        for stage in (2, 3):
            watch = WatchTheSkip()
            with monkeypatch.context() as guarded:
                _guard_steps(guarded)
                on_device = _fit(world, stage, "gpt", True, callbacks=[watch])
            assert watch.checked and watch.steps == STEPS
            _assert_equal(on_device, _fit(world, stage, "gpt", False), f"stage {stage}")


def test_emulated_kernels_skip_without_host_reads(ranks):
    from tests.support import cuda_emulator

    reason = cuda_emulator.available()
    if reason:
        pytest.skip(reason)
    ranks(_emulated_worker, 2)


def _reference_worker(rank: int, world: int, root, host_kernel: str) -> None:
    watch = WatchTheSkip()
    _assert_equal(_fit(world, 1, "gpt", True, callbacks=[watch]), _fit(world, 1, "gpt", False), "stage 1")
    assert watch.checked
    if host_kernel == "1":
        return
    _assert_equal(_fit(world, 2, "toy", True), _fit(world, 2, "toy", False), "ToyNet")
    # a checkpoint after the skipped step (epochs of INJECT_AT + 1 steps) resumes exactly
    saving = ModelCheckpoint(root, every_n_train_steps=INJECT_AT + 1, save_top_k=-1)
    epoch = INJECT_AT + 1
    whole = _fit(world, 2, "gpt", True, callbacks=[saving], epoch=epoch, enable_checkpointing=True)
    ckpt = str(root / f"epoch=0-step={epoch}.ckpt")
    _assert_equal(_fit(world, 2, "gpt", True, ckpt=ckpt, epoch=epoch), whole, "resumed")


@pytest.mark.parametrize("host_kernel", ["0", "1"], ids=["reference", "host-kernel"])
def test_cpu_masters_skip_like_the_host(ranks, tmp_path, monkeypatch, host_kernel):
    """CPU masters take the CUDA kernels' pure-torch reference (the device path's code), or the host kernel (an
    offloaded unit's path: it reads the flag, on the host where it already is)."""
    if host_kernel == "1" and not host.available():
        pytest.skip("no C compiler to build the host kernel")
    monkeypatch.setenv("LIGHTNING_ZERO_HOST_KERNELS", host_kernel)  # read by the spawned ranks
    ranks(_reference_worker, 2, tmp_path, host_kernel)

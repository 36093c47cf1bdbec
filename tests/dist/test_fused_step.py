"""The fused AdamW step inside ZeRO (sharding/fused_step.py), checked on the CPU with ``fused_step="always"``
through the host kernel and through the CUDA kernels' reference (on CUDA "auto" runs the same code with
the kernels):

- stages 1, 2 and 3 at 2 ranks, fp32 and fp16 (loss scaling, clipping by norm with the clip factor as a
  device scalar, two param groups, an LR schedule, accumulation) equal the optimizer's own step, and fp32
  equals a single process; on ToyNet (a parameter without a gradient on some steps, so its step count
  differs from its unit's others; a frozen layer) units fall back to the optimizer's step, equally exact;
- the fused path really ran: every unit of the GPT has its flat moments, the pieces' state views them,
  and with 16-bit parameters the step wrote them (the post-step copy skipped);
- a checkpoint written with the fused step resumes exactly with it, and within rounding without it.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroPrecision
from lightning_zero.kernels import host
from tests.support.compare import relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS, HALF = 6, 3


class FusedRan(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        (zero,) = trainer.strategy.optimizers
        self.units = len(zero.units)
        self.fused_units = len(zero.fused._moments) if zero.fused is not None else 0
        self.views = zero.fused is None or all(
            zero.state[t]["exp_avg"].untyped_storage().data_ptr()
            == zero.fused._moments[id(u)][0].untyped_storage().data_ptr()
            for u in zero.units
            if id(u) in zero.fused._moments
            for t in u.training.piece_tensors
        )


def _fit(world, stage, fused, kind="gpt", precision="32-true", *, epoch=STEPS, callbacks=(), ckpt=None, **kwargs):
    """``epoch``: optimizer steps per epoch (the run takes STEPS); checkpoints are taken at epoch ends."""
    pl.seed_everything(0)
    module = EquivalenceModule(kind, steps=epoch, lazy=stage == 3 and kind == "gpt")
    probe = FusedRan()
    strategy = zero_strategy(stage, fused_step=fused, reduce_bucket_size=1500, param_persistence_threshold=0)
    plugins = [ZeroPrecision(precision)]
    trainer = make_trainer(strategy, world, steps=STEPS, callbacks=[probe, *callbacks], plugins=plugins, **kwargs)
    trainer.fit(module, ckpt_path=ckpt)
    state = {k: v.float().clone() for k, v in trainer.strategy.gather_module().state_dict().items()}
    return state, probe


def _worker(rank: int, world: int, out_dir) -> None:
    results = {}
    for stage in (1, 2, 3):
        for kind, precision in (("gpt", "32-true"), ("gpt", "16-mixed"), ("toy", "32-true")):
            fused, probe = _fit(world, stage, "always", kind, precision)
            plain, _ = _fit(world, stage, "never", kind, precision)
            assert probe.views, (stage, kind)
            if kind == "gpt":
                assert probe.fused_units == probe.units > 0, (stage, precision, probe.fused_units, probe.units)
            tol = 1e-6 if precision == "32-true" else 2e-3  # fp16: the parameters' rounding of equal masters
            for name, value in plain.items():
                err = relative_error(fused[name], value)
                assert err <= tol, f"stage {stage} {kind} {precision}: {name} differs by {err:.2e}"
            results[(stage, kind, precision)] = fused
    # clipping by value acts on the gradients before the step: with 16-bit gradients the fused step must read
    # what it left (an fp32 copy), not the reduced partition
    value = {"gradient_clip_algorithm": "value", "clip": 1e-3}
    fused, _ = _fit(world, 2, "always", "gpt", "16-mixed", **value)
    plain, _ = _fit(world, 2, "never", "gpt", "16-mixed", **value)
    for name, tensor in plain.items():
        assert relative_error(fused[name], tensor) <= 2e-3, f"clip by value, 16-mixed: {name}"
    if rank == 0:
        torch.save({f"{s}-{k}-{p}": v for (s, k, p), v in results.items() if p == "32-true"}, out_dir / "fused.pt")


@pytest.mark.parametrize("host_kernel", ["1", "0"], ids=["host-kernel", "reference"])
def test_fused_step_equals_the_optimizer_step(ranks, tmp_path, monkeypatch, host_kernel):
    """CPU masters take the host kernel ("always"), or the CUDA kernels' pure-torch reference without it."""
    if host_kernel == "1" and not host.available():
        pytest.skip("no C compiler to build the host kernel")
    monkeypatch.setenv("LIGHTNING_ZERO_HOST_KERNELS", host_kernel)  # read by the spawned ranks
    ranks(_worker, 2, tmp_path)
    results = torch.load(tmp_path / "fused.pt")
    for kind in ("gpt", "toy"):
        pl.seed_everything(0)
        reference = EquivalenceModule(kind, steps=STEPS)
        make_trainer("auto", 1, steps=STEPS).fit(reference)
        for stage in (1, 2, 3):
            for name, value in reference.state_dict().items():
                err = relative_error(results[f"{stage}-{kind}-32-true"][name], value.float())
                assert err <= 1e-5, f"stage {stage} {kind}: {name} differs from one process by {err:.2e}"


def _checkpoint_worker(rank: int, world: int, root) -> None:
    for stage in (2, 3):
        saving = ModelCheckpoint(root / f"z{stage}", every_n_train_steps=HALF, save_top_k=-1)
        whole, _ = _fit(world, stage, "always", epoch=HALF, callbacks=[saving], enable_checkpointing=True)
        ckpt = str(root / f"z{stage}" / f"epoch=0-step={HALF}.ckpt")
        for fused in ("always", "never"):
            resumed, _ = _fit(world, stage, fused, epoch=HALF, ckpt=ckpt)
            for name, value in whole.items():
                err = relative_error(resumed[name], value)
                assert (err == 0) if fused == "always" else (err <= 1e-6), (stage, fused, name, err)


def test_fused_step_checkpoints_resume_with_and_without_it(ranks, tmp_path):
    ranks(_checkpoint_worker, 2, tmp_path)


def _emulated_worker(rank: int, world: int, out_dir) -> None:
    from tests.support import cuda_emulator

    with pytest.MonkeyPatch.context() as monkeypatch:
        cuda_emulator.emulate(monkeypatch)
        _emulated_runs(world)


def _emulated_runs(world: int) -> None:
    from tests.support import cuda_emulator

    for stage in (1, 2, 3):
        for precision in ("32-true", "16-mixed"):
            cuda_emulator.LAUNCHED.clear()
            fused, probe = _fit(world, stage, "always", "gpt", precision)
            launched = set(cuda_emulator.LAUNCHED)
            plain, _ = _fit(world, stage, "never", "gpt", precision)
            expected = "adamw_multi_f32_none" if precision == "32-true" else "adamw_multi_f32_f16"
            assert expected in launched and probe.fused_units == probe.units > 0, (stage, precision, launched)
            # the kernel's order of operations is not torch's (the reference's is): fp32 within the 1e-5 contract
            tol = 1e-5 if precision == "32-true" else 2e-3
            for name, value in plain.items():
                err = relative_error(fused[name], value)
                assert err <= tol, f"stage {stage} {precision}: {name} differs by {err:.2e}"


def test_fused_step_on_the_emulated_cuda_kernels(ranks, tmp_path):
    """The fused ZeRO step's CUDA path itself (one multi-tensor AdamW launch a step, 16-bit parameters written
    into the all-gather's buffer) on the kernel emulator: stages 1-3, fp32 and fp16, equal the optimizer's
    own step."""
    from tests.support import cuda_emulator

    reason = cuda_emulator.available()
    if reason:
        pytest.skip(reason)
    ranks(_emulated_worker, 2, tmp_path)

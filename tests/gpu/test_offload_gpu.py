"""ZeRO on a CUDA GPU (skipped without one; run by benchmarks/gpu_check.sh): with offload the master weights
and optimizer state are pinned host tensors and the device holds no more than the parameters and the
pooled gradient buckets (``torch.cuda.memory_allocated``); the fused ZeRO step (``fused_step="auto"``, the
default) runs the CUDA kernel; all of them train like the optimizer's own step on the device."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.models.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPTConfig, GPTModule
from tests.support.compare import relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RUNS = {
    "zero2 (optimizer's step)": {"stage": 2, "fused_step": "never"},
    "zero2": {"stage": 2},
    "zero2+offload": {"stage": 2, "offload_optimizer": "cpu"},
    "zero3+offload_param": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
}
SLACK = 96 * 2**20  # cuBLAS workspaces and the like, far below the 12 bytes per parameter offloaded


class DeviceBytes(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        torch.cuda.synchronize()
        strategy = trainer.strategy
        (zero,) = strategy.optimizers
        self.allocated = torch.cuda.memory_allocated()
        self.memory = strategy.memory_bytes()
        self.pooled = strategy.engine.reducer.pool.free_bytes()
        self.fused_units = len(zero.fused._moments) if zero.fused is not None else 0
        self.on_host = all(
            u.training.master.device.type == "cpu" and u.training.master.is_pinned() for u in zero.units
        ) and all(v.device.type == "cpu" for s in zero.state.values() for v in s.values() if torch.is_tensor(v))


def _worker(rank: int, world: int, out) -> None:
    states = {}
    for name, config in RUNS.items():
        pl.seed_everything(0)
        module = GPTModule(GPTConfig(vocab_size=32, block_size=64, n_layer=4, n_head=8, n_embd=512), max_steps=6)
        probe = DeviceBytes()
        trainer = pl.Trainer(
            strategy=ZeroStrategy(ZeroConfig(reduce_bucket_size=2_000_000, timeout=120, **config)),
            accelerator="gpu",
            devices=world,
            max_steps=6,
            callbacks=[probe],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, SyntheticTextDataModule(block_size=64, batch_size=8, num_train=256, seed=0))
        if name == "zero2":
            assert probe.fused_units > 0, "the fused step did not run on CUDA"
        if "offload" in name:
            assert probe.on_host, name
            offloaded = probe.memory["host_master"] + probe.memory["host_optimizer_state"]
            assert offloaded > 4 * SLACK, probe.memory
            device = probe.memory["parameters"] + probe.memory["gradients"] + probe.pooled
            assert probe.allocated <= device + SLACK, (name, probe.allocated, device, probe.memory)
        states[name] = {k: v.float().cpu() for k, v in trainer.strategy.gather_module().state_dict().items()}
    baseline = states["zero2 (optimizer's step)"]
    for name in RUNS:
        for key, value in baseline.items():
            err = relative_error(states[name][key], value)
            assert err <= 1e-5, f"{name}: {key} differs from zero2 with the optimizer's own step by {err:.2e}"


def test_offload_and_the_fused_step_on_cuda(ranks, tmp_path):
    ranks(_worker, 1, tmp_path)


class InjectInf(GPTModule):
    """Rank 0's gradients are all inf at optimizer step 3; a constant learning rate (a step-wise schedule would
    advance on the skipped step when skipping on the device, and hold when skipping on the host)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 3:
            loss.register_hook(lambda g: torch.full_like(g, float("inf")))
        return loss


def _skip_worker(rank: int, world: int, out) -> None:
    from lightning_zero import LossScaleConfig, ZeroPrecision
    from lightning_zero.front.loss_scaler import DynamicLossScaler
    from lightning_zero.sharding.zero_optimizer import ZeroOptimizer

    calls = {"steps": 0}

    def no_sync(method):  # from the second step on (the first moves the step counts to the device)
        counts = method is ZeroOptimizer.step

        def run(self, *args, **kwargs):
            calls["steps"] += counts
            torch.cuda.set_sync_debug_mode("error" if calls["steps"] > 1 else "default")
            try:
                return method(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    masters = {}
    for on_device in (True, False):
        pl.seed_everything(0)
        module = InjectInf(GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_embd=256), max_steps=6)
        config = LossScaleConfig(hysteresis=1, skip_on_device=on_device)
        trainer = pl.Trainer(
            strategy=ZeroStrategy(ZeroConfig(stage=2, timeout=120)),
            plugins=[ZeroPrecision("16-mixed", loss_scale=config)],
            accelerator="gpu",
            devices=world,
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with pytest.MonkeyPatch.context() as patch:
            if on_device:
                guarded = [(ZeroOptimizer, "step"), (ZeroOptimizer, "prepare_grads"), (DynamicLossScaler, "update")]
                guarded += [(ZeroPrecision, "pre_backward"), (ZeroPrecision, "_log")]  # (logging: host tensors)
                for cls, name in guarded:
                    patch.setattr(cls, name, no_sync(getattr(cls, name)))
            trainer.fit(module, SyntheticTextDataModule(block_size=64, batch_size=8, num_train=256, seed=0))
        scaler = trainer.strategy.precision_plugin.scaler
        assert (scaler.skipped_steps, scaler.scale) == (1, 2.0**15), on_device
        (zero,) = trainer.strategy.optimizers
        assert len(zero.fused._moments) == len(zero.units) > 0
        masters[on_device] = torch.cat([u.training.master for u in zero.units]).cpu()
    assert calls["steps"] == 6
    assert torch.equal(masters[True], masters[False]), "skipping on the device trained differently"


def test_fp16_steps_skip_on_the_device_without_a_sync(ranks, tmp_path):
    """``skip_on_device``: no step after the first waits for the GPU, the inf step is skipped, and the run ends
    where the run that skips on the host ends."""
    ranks(_skip_worker, 1, tmp_path)

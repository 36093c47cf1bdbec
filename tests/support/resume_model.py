"""The model, data and trainer the failure and resume tests share (test_resume_mid_epoch.py,
test_preemption.py, resume_target.py): an MLP with dropout (so a resume must restore the random
generators to be exact), shuffled data through ``resumable_loader`` that reports which samples each
micro-batch held, gradient accumulation, clipping, a per-step LR schedule, and validation through a
plain DataLoader (whose iterator draws from torch's global generator).

With GLOBAL_BATCH samples per micro-batch and ACCUMULATE micro-batches per step, an epoch of SAMPLES is
STEPS_PER_EPOCH optimizer steps on any world size that divides GLOBAL_BATCH (1, 2, 3, 4)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy, resumable_loader

SAMPLES, GLOBAL_BATCH, ACCUMULATE = 96, 12, 2
STEPS_PER_EPOCH = SAMPLES // (GLOBAL_BATCH * ACCUMULATE)  # 4


class ResumeModule(pl.LightningModule):
    def __init__(self, dropout: float = 0.2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
        )
        g = torch.Generator().manual_seed(11)
        self.data = TensorDataset(
            torch.randn(SAMPLES, 16, generator=g), torch.randint(4, (SAMPLES,), generator=g), torch.arange(SAMPLES)
        )
        self.seen: list[list[int]] = []  # this rank's sample ids, per micro-batch
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen.append(ids.tolist())
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def val_dataloader(self):  # a plain loader: its iterator draws from torch's global generator
        return DataLoader(self.data, batch_size=8, shuffle=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return resumable_loader(self.data, GLOBAL_BATCH // self.trainer.world_size, shuffle=True)


def make_trainer(
    stage: int | str, world: int, steps: int, *, dirpath=None, callbacks=(), timeout: float = 120, **kwargs
):
    """``stage``: 1, 2, 3, or "ddp"; ``dirpath``: a checkpoint every 2 steps (kept) and last.ckpt."""
    checkpoints = [ModelCheckpoint(dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True)] if dirpath else []
    strategy = (
        DDPStrategy()
        if stage == "ddp"
        else ZeroStrategy(ZeroConfig(stage=stage, timeout=timeout, param_persistence_threshold=0))
    )
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,
        logger=False,
        limit_val_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(dirpath),
        callbacks=[*callbacks, *checkpoints],
        **kwargs,
    )

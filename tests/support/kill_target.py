"""Trains on 2 ranks, saving after every step (the newest checkpoint, plus last.ckpt overwritten each
time), until killed or done (test_checkpoint_kill.py stops a save at a chosen phase and kills it); with a
second argument "async", the saves finish in the background."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.front.spawn import spawn_local_ranks

STEPS = 6


class Wide(pl.LightningModule):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.data = TensorDataset(torch.randn(64, width, generator=torch.Generator().manual_seed(0)))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)


def trainer(world: int, dirpath: str, steps: int, async_save: bool = False) -> pl.Trainer:
    return pl.Trainer(
        strategy=ZeroStrategy(ZeroConfig(stage=2, timeout=60, async_save=async_save)),
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)],
    )


def train(rank: int, world: int, dirpath: str, steps: int, ckpt: str | None, async_save: bool = False) -> None:
    pl.seed_everything(0)
    t = trainer(world, dirpath, steps, async_save)
    t.fit(Wide(), ckpt_path=ckpt)
    assert t.global_step == steps


if __name__ == "__main__":
    background = sys.argv[2:] == ["async"]
    spawn_local_ranks(train, 2, str(Path(sys.argv[1])), STEPS, None, background, start_method="fork")  # imports once

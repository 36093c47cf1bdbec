"""Trains on 2 ranks and saves a sharded checkpoint after every step, until killed (test_checkpoint_kill.py)."""

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
from lightning_zero.spawn import spawn_local_ranks


class Wide(pl.LightningModule):
    """Big enough (1.6M parameters by default) that saving a checkpoint takes longer than a step."""

    def __init__(self, width: int = 256, depth: int = 24) -> None:
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


def trainer(world: int, dirpath: str | None, steps: int) -> pl.Trainer:
    callbacks = [ModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=-1)] if dirpath else []
    return pl.Trainer(
        strategy=ZeroStrategy(ZeroConfig(stage=2, timeout=60)),
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(dirpath),
        callbacks=callbacks,
    )


def _train(rank: int, world: int, dirpath: str) -> None:
    pl.seed_everything(0)
    trainer(world, dirpath, steps=100_000).fit(Wide())


def resume(rank: int, world: int, ckpt: str, steps: int) -> None:
    pl.seed_everything(0)
    t = trainer(world, None, steps)
    t.fit(Wide(), ckpt_path=ckpt)
    assert t.global_step == steps


if __name__ == "__main__":
    spawn_local_ranks(_train, 2, str(Path(sys.argv[1])))

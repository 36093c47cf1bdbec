"""Stage 2 never holds buckets back behind one that cannot fill: a bucket whose parameter gets no
gradient on this rank is launched when its turn comes, and modules registered in another order than
they run are launched in the order backward fills them (agreed after the first backward). Measured as
the most bucket buffers alive at once (filling or in flight), out of 16."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.helpers import make_trainer, zero_strategy

LAYERS, WIDTH = 16, 32
LAYER_NUMEL = WIDTH * WIDTH + WIDTH  # one bucket per layer


class Layers(pl.LightningModule):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.data = TensorDataset(torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(0)))

    def training_step(self, batch, batch_idx):
        layers = list(self.layers)
        if self.variant == "reversed":  # registered in the opposite order of execution
            layers = layers[::-1]
        elif self.variant == "unused":  # the last layer (the first bucket backward would fill) never runs
            layers = layers[:-1]
        h = batch[0]
        for layer in layers:
            h = torch.tanh(layer(h))
        return h.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)


class LiveBuckets(pl.Callback):
    """Peak bucket buffers alive at once, from the second optimizer step on (the first agrees on the order)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            trainer.strategy.engine.reducer.peak_live_buckets = 0

    def on_train_end(self, trainer, pl_module):
        self.peak = trainer.strategy.engine.reducer.peak_live_buckets
        self.buckets = len(trainer.strategy.engine.reducer.order)


def _worker(rank: int, world: int) -> None:
    for variant in ("in_order", "unused", "reversed"):
        live = LiveBuckets()
        strategy = zero_strategy(2, reduce_bucket_size=LAYER_NUMEL, max_inflight_bytes=2 * LAYER_NUMEL * 4)
        make_trainer(strategy, world, steps=5, accumulate=1, callbacks=[live]).fit(Layers(variant))
        assert live.buckets == LAYERS
        # 2 in flight (max_inflight_bytes) plus the one filling, and one being retired
        assert live.peak <= 4, f"{variant}: {live.peak} of {LAYERS} buckets alive at once"


def test_buckets_are_not_held_back(ranks):
    ranks(_worker, 2)

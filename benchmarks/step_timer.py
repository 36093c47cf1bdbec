"""The callback the training benchmarks time their steps with (kept out of common.py, which the launch-time
benchmark imports before Lightning)."""

from __future__ import annotations

import time

import lightning.pytorch as pl


class BatchTimer(pl.Callback):
    """Seconds of every training batch, from its start to its end (forward, backward and the step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.start)

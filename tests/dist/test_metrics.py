"""ZeroMetrics puts throughput, MFU, per-rank bytes and peak memory in the logger (and the progress bar),
next to fp16's loss scale, skipped steps and gradient norm."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import ZeroPrecision
from lightning_zero.front.callbacks import ZeroMetrics
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy


class WithFlops(EquivalenceModule):
    def training_step(self, batch, batch_idx):
        self.flops_per_batch = batch[0].numel() * self.net.flops_per_token()
        return super().training_step(batch, batch_idx)


def _worker(rank: int, world: int, root) -> None:
    pl.seed_everything(0)
    logger = CSVLogger(root, name="run", version=0)
    metrics = ZeroMetrics(peak_flops=1e12, window_size=2)
    trainer = make_trainer(
        zero_strategy(2),
        world,
        steps=6,
        clip=0.5,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[metrics],
        plugins=[ZeroPrecision("16-mixed")],
    )
    trainer.fit(WithFlops("gpt", steps=6))
    if rank == 0:
        shown = trainer.progress_bar_metrics
        assert {"tokens_per_sec", "mfu", "peak_mem_GiB", "loss_scale", "skipped_steps"} <= set(shown), shown


def test_metrics_reach_the_logger(ranks, tmp_path):
    ranks(_worker, 2, tmp_path)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    expected = {
        "train/items_per_sec",
        "train/samples_per_sec",
        "train/device/mfu",
        "peak_mem_GiB",
        "loss_scale",
        "skipped_steps",
        "zero/grad_norm",
        "memory/rank0_parameters_bytes",
        "memory/rank0_gradients_bytes",
        "memory/rank0_optimizer_state_bytes",
    }
    assert expected <= columns, expected - columns
    values = {k: [float(r[k]) for r in rows if r.get(k)] for k in expected}
    assert all(values[k] for k in expected), [k for k in expected if not values[k]]
    assert min(values["train/items_per_sec"]) > 0 and 0 < max(values["train/device/mfu"]) < 1
    assert values["loss_scale"][0] in (2.0**16, 2.0**15)

"""bf16-mixed and fp16 (16-mixed, dynamic loss scaling) train under ZeRO and track the fp32 run's loss."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_zero import ZeroPrecision
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS = 30


def _worker(rank: int, world: int, out_dir) -> None:
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        pl.seed_everything(0)
        module = EquivalenceModule("gpt", steps=STEPS, lr=1e-2)
        # On CPU Lightning turns precision="16-mixed" into bf16, so fp16 is chosen by plugin.
        trainer = make_trainer(
            zero_strategy(2, reduce_bucket_size=3000), world, steps=STEPS, plugins=[ZeroPrecision(precision)]
        )
        trainer.fit(module)
        assert trainer.strategy.precision_plugin.precision == precision
        dtype = torch.float16 if precision == "16-mixed" else torch.float32
        assert all(p.dtype == dtype for p in module.parameters())
        if rank == 0:
            torch.save(module.losses, out_dir / f"{precision}.pt")


def test_mixed_precision_tracks_fp32(ranks, tmp_path):
    ranks(_worker, 2, tmp_path)
    fp32 = torch.tensor(torch.load(tmp_path / "32-true.pt"))
    assert len(fp32) == STEPS * 2
    for precision in ("bf16-mixed", "16-mixed"):
        mixed = torch.tensor(torch.load(tmp_path / f"{precision}.pt"))
        assert len(mixed) == STEPS * 2
        assert not torch.equal(fp32, mixed), f"{precision} must actually change the arithmetic"
        # Early on only rounding separates the runs; later the trajectories drift apart a little.
        assert (mixed[:10] - fp32[:10]).abs().max() < 0.01, precision
        assert abs(mixed[-20:].mean() - fp32[-20:].mean()) < 0.05, precision
        assert mixed[-4:].mean() < mixed[:4].mean() - 0.1, f"{precision} run must learn"

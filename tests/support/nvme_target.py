"""The run of tests/e2e/test_nvme_memory.py: a stack of square Linear layers trained by two ranks with ZeRO-3, its
optimizer state and parameters on NVMe (``--offload nvme``) or in host memory (``--offload cpu``), forked from this
process once it has imported everything; fp32 AdamW, no
clipping. At the end each rank writes the SHA-256 of its parameter shards (fp32: the master weights) and of its
optimizer state, unit by unit, to ``OUT/rank<r>.txt`` (its peak RSS beside them), so runs compare bitwise without
gathering anything.

    python tests/support/nvme_target.py --offload nvme --nvme-dir DIR --out DIR [--width 1024 --layers 24 --steps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import resource
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero.launch_local import spawn_local_ranks
from lightning_zero.sharding.swapped import resident


class Stack(pl.LightningModule):
    def __init__(self, width: int, layers: int, steps: int) -> None:
        super().__init__()
        self.width, self.layers, self.steps = width, layers, steps

    def configure_model(self) -> None:
        # on the meta device: ZeRO-3 initializes one layer at a time (reset_parameters) and keeps its shards only
        with torch.device("meta"):
            self.net = torch.nn.Sequential(*[torch.nn.Linear(self.width, self.width) for _ in range(self.layers)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = torch.randn(self.steps * 4, self.width, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=2)


def shard_digest(strategy) -> str:
    """SHA-256 over this rank's parameter shards, unit by unit (one in host memory at a time)."""
    digest = hashlib.sha256()
    for unit in strategy.engine.units:
        shard = unit.param_swap.read() if unit.param_swap is not None else unit.param_shard
        digest.update(shard.numpy().tobytes())
    return digest.hexdigest()


def state_digest(strategy) -> str:
    """SHA-256 over this rank's Adam moments and step counts, piece by piece (one unit's resident at a time)."""
    digest = hashlib.sha256()
    (zero,) = strategy.optimizers
    for unit in zero.units:
        with resident(unit, zero.optimizer.state):
            for tensor in unit.training.piece_tensors:
                for _, value in sorted(
                    zero.optimizer.state[tensor].items()
                ):  # (by key: the order they were made in varies)
                    digest.update(value.numpy().tobytes())
    return digest.hexdigest()


def train(offload: str, nvme_dir: Path, out: Path, width: int, layers: int, steps: int) -> None:
    """One rank's run (Lightning's environment set: by its launcher, or the test's pool), its digests written to
    ``out``."""
    pl.seed_everything(0)
    config = lightning_zero.ZeroConfig(
        stage=3, offload_optimizer=offload, offload_param=offload, param_persistence_threshold=0,
        unit_module_classes=["Linear"], nvme_path=str(nvme_dir), nvme_buffer_numel=1 << 20,
        prefetch_bucket_size=width * width, max_live_parameters=3 * width * width,
        reduce_bucket_size=width * width, max_inflight_bytes=1 << 25,
        timeout=60.0,  # (a rank the limit kills: the other stops within a minute)
    )  # fmt: skip
    strategy = lightning_zero.ZeroStrategy(config)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Stack(width, layers, steps))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    digests = f"{shard_digest(strategy)} {state_digest(strategy)}"
    (out / f"rank{trainer.global_rank}.txt").write_text(f"{digests} {peak}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offload", choices=["cpu", "nvme"], required=True)
    parser.add_argument("--nvme-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    # the ranks forked from this process once it has imported everything: they share those pages (as torch's fork
    # start method does), and the memory cgroup it runs in counts every page they use once
    launch = (args.offload, args.nvme_dir, args.out, args.width, args.layers, args.steps)
    spawn_local_ranks(_rank, 2, *launch, timeout_s=60.0, start_method="fork")


def _rank(rank: int, world: int, *launch) -> None:
    train(*launch)


if __name__ == "__main__":
    main()

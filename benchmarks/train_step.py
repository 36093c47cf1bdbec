"""A few zero2 training steps of the main job's GPT on one device (CUDA with NCCL, or the CPU): the
loss must fall and every step must be finite. Part of benchmarks/gpu_check.sh; needs no CLI extras.

    python benchmarks/train_step.py --accelerator gpu --steps 50 --fused
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from common import QUIET

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPTConfig, GPTModule


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--fused", action="store_true", help="use the fused transformer block")
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    pl.seed_everything(0)
    cfg = GPTConfig(vocab_size=32, block_size=128, n_layer=4, n_head=8, n_embd=256, fused=args.fused)
    record = Record()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(ZeroConfig(stage=2, reduce_bucket_size=1_000_000)),
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_steps=args.steps,
        **QUIET,
        callbacks=[record],
    )
    began = time.perf_counter()
    trainer.fit(
        GPTModule(cfg, lr=3e-3, warmup_steps=10, max_steps=args.steps),
        SyntheticTextDataModule(block_size=128, batch_size=32, num_train=2048, seed=0),
    )
    seconds = time.perf_counter() - began
    first, last = sum(record.losses[:5]) / 5, sum(record.losses[-5:]) / 5
    ok = all(torch.isfinite(torch.tensor(record.losses))) and last < first - 0.3
    print(
        f"zero2 on {trainer.strategy.root_device}, {args.precision}, fused={args.fused}: {args.steps} steps in"
        f" {seconds:.1f} s; loss {first:.3f} -> {last:.3f}; {'OK' if ok else 'FAILED'}"
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

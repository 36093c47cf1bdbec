"""Sharded checkpoint sizes per rank against the model's size, and what consolidating one costs.

Trains the main job's GPT for two steps under each (stage, world size), saves a checkpoint, and
reports each rank's file against the model's fp32 size (4 Psi bytes; a rank's file holds its fp32
master and Adam's two moments: about 12 Psi / N), then consolidates the checkpoint and reports the
growth of resident memory while it ran and how long it took.

    python benchmarks/checkpoint_size.py --out benchmarks/results/checkpoint_size.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import QUIET, emit

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.launch_local import spawn_local_ranks
from lightning_zero.models.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPTConfig, GPTModule

MIB = 2**20
CASES = [(2, 2), (2, 4), (3, 2), (3, 4)]  # (stage, world size)


def _save(rank: int, world: int, stage: int, cfg: GPTConfig, path: str) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(ZeroConfig(stage=stage)),
        accelerator="cpu",
        devices=world,
        max_steps=2,
        **QUIET,
    )
    trainer.fit(GPTModule(cfg, max_steps=2), SyntheticTextDataModule(batch_size=4, num_train=64, seed=0))
    trainer.save_checkpoint(path)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) * 1024


def _consolidate_measured(ckpt: Path, out: Path) -> tuple[int, float]:
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    start, sampler = _rss(), threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    consolidate(ckpt, out)
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    return peak[0] - start, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=32, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    module = GPTModule(cfg)
    module.configure_model()
    psi = sum(p.numel() for p in module.parameters())
    largest = max(p.numel() for p in module.parameters()) * 4
    lines = [
        "# Sharded checkpoint size per rank and consolidation cost",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} CPU cores; torch {torch.__version__}",
        f"- model: GPT n_layer={args.n_layer} n_embd={args.n_embd}, Psi = {psi:,}; fp32 model size 4 Psi ="
        f" {4 * psi / MIB:.2f} MiB; largest parameter {largest / MIB:.2f} MiB; AdamW",
        f"- command: `python benchmarks/checkpoint_size.py {' '.join(sys.argv[1:])}`",
        "",
        "| stage | ranks | largest rank file MiB | / model size | 12 Psi / N MiB | whole checkpoint MiB"
        " | consolidate: memory growth MiB | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for stage, world in CASES:
            ckpt = Path(tmp) / f"z{stage}-w{world}.ckpt"
            spawn_local_ranks(_save, world, stage, cfg, str(ckpt), timeout_s=600)
            rank_bytes = max(p.stat().st_size for p in ckpt.glob("rank-*.pt"))
            total = sum(p.stat().st_size for p in ckpt.iterdir())
            growth, seconds = _consolidate_measured(ckpt, Path(tmp) / f"z{stage}-w{world}.pt")
            lines.append(
                f"| {stage} | {world} | {rank_bytes / MIB:.2f} | {rank_bytes / (4 * psi):.2f} |"
                f" {12 * psi / world / MIB:.2f} | {total / MIB:.2f} | {growth / MIB:.2f} | {seconds:.2f} |"
            )
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

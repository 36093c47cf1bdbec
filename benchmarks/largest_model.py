"""The largest GPT that fits a fixed per-rank memory budget under ddp and under zero3, by counting bytes.

For each model size the GPT is built on the meta device (nothing allocated) and its per-rank bytes
are counted as the implementation allocates them (fp32 parameters, Adam):
- ddp: parameters + gradients + Adam's two moments = 16 Psi (its all-reduce buckets, another 4 Psi,
  not even counted);
- zero3: the persistent shards, gradient partitions, master and moments over the exact padded
  layouts (16 P / N), plus what is whole for a moment: the root unit and ``max_live_parameters``
  worth of blocks gathered, and the gradient buckets of up to three blocks (one filling, two in
  flight).
Activations are the same for both and left out. Then the largest zero3 model is trained for a few
steps on N CPU ranks and the bytes it reported are printed next to the count.

    python benchmarks/largest_model.py --budget-mib 64 --world-size 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import QUIET, emit

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.launch_local import spawn_local_ranks
from lightning_zero.models.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPT, GPTConfig, GPTModule
from lightning_zero.sharding.layout import build_layout
from lightning_zero.sharding.stage3_setup import assign_units, unit_modules

MIB = 2**20


def gpt_config(n_embd: int, n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=32, block_size=64, n_layer=n_layer, n_head=8, n_embd=n_embd)


def count(cfg: GPTConfig, world: int, live_blocks: int) -> dict[str, int]:
    with torch.device("meta"):
        model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    sizes = []  # (is the root unit, padded numel) per unit, as the strategy lays them out
    for module, params in assign_units(model, unit_modules(model, ())):
        numels = [p.numel() for p in params]
        sizes.append((module is None, build_layout(numels, world, sum(numels)).total_numel))
    total = sum(n for _, n in sizes)
    block = max(n for is_root, n in sizes if not is_root)
    root = sum(n for is_root, n in sizes if is_root)
    sharded = 16 * total // world
    transient = 4 * (root + live_blocks * block) + 4 * 3 * block
    return {"psi": psi, "ddp": 16 * psi, "zero3": sharded + transient, "zero3_sharded": sharded, "block": block}


def _train(rank: int, world: int, cfg: GPTConfig, live: int, out: str) -> None:
    pl.seed_everything(0)
    module = GPTModule(cfg, max_steps=3)
    strategy = ZeroStrategy(ZeroConfig(stage=3, max_live_parameters=live, param_persistence_threshold=0))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=3,
        **QUIET,
    )
    trainer.fit(module, SyntheticTextDataModule(block_size=cfg.block_size, batch_size=2, num_train=64, seed=0))
    report = {"memory": trainer.strategy.memory_bytes(), "peak_gathered": trainer.strategy.peak_gathered_bytes}
    if rank == 0:
        Path(out).write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=float, default=64)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--live-blocks", type=int, default=2, help="max_live_parameters, in blocks")
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    args = parser.parse_args()
    budget, world = args.budget_mib * MIB, args.world_size
    rows, best = [], {"ddp": None, "zero3": None}
    for n_embd in range(64, 2049, 32):
        cfg = gpt_config(n_embd, args.n_layer)
        c = count(cfg, world, args.live_blocks)
        for name in best:
            if c[name] <= budget:
                best[name] = (cfg, c)
        rows.append((n_embd, c))
        if c["zero3"] > budget:
            break
    lines = [
        f"# Largest GPT in {args.budget_mib:g} MiB per rank: ddp vs zero3 at {world} ranks (fp32, Adam)",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} CPU cores; torch {torch.__version__}",
        f"- family: GPT n_layer={args.n_layer}, n_head=8, block 64, vocab 32, n_embd in steps of 32;"
        f" zero3 with max_live_parameters = {args.live_blocks} blocks",
        f"- command: `python benchmarks/largest_model.py {' '.join(sys.argv[1:])}`",
        "",
        "| n_embd | Psi | ddp MiB | zero3 MiB (shards + transient) |",
        "|---|---|---|---|",
    ]
    for n_embd, c in rows:
        lines.append(
            f"| {n_embd} | {c['psi']:,} | {c['ddp'] / MIB:.1f} | {c['zero3'] / MIB:.1f}"
            f" ({c['zero3_sharded'] / MIB:.1f} + {(c['zero3'] - c['zero3_sharded']) / MIB:.1f}) |"
        )
    (ddp_cfg, ddp), (z_cfg, z) = best["ddp"], best["zero3"]
    lines += [
        "",
        f"Largest under ddp: n_embd {ddp_cfg.n_embd}, Psi = {ddp['psi']:,}. Largest under zero3: n_embd"
        f" {z_cfg.n_embd}, Psi = {z['psi']:,} ({z['psi'] / ddp['psi']:.1f}x).",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "report.json"
        spawn_local_ranks(_train, world, z_cfg, args.live_blocks * z["block"], str(out_file), timeout_s=900)
        reported = json.loads(out_file.read_text())
    persistent = sum(reported["memory"].values())
    lines.append(
        f"Trained it for 3 steps on {world} CPU ranks. Rank 0 reported {persistent / MIB:.2f} MiB persistent"
        f" (counted {z['zero3_sharded'] / MIB:.2f}) and at most {reported['peak_gathered'] / MIB:.2f} MiB of"
        f" gathered units; the count's transient part also holds the gradient buckets in flight."
        f" Reported by category: {reported['memory']}."
    )
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

"""Bytes per optimizer step on each process group, measured against the communication model.

Trains the GPT on N CPU ranks laid out as nodes of G ranks (``--per-node``), with plain ZeRO (stages 1,
2, 3) and with hybrid sharding per simulated node (``shard_group_size=G``), and reports, per rank and per
optimizer step: the buffer bytes each group role carried (``ZeroStrategy.traffic.bytes_by_group``: the shard
group, or the world without hybrid, and the replicate group) next to ``comm_model.step_collectives``,
and the model's split of the bytes a ring sends into intra-node and inter-node links. Bytes, not
times: the "nodes" share one machine here.

    python benchmarks/hybrid_traffic.py --out benchmarks/results/hybrid_traffic_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

from common import QUIET, emit

STAGES = (1, 2, 3)


def _worker(rank: int, world: int, args, out_file: str) -> None:
    import lightning.pytorch as pl

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    class Traffic(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % args.micro_batches == 0:
                self.start = trainer.strategy.traffic.copy()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % args.micro_batches == 0:
                self.step = {
                    f"{role}/{op}": n
                    for (role, op), n in trainer.strategy.traffic.since(self.start).bytes_by_group.items()
                }
                units = trainer.strategy.optimizers[0].units
                self.total = sum(u.layout.total_numel for u in units)

    results = []
    for stage, shard in [(stage, size) for size in (None, args.per_node) for stage in STAGES]:
        pl.seed_everything(0)
        config = GPTConfig(vocab_size=32, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
        model = GPTModule(config, max_steps=args.steps)
        data = SyntheticTextDataModule(block_size=64, batch_size=8, num_train=1024, seed=0)
        zero = ZeroConfig(stage=stage, shard_group_size=shard, reduce_bucket_size=1_000_000)
        traffic = Traffic()
        trainer = pl.Trainer(
            strategy=ZeroStrategy(zero),
            accelerator="cpu",
            devices=world,
            max_steps=args.steps,
            accumulate_grad_batches=args.micro_batches,
            callbacks=[traffic],
            **QUIET,
        )
        trainer.fit(model, data)
        size = trainer.strategy.topology.shard_size
        results.append({"stage": stage, "shard": size, "total": traffic.total, "step": traffic.step})
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=2, help="ranks per (simulated) node")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from lightning_zero.launch_local import spawn_local_ranks
    from lightning_zero.planning.comm_model import link_bytes, step_collectives

    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "traffic.json")
        spawn_local_ranks(_worker, args.world_size, args, out_file)
        results = json.loads(Path(out_file).read_text())
    rows = []
    for r in results:
        model = step_collectives(
            f"zero{r['stage']}",
            r["total"],
            world_size=args.world_size,
            shard_size=r["shard"],
            micro_batches=args.micro_batches,
        )
        intra, inter = link_bytes(model, world_size=args.world_size, per_node=args.per_node, shard_size=r["shard"])
        hybrid = r["shard"] < args.world_size
        for (role, op), predicted in sorted(model.items()):
            measured = r["step"].get(f"{role}/{op}", 0)
            rows.append(
                f"| zero{r['stage']} | {r['shard']} | {role} | {op} | {measured:,} | {predicted:,.0f} |"
                f" {measured / predicted:.3f} |"
            )
        rows.append(
            f"| zero{r['stage']} | {r['shard']} | ring model: sent per rank | intra / inter-node |"
            f" | {intra:,.0f} / {inter:,.0f} | {'hybrid' if hybrid else 'plain'} |"
        )
    lines = [
        "# Bytes per optimizer step on each process group (measured) against comm_model.py",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores; {args.world_size} ranks as nodes of"
        f" {args.per_node}; GPT {args.n_layer} x {args.n_embd}, fp32, {args.micro_batches} micro-batches per step",
        f"- command: `python benchmarks/hybrid_traffic.py {' '.join(sys.argv[1:])}`",
        "",
        "| strategy | shard group size | group | collective | measured bytes per rank | model | ratio |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Measured: the buffer bytes each collective covered on rank 0 in the last optimizer step"
        " (`ZeroStrategy.traffic.bytes_by_group`). Stage 3's model is its bound (every unit gathered in forward and"
        " backward); the root unit is gathered once per step, so it measures below. Small all-reduces (norms,"
        " flags) are left out of the model.",
    ]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

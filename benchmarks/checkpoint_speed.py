"""Checkpoint saves against the disk: a synchronous save's throughput beside the disk's own (two writers with
fsync, as dd conv=fsync writes), and how long a save in the background stalls training beside a synchronous
save of the same state, on 2 CPU ranks, interleaved over rounds (medians, min-max).

The model: a GPT of several hundred million parameters at zero3 (each rank writes its masters and Adam's two
moments: 12 bytes per parameter over the ranks), trained one step so the optimizer has its state.

    python benchmarks/checkpoint_speed.py --out benchmarks/results/checkpoint_speed_cpu_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import QUIET, emit


def _disk_baseline(directory: Path, nbytes: int) -> float:
    """Bytes per second two processes write together, each its half, with fsync (dd conv=fsync)."""
    import multiprocessing as mp

    def write(path: Path, size: int) -> None:
        block = b"\0" * (16 << 20)
        with open(path, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    procs = [mp.get_context("fork").Process(target=write, args=(directory / f"dd{r}", nbytes // 2)) for r in range(2)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    seconds = time.perf_counter() - start
    for r in range(2):
        (directory / f"dd{r}").unlink()
    return nbytes / seconds


def _worker(rank: int, world: int, args, out_file: str) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    pl.seed_everything(0)
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=args.n_layer, n_head=16, n_embd=args.n_embd)
    zero = ZeroConfig(stage=3, async_save=True, param_persistence_threshold=0)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(zero), accelerator="cpu", devices=world, max_steps=1, gradient_clip_val=1.0, **QUIET
    )
    data = SyntheticTextDataModule(vocab_size=256, block_size=32, batch_size=1, num_train=64)
    trainer.fit(GPTModule(config, max_steps=1), data)
    root = Path(args.dir)
    rounds = {"sync": [], "stall": [], "background": []}
    for k in range(args.rounds):  # interleaved: each round saves once each way
        dist.barrier()
        start = time.perf_counter()
        trainer.strategy.engine.save(
            trainer._checkpoint_connector.dump_checkpoint(False),
            root / f"sync-{k}.ckpt",
            module=trainer.lightning_module,
            optimizers=trainer.strategy.optimizers,
            synchronous=True,
        )
        rounds["sync"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(root / f"async-{k}.ckpt")  # returns once the state is copied
        rounds["stall"].append(time.perf_counter() - start)
        trainer.strategy.finish_saves()
        rounds["background"].append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            size = sum(f.stat().st_size for f in (root / f"sync-{k}.ckpt").iterdir())
            for name in (f"sync-{k}.ckpt", f"async-{k}.ckpt"):
                shutil.rmtree(root / name)
    psi = sum(p.numel() for p in trainer.lightning_module.parameters())
    if rank == 0:
        Path(out_file).write_text(json.dumps({"rounds": rounds, "bytes": size, "psi": psi}))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=20)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="where to save (default: a temporary directory on the same disk as /tmp)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from lightning_zero.front.spawn import spawn_local_ranks

    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        out_file = str(Path(tmp) / "measured.json")
        spawn_local_ranks(_worker, 2, args, out_file, timeout_s=1800.0, deadline_s=3600.0)
        measured = json.loads(Path(out_file).read_text())
        baselines = [_disk_baseline(Path(args.dir), measured["bytes"]) for _ in range(args.rounds)]
    rounds, nbytes = measured["rounds"], measured["bytes"]
    sync_rate = [nbytes / s for s in rounds["sync"]]
    ratio = [r / b for r, b in zip(sync_rate, baselines)]
    stall = [a / s for a, s in zip(rounds["stall"], rounds["sync"])]
    lines = [
        "# Checkpoint saves against the disk (2 CPU ranks)",
        "",
        f"- date: {datetime.date.today()}; {os.cpu_count()} cores; GPT {args.n_layer} x {args.n_embd}"
        f" ({measured['psi']:,} parameters), zero3, AdamW; checkpoint {nbytes / 1e9:.2f} GB",
        f"- command: `python benchmarks/checkpoint_speed.py --rounds {args.rounds}`",
        "",
        f"Medians (min-max) over {args.rounds} interleaved rounds.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| disk: two writers with fsync, GB/s | {_spread([b / 1e9 for b in baselines])} |",
        f"| synchronous save, s | {_spread(rounds['sync'])} |",
        f"| synchronous save, GB/s | {_spread([r / 1e9 for r in sync_rate])} |",
        f"| synchronous save / disk | {_spread(ratio)} |",
        f"| background save: training stalled, s | {_spread(rounds['stall'])} |",
        f"| background save: until written, s | {_spread(rounds['background'])} |",
        f"| stall / synchronous save | {_spread(stall)} |",
    ]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

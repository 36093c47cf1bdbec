"""Launch to first step: seconds from ``python this_script.py`` to the first training batch on N CPU
ranks, for Lightning's ``ddp`` and for ``zero1``/``zero2``/``zero3`` (same GPT and data), in
interleaved rounds; also what ``import lightning_zero`` adds to ``import lightning.pytorch``.

Each run is a fresh interpreter that Lightning launches the other ranks from (its default ``popen``
launcher re-runs the script), as a user's ``python train.py`` does: imports, process-group set-up,
model and optimizer set-up and sharding all count. The model and data come from lightning_zero in
every run, so its import is in the ddp runs too; the import row gives its cost on its own.

    python benchmarks/launch_time.py --rounds 3 --out benchmarks/results/launch_time.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _run(name: str, world: int, started: float, out_dir: str) -> None:
    """One launch (every rank runs this; Lightning starts ranks 1.. by re-running the script)."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    class FirstBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                Path(out_dir, f"rank{trainer.global_rank}").write_text(str(time.time() - started))

    strategy = "ddp" if name == "ddp" else ZeroStrategy(ZeroConfig(stage=int(name[-1])))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=1,
        callbacks=[FirstBatch()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    config = GPTConfig(vocab_size=32, block_size=64, n_layer=8, n_head=4, n_embd=384)
    trainer.fit(GPTModule(config, max_steps=1), SyntheticTextDataModule(block_size=64, batch_size=16, num_train=256))


def _seconds(command: list[str]) -> float:
    began = time.time()
    subprocess.run(command, check=True, capture_output=True)
    return time.time() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--run", choices=STRATEGIES, help=argparse.SUPPRESS)  # one launch (internal)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _run(args.run, args.world_size, args.started, args.dir)
        return

    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    imports: dict[str, list[float]] = {"lightning.pytorch": [], "lightning_zero": []}
    for _ in range(args.rounds):
        for name in STRATEGIES:
            with tempfile.TemporaryDirectory() as tmp:
                command = [sys.executable, __file__, "--world-size", str(args.world_size), "--run", name]
                subprocess.run(
                    [*command, "--started", repr(time.time()), "--dir", tmp], check=True, capture_output=True
                )
                times[name].append(max(float(p.read_text()) for p in Path(tmp).iterdir()))
        for module in imports:
            imports[module].append(_seconds([sys.executable, "-c", f"import {module}"]))
    ddp = statistics.median(times["ddp"])
    lines = [
        f"# Launch to first training batch, {args.world_size} CPU ranks (gloo)",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores; GPT 8 x 384 (14.2 M parameters),"
        f" {args.rounds} interleaved rounds",
        f"- command: `python benchmarks/launch_time.py {' '.join(sys.argv[1:])}`",
        "",
        "| launch | median s | min-max s | vs ddp |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.2f} | {min(values):.2f}-{max(values):.2f} | {median - ddp:+.2f} s |")
    base = statistics.median(imports["lightning.pytorch"])
    for module, values in imports.items():
        median = statistics.median(values)
        lines.append(
            f"| `python -c 'import {module}'` | {median:.2f} | {min(values):.2f}-{max(values):.2f} |"
            f" {median - base:+.2f} s vs lightning |"
        )
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

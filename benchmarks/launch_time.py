"""Launch to first step on N CPU ranks, for Lightning's ``ddp`` and ``zero1``/``zero2``/``zero3`` (same GPT
and data), in interleaved rounds, split into the parts that differ between them.

A launch is imports + set-up (process group, model, optimizer, sharding) up to the first training batch.
Imports dominate and vary by seconds from one run to the next on a loaded machine, which buries a
difference of tenths, so each part is measured on its own:

- ``python train.py``: the whole launch as a user runs it (Lightning's ``popen`` launcher re-runs the
  script for rank 1), timed from the command to the first batch on the slowest rank;
- ``torchrun``: every rank started by torchrun (no re-run), each recording when its imports finished and
  when its first batch started; set-up = last first batch - last import finished, so the imports'
  noise stays out;
- the import of lightning_zero (with the GPT and data modules a run uses) in an interpreter that has
  already imported ``lightning.pytorch``: what it adds on top of Lightning's own import.

What ZeRO adds to a launch is then its import plus (its set-up - ddp's set-up).

    python benchmarks/launch_time.py --rounds 5 --out benchmarks/results/launch_time.md
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

from common import QUIET, emit

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ADDED_IMPORT = (
    "import time, lightning.pytorch; t = time.perf_counter(); import lightning_zero, lightning_zero.models.gpt,"
    " lightning_zero.models.data; print(time.perf_counter() - t)"
)


def _run(name: str, world: int, out_dir: str) -> None:
    """One launch (every rank runs this: started by torchrun, or re-run by Lightning for ranks 1..)."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    imported = time.time()

    class FirstBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                Path(out_dir, f"rank{trainer.global_rank}").write_text(f"{imported} {time.time()}")

    strategy = "ddp" if name == "ddp" else ZeroStrategy(ZeroConfig(stage=int(name[-1])))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=1, callbacks=[FirstBatch()], **QUIET
    )
    config = GPTConfig(vocab_size=32, block_size=64, n_layer=8, n_head=4, n_embd=384)
    trainer.fit(GPTModule(config, max_steps=1), SyntheticTextDataModule(block_size=64, batch_size=16, num_train=256))


def _launch(command: list[str]) -> tuple[float, float]:
    """Seconds from starting ``command`` to the last rank's first batch, and the set-up part of it."""
    with tempfile.TemporaryDirectory() as tmp:
        began = time.time()
        subprocess.run([*command, "--dir", tmp], check=True, capture_output=True)
        marks = [tuple(map(float, p.read_text().split())) for p in Path(tmp).iterdir()]
    last_batch = max(batch for _, batch in marks)
    return last_batch - began, last_batch - max(imported for imported, _ in marks)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one-launch", choices=STRATEGIES, help=argparse.SUPPRESS)  # one launch (internal)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_launch:
        _run(args.one_launch, args.world_size, args.dir)
        return

    world = str(args.world_size)
    whole: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    setup: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    added_import: list[float] = []
    for _ in range(args.rounds):
        for name in STRATEGIES:
            script = [__file__, "--world-size", world, "--one-launch", name]
            whole[name].append(_launch([sys.executable, *script])[0])
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", world]
            setup[name].append(_launch([*torchrun, *script])[1])
        out = subprocess.run([sys.executable, "-c", ADDED_IMPORT], check=True, capture_output=True, text=True)
        added_import.append(float(out.stdout))
    ddp_whole, ddp_setup = statistics.median(whole["ddp"]), statistics.median(setup["ddp"])
    imported = statistics.median(added_import)
    lines = [
        f"# Launch to first training batch, {args.world_size} CPU ranks (gloo)",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores; GPT 8 x 384 (14.2 M parameters),"
        f" {args.rounds} interleaved rounds",
        f"- command: `python benchmarks/launch_time.py {' '.join(sys.argv[1:])}`",
        f"- importing lightning_zero (+ its GPT and data modules) after lightning.pytorch:"
        f" median {imported:.3f} s, min-max {min(added_import):.3f}-{max(added_import):.3f} s",
        "",
        "| strategy | `python train.py` median s | min-max | set-up under torchrun median s | min-max |"
        " set-up vs ddp | import + set-up vs ddp |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in STRATEGIES:
        extra = statistics.median(setup[name]) - ddp_setup
        added = "" if name == "ddp" else f"{imported + extra:+.2f} s"
        lines.append(f"| {name} | {_spread(whole[name])} | {_spread(setup[name])} | {extra:+.2f} s | {added} |")
    lines += [
        "",
        f"The whole launch of ddp took {ddp_whole:.2f} s (median). In the ddp runs lightning_zero is imported too"
        " (the GPT and data come from it): the last column adds its import back.",
    ]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

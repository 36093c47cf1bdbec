"""The step-time model against measured steps on this machine (issue: "within 25%").

``lightning-zero estimate --measure`` takes the FLOP rate of the main job's GPT training step on N ranks
at once and the gloo bus bandwidth between them, and predicts the step of ddp and zero1/2/3
(time_model.py). Then the same GPT trains on N ranks with zero1, zero2 and zero3, interleaved for
``--rounds`` rounds: median step time (first steps dropped) and the ratio predicted / measured.

    python benchmarks/time_model_check.py --out benchmarks/results/time_model_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import QUIET, emit

ROOT = Path(__file__).resolve().parents[1]
STAGES = (1, 2, 3)


def _worker(rank: int, world: int, args, out_file: str) -> None:
    import lightning.pytorch as pl
    from step_timer import BatchTimer

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    times: dict[int, list[float]] = {stage: [] for stage in STAGES}
    for _ in range(args.rounds):
        for stage in STAGES:
            pl.seed_everything(0)
            config = GPTConfig(vocab_size=32, block_size=64, n_layer=4, n_head=4, n_embd=128)  # configs/gpt.yaml's
            timer = BatchTimer()
            trainer = pl.Trainer(
                strategy=ZeroStrategy(ZeroConfig(stage=stage, reduce_bucket_size=200_000)),
                accelerator="cpu",
                devices=world,
                max_steps=args.steps,
                callbacks=[timer],
                **QUIET,
            )
            data = SyntheticTextDataModule(block_size=64, batch_size=16, seed=0)
            trainer.fit(GPTModule(config, max_steps=args.steps), data)
            times[stage] += timer.times[args.warmup :]
    if rank == 0:
        Path(out_file).write_text(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from lightning_zero.launch_local import spawn_local_ranks

    command = [sys.executable, "-m", "lightning_zero.cli.main", "estimate", "--model", "configs/gpt.yaml"]
    command += ["--devices", str(args.world_size), "--measure"]
    estimate = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    table = estimate.split("predicted step per rank")[1].splitlines()
    predicted = {row.split()[0]: float(row.split()[5]) for row in table[2:] if row.split()}
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "times.json")
        spawn_local_ranks(_worker, args.world_size, args, out_file)
        measured = {int(k): v for k, v in json.loads(Path(out_file).read_text()).items()}
    rows = []
    for stage in STAGES:
        median = statistics.median(measured[stage])
        q1, _, q3 = statistics.quantiles(measured[stage], n=4)
        guess = predicted[f"zero{stage}"]
        spread = f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}"
        rows.append(f"| zero{stage} | {guess * 1e3:.1f} | {median * 1e3:.1f} | {spread} | {guess / median:.2f} |")
    lines = [
        "# The step-time model against measured steps",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores; {args.world_size} ranks; the main"
        f" job's GPT (configs/gpt.yaml), fp32; {args.steps} steps x {args.rounds} interleaved rounds, first"
        f" {args.warmup} dropped",
        f"- command: `python benchmarks/time_model_check.py {' '.join(sys.argv[1:])}`",
        "",
        "`lightning-zero estimate --model configs/gpt.yaml --devices 2 --measure`:",
        "",
        "```",
        "predicted step per rank" + "\n".join(table),
        "```",
        "",
        "| strategy | predicted ms | measured median ms | IQR ms | predicted / measured |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "The model leaves out the framework's own time per step (Lightning's loop and hooks, ZeRO's bucket"
        " copies): the prediction is below the measurement by about that much.",
    ]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

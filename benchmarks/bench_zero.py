"""Side by side on the same model, data and seed: Lightning ``ddp``, ``zero1``, ``zero2`` and ``zero3`` on N CPU ranks.

One invocation spawns the ranks once and runs every strategy in them, in interleaved rounds, so the
machine's state is shared. It reports the median optimizer-step time (warm-up steps dropped), its
ratio to ddp, each strategy's per-rank bytes of parameters / gradients / optimizer state (master
weights included) next to the ZeRO formula for that stage and world size, zero3's peak bytes of
gathered units, and every strategy's elements communicated per step against Psi.

    python benchmarks/bench_zero.py                    # the main job's GPT, 2 ranks
    python benchmarks/bench_zero.py --n-embd 256 --n-layer 8 --out benchmarks/results/zero_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from common import QUIET, emit
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.launch_local import spawn_local_ranks
from lightning_zero.models.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPTConfig, GPTModule
from lightning_zero.planning.memory import formula_bytes

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.bytes: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module):
        self._traffic = trainer.strategy.traffic.copy() if isinstance(trainer.strategy, ZeroStrategy) else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if (
            not self.bytes
            and isinstance(trainer.strategy, DDPStrategy)
            and not isinstance(trainer.strategy, ZeroStrategy)
        ):
            state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
            self.bytes = {
                "parameters": sum(p.nbytes for p in pl_module.parameters()),
                "gradients": sum(p.grad.nbytes for p in pl_module.parameters() if p.grad is not None),
                "optimizer_state": state,  # measured on the first step, before Adam allocates: see on_train_end
            }

    def on_train_end(self, trainer, pl_module):
        if isinstance(trainer.strategy, ZeroStrategy):
            mem = trainer.strategy.memory_bytes()
            self.bytes = {
                "parameters": mem["parameters"],
                "gradients": mem["gradients"],
                "optimizer_state": mem["master"] + mem["optimizer_state"],
            }
            if trainer.strategy.engine.stage3 is not None:
                self.bytes["gathered_peak"] = trainer.strategy.engine.stage3.peak_gathered_bytes
            moved = sum(
                trainer.strategy.traffic.since(self._traffic).elements[k] for k in ("reduce_scatter", "all_gather")
            )
            self.elements_per_step = moved / trainer.global_step
        else:
            (optimizer,) = trainer.optimizers
            self.bytes["optimizer_state"] = sum(
                v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            )


def _strategy(name: str, bucket: int):
    if name == "ddp":
        return DDPStrategy()
    return ZeroStrategy(ZeroConfig(stage=int(name[-1]), reduce_bucket_size=bucket, max_live_parameters=2 * bucket))


def _collective_ms(psi: int, world: int) -> dict[str, float]:
    """Median ms of one all-reduce vs one reduce-scatter + one all-gather over psi elements."""
    n = -(-psi // world) * world
    full, shard = torch.randn(n), torch.empty(n // world)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter + all_gather": lambda: (
            dist.reduce_scatter_single(shard, full),
            dist.all_gather_single(full, shard),
        ),
    }
    out = {}
    for name, op in ops.items():
        op()
        times = []
        for _ in range(7):
            dist.barrier()
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e3
    return out


def _worker(rank: int, world: int, args, out_file: str) -> None:
    results = {name: {"times": [], "bytes": {}} for name in STRATEGIES}
    for _ in range(args.rounds):
        for name in STRATEGIES:
            pl.seed_everything(0)
            model = GPTModule(
                GPTConfig(
                    vocab_size=32, block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
                ),
                max_steps=args.steps,
            )
            data = SyntheticTextDataModule(
                block_size=args.block_size, batch_size=args.batch_size, num_train=2048, seed=0
            )
            timer = StepTimer()
            trainer = pl.Trainer(
                strategy=_strategy(name, args.bucket),
                accelerator="cpu",
                devices=world,
                max_steps=args.steps,
                **QUIET,
                callbacks=[timer],
            )
            trainer.fit(model, data)
            results[name]["times"] += timer.times[args.warmup :]
            results[name]["bytes"] = timer.bytes
            results[name]["elements_per_step"] = getattr(timer, "elements_per_step", None)
            results[name]["psi"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    results["collectives"] = _collective_ms(results["ddp"]["psi"], world)
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _table(results: dict, world: int, args) -> str:
    psi = results["ddp"]["psi"]
    ddp_median = statistics.median(results["ddp"]["times"])
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    lines = [
        f"# ddp vs zero1 vs zero2 vs zero3 on {world} CPU ranks (gloo)",
        "",
        f"- date: {datetime.date.today().isoformat()}; machine: {cpu}, {os.cpu_count()} cores;"
        f" torch {torch.__version__}, lightning {pl.__version__}",
        f"- model: GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size}, Psi = {psi:,} parameters;"
        f" per-rank batch {args.batch_size}; {args.steps} steps x {args.rounds} interleaved rounds, first {args.warmup}"
        f" steps of each run dropped; zero bucket {args.bucket:,} elements",
        f"- command: `python benchmarks/bench_zero.py {' '.join(sys.argv[1:])}`",
        "",
        "| strategy | median step (ms) | vs ddp | params MiB (formula) | grads MiB (formula)"
        " | optimizer state MiB (formula) | peak gathered MiB | sent per step / Psi |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in STRATEGIES:
        r = results[name]
        median = statistics.median(r["times"])
        f = formula_bytes(name, psi, world)
        cells = [f"{_mib(r['bytes'][k])} ({_mib(f[k])})" for k in ("parameters", "gradients", "optimizer_state")]
        cells.append(_mib(r["bytes"]["gathered_peak"]) if "gathered_peak" in r["bytes"] else "-")
        per_step = r["elements_per_step"]
        cells.append("2 (one all-reduce)" if per_step is None else f"{per_step / psi:.2f}")
        lines.append(f"| {name} | {median * 1e3:.1f} | {median / ddp_median:.2f}x | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Optimizer state is Adam's two moments (formula K = 8 bytes: with fp32 parameters each rank steps its own",
        "chunks of the parameters in place, so there is no separate master; K = 12 with 16-bit ones), and Adam's",
        "per-parameter step counters. ddp's gradients are the `.grad` tensors; its internal all-reduce",
        "buckets (another 4 Psi) are not counted. zero3's parameters are its shards; 'peak gathered' is the most",
        "bytes of whole units alive at once (the root unit, the running block and the prefetched one). 'sent per",
        "step' counts the elements each reduce-scatter reads and each all-gather writes: the ZeRO paper's 2 Psi",
        "for stages 1 and 2 and 3 Psi for stage 3 (slightly less: the root unit is gathered once per step).",
        "",
        "The same run timed the collectives alone over Psi elements (median of 7): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in results["collectives"].items())
        + ". ZeRO moves the same bytes as ddp (2 Psi), but gloo's CPU reduce-scatter is slower than its all-reduce,",
        "and the all-gather after the step does not overlap with compute; on NCCL reduce-scatter + all-gather",
        "is an all-reduce's two halves.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=200_000)
    parser.add_argument("--out", type=Path, help="also write the Markdown table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "results.json")
        spawn_local_ranks(_worker, args.world_size, args, out_file, timeout_s=600)
        results = json.loads(Path(out_file).read_text())
    emit(_table(results, args.world_size, args), args.out)


if __name__ == "__main__":
    main()

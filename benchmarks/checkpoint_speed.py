"""Checkpoint saves against the disk: a synchronous save's throughput beside the disk's own (the ranks writing as
many bytes with fsync right before it, as dd conv=fsync writes), and how long a save in the background stalls
training beside a synchronous save of the same state, on 2 CPU ranks, in one training run, interleaved over rounds
(medians, min-max).

The model: a GPT of several hundred million parameters at zero3 (each rank writes its masters and Adam's two
moments: 12 bytes per parameter over the ranks), saved between its training steps.

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


def _standalone_dd(directory: Path, nbytes: int) -> float:
    """Bytes per second two fresh processes write together, each half of ``nbytes``, with fsync: the disk as
    it is when no training process holds the machine's memory."""
    import multiprocessing as mp

    context = mp.get_context("fork")
    procs = [context.Process(target=_write_like_dd, args=(directory / f"dd{r}", nbytes // 2)) for r in range(2)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return nbytes / (time.perf_counter() - start)


def _write_like_dd(path: Path, nbytes: int) -> None:
    """``nbytes`` of zeros in 16 MiB blocks, then fsync (dd bs=16M conv=fsync)."""
    block = memoryview(b"\0" * (16 << 20))
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - start)])
        f.flush()
        os.fsync(f.fileno())
    path.unlink()


class _Saves:
    """In one training run, each round: a synchronous save, a few plain steps, a background save and the steps
    after it; the time every step takes (batch start to batch end: forward, backward, optimizer step)."""

    def __init__(self, root: Path, rounds: int, settle: int) -> None:
        import lightning.pytorch as pl

        class Callback(pl.Callback):
            def on_train_batch_start(cb, trainer, *args) -> None:
                self.started = time.perf_counter()

            def on_train_batch_end(cb, trainer, *args) -> None:
                self.step_times.append(time.perf_counter() - self.started)
                self.at_step_end(trainer)

        self.callback = Callback()
        self.root, self.rounds, self.settle = root, rounds, settle
        self.period = 2 * settle + 2
        self.step_times: list[float] = []
        self.sync: list[float] = []
        self.disk: list[float] = []  # bytes/s, right before a synchronous save: the ranks writing as much, with fsync
        self.blocked: list[float] = []
        self.written: list[float] = []
        self.after_background: list[int] = []  # indices of the steps right after a background save
        self.snapshot_waits: list[float] = []  # how long each of those steps' optimizer step waited for the copy
        self.plain: list[int] = []  # indices of steps with no save in flight

    @property
    def steps(self) -> int:
        return self.settle + self.rounds * self.period

    def at_step_end(self, trainer) -> None:
        import torch.distributed as dist

        index = len(self.step_times) - 1
        phase = index - self.settle
        if phase < 0:
            return
        k, at = divmod(phase, self.period)
        if at == self.settle + 1:  # the step after a background save
            self.snapshot_waits.append(trainer.strategy.engine.background.snapshot_wait_s)
        if at == 0:  # the disk's own speed, then a synchronous save
            if k > 0:  # (the size is known from the first save)
                dist.barrier()
                start = time.perf_counter()
                _write_like_dd(self.root / f"dd-{trainer.global_rank}", self.bytes // trainer.world_size)
                dist.barrier()
                self.disk.append(self.bytes / (time.perf_counter() - start))
            dist.barrier()
            start = time.perf_counter()
            trainer.strategy.engine.save(
                trainer._checkpoint_connector.dump_checkpoint(False),
                self.root / f"sync-{k}.ckpt",
                module=trainer.lightning_module,
                optimizers=trainer.strategy.optimizers,
                synchronous=True,
            )
            self.sync.append(time.perf_counter() - start)
            self.bytes = sum(f.stat().st_size for f in (self.root / f"sync-{k}.ckpt").iterdir())
        elif at == self.settle:  # a background save: how long it holds this step
            dist.barrier()
            self.background_started = time.perf_counter()
            trainer.save_checkpoint(self.root / f"async-{k}.ckpt")
            self.blocked.append(time.perf_counter() - self.background_started)
            self.after_background.append(index + 1)
        elif at == self.period - 1:  # written by now? (it was given the steps between)
            trainer.strategy.finish_saves()
            self.written.append(time.perf_counter() - self.background_started)
            dist.barrier()
            if trainer.global_rank == 0:
                for name in (f"sync-{k}.ckpt", f"async-{k}.ckpt"):
                    shutil.rmtree(self.root / name)
        elif 0 < at < self.settle:
            self.plain.append(index + 1)


def _worker(rank: int, world: int, args, out_file: str) -> None:
    import lightning.pytorch as pl

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    pl.seed_everything(0)
    config = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=16, n_embd=args.n_embd)
    zero = ZeroConfig(stage=3, async_save=True, param_persistence_threshold=0)
    saves = _Saves(Path(args.dir), args.rounds, settle=3)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(zero), accelerator="cpu", devices=world, max_steps=saves.steps, gradient_clip_val=1.0,
        callbacks=[saves.callback], **QUIET,
    )  # fmt: skip
    data = SyntheticTextDataModule(vocab_size=256, block_size=args.block, batch_size=1, num_train=4 * saves.steps)
    trainer.fit(GPTModule(config, max_steps=saves.steps), data)
    times = saves.step_times
    measured = {
        "sync": saves.sync, "disk": saves.disk, "blocked": saves.blocked, "written": saves.written,
        "plain_step": [times[i] for i in saves.plain], "after_background": [times[i] for i in saves.after_background],
        "snapshot_waits": saves.snapshot_waits,
        "psi": sum(p.numel() for p in trainer.lightning_module.parameters()), "bytes": saves.bytes,
    }  # fmt: skip
    if rank == 0:
        Path(out_file).write_text(json.dumps(measured))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=20)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--block", type=int, default=256, help="tokens per sample (one sample per step and rank)")
    parser.add_argument("--rounds", type=int, default=4, help="the first warms up and is not counted")
    parser.add_argument("--dir", help="where to save (default: a temporary directory on the same disk as /tmp)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from lightning_zero.launch_local import spawn_local_ranks

    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        out_file = str(Path(tmp) / "measured.json")
        spawn_local_ranks(_worker, 2, args, out_file, timeout_s=1800.0, deadline_s=3600.0)
        measured = json.loads(Path(out_file).read_text())
        standalone = [_standalone_dd(Path(args.dir), measured["bytes"]) for _ in range(args.rounds - 1)]
    # the first round warms up (its first save allocates and faults in what later saves reuse): not counted
    measured.update({k: measured[k][1:] for k in ("sync", "blocked", "snapshot_waits", "after_background", "written")})
    nbytes, sync, baselines = measured["bytes"], measured["sync"], measured["disk"]
    sync_rate = [nbytes / s for s in sync]
    ratio = [r / b for r, b in zip(sync_rate, baselines)]
    step = statistics.median(measured["plain_step"])
    extra = [max(0.0, t - step) for t in measured["after_background"]]
    stall = [b + w for b, w in zip(measured["blocked"], measured["snapshot_waits"])]
    shared = [e - w for e, w in zip(extra, measured["snapshot_waits"])]
    lines = [
        "# Checkpoint saves against the disk (2 CPU ranks)",
        "",
        f"- date: {datetime.date.today()}; {os.cpu_count()} cores; GPT {args.n_layer} x {args.n_embd}"
        f" ({measured['psi']:,} parameters), {args.block} tokens per rank and step, zero3, AdamW;"
        f" checkpoint {nbytes / 1e9:.2f} GB",
        f"- command: `python benchmarks/checkpoint_speed.py --rounds {args.rounds}`",
        "- in one training run, each round: a synchronous save, plain steps, a background save and the steps after"
        " it. Training is stalled by a background save while `save_checkpoint` holds its step and while the next"
        " optimizer step waits for the snapshot (the copy runs beside that step's forward and backward). Apart from"
        " that stall, the next step also runs slower than a plain step: the copy and the writer share the 2 cores"
        " with training (on a GPU the copy is a device-to-host transfer and the writer has cores of its own).",
        "",
        f"Medians (min-max) over {args.rounds - 1} interleaved rounds, after one that warms up.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| disk: the 2 ranks writing as many bytes with fsync (dd), GB/s | {_spread([b / 1e9 for b in baselines])} |",
        f"| synchronous save, s | {_spread(sync)} |",
        f"| synchronous save, GB/s | {_spread([r / 1e9 for r in sync_rate])} |",
        f"| synchronous save / disk | {_spread(ratio)} |",
        f"| disk: 2 fresh processes writing as much, after the run, GB/s | {_spread([b / 1e9 for b in standalone])} |",
        f"| synchronous save / that | {_spread([nbytes / s / b for s, b in zip(sync, standalone)])} |",
        f"| plain training step, s | {_spread(measured['plain_step'])} |",
        f"| background save: `save_checkpoint` returns after, s | {_spread(measured['blocked'])} |",
        f"| background save: the next optimizer step waits for the copy, s | {_spread(measured['snapshot_waits'])} |",
        f"| background save: training stalled (the two above), s | {_spread(stall)} |",
        f"| background save: the next step's time beyond a plain step's, s | {_spread(extra)} |",
        f"| of which sharing the cores (not waiting), s | {_spread(shared)} |",
        f"| background save: until written, s | {_spread(measured['written'])} |",
        f"| stall / synchronous save | {_spread([a / s for a, s in zip(stall, sync)])} |",
    ]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

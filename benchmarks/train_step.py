"""A few zero2 training steps of the main job's GPT on one device (CUDA with NCCL, or the CPU): the
loss must fall and every step must be finite. Part of benchmarks/gpu_check.sh; needs no CLI extras.

    python benchmarks/train_step.py --accelerator gpu --steps 50 --fused
    python benchmarks/train_step.py --accelerator gpu --steps 50 --compare-fp16-skips 3

``--compare-fp16-skips N`` trains in fp16 N times each way, alternating: skipping overflowed steps on the
host (one read of the overflow flag a step) and on the device (``LossScaleConfig(skip_on_device=True)``: no
read), and prints the median time per step after the first 10 of each (spread: min-max) and their ratio.
Losses are read once, after training, so nothing else waits for the device during the timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from common import QUIET

from lightning_zero import LossScaleConfig, ZeroConfig, ZeroPrecision, ZeroStrategy
from lightning_zero.models.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPTConfig, GPTModule

WARMUP = 10  # steps before the clock starts


class Record(pl.Callback):
    """Each step's loss (kept on the device until the end) and the time per step after WARMUP."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.began: float | None = None
        self.seconds_per_step = float("nan")

    def _sync(self, trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach())
        if len(self.losses) == WARMUP:
            self.began = self._sync(trainer)

    def on_train_end(self, trainer, pl_module):
        if self.began is not None:
            self.seconds_per_step = (self._sync(trainer) - self.began) / (len(self.losses) - WARMUP)


def train(args, precision: str, plugins: list) -> Record:
    pl.seed_everything(0)
    size = dict(n_layer=1, n_head=2, n_embd=32) if args.small else dict(n_layer=4, n_head=8, n_embd=256)
    cfg = GPTConfig(vocab_size=32, block_size=128, **size, fused=args.fused)
    record = Record()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(ZeroConfig(stage=2, reduce_bucket_size=1_000_000)),
        accelerator=args.accelerator,
        devices=1,
        precision=None if plugins else precision,
        plugins=plugins,
        max_steps=args.steps,
        **QUIET,
        callbacks=[record],
    )
    trainer.fit(
        GPTModule(cfg, lr=3e-3, warmup_steps=10, max_steps=args.steps),
        SyntheticTextDataModule(block_size=128, batch_size=32, num_train=2048, seed=0),
    )
    losses = torch.stack(record.losses).float().cpu()
    first, last = losses[:5].mean().item(), losses[-5:].mean().item()
    ok = bool(torch.isfinite(losses).all()) and last < first - 0.3
    print(
        f"zero2 on {trainer.strategy.root_device}, {precision}, fused={args.fused}: {args.steps} steps,"
        f" {1e3 * record.seconds_per_step:.2f} ms/step after {WARMUP}; loss {first:.3f} -> {last:.3f};"
        f" {'OK' if ok else 'FAILED'}"
    )
    if not ok:
        raise SystemExit(1)
    return record


def compare_fp16_skips(args) -> None:
    times: dict[str, list[float]] = {"host": [], "device": []}
    for _ in range(args.compare_fp16_skips):
        for where in times:  # alternating, so a drift in the machine's speed hits both
            scale = LossScaleConfig(skip_on_device=where == "device")
            record = train(args, f"16-mixed, skipping on the {where}", [ZeroPrecision("16-mixed", loss_scale=scale)])
            times[where].append(1e3 * record.seconds_per_step)
    for where, ms in times.items():
        spread = f"min {min(ms):.2f}, max {max(ms):.2f}"
        print(f"skipping on the {where}: median {statistics.median(ms):.2f} ms/step ({spread})")
    ratio = statistics.median(times["host"]) / statistics.median(times["device"])
    print(f"host-skip time / device-skip time: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--fused", action="store_true", help="use the fused transformer block")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--compare-fp16-skips", type=int, default=0, metavar="N", help="see above")
    parser.add_argument("--small", action="store_true", help="a one-layer GPT (fp16 on the CPU is slow)")
    args = parser.parse_args()
    if args.steps <= WARMUP + 5:
        parser.error(f"--steps must be > {WARMUP + 5} (the first {WARMUP} are not timed), got {args.steps}")
    if args.compare_fp16_skips:
        compare_fp16_skips(args)
    else:
        train(args, args.precision, [])


if __name__ == "__main__":
    main()

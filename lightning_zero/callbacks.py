"""ZeroSummary: the end-of-fit report of the main job: throughput and per-rank memory against the formula."""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_zero.memory import formula_bytes
from lightning_zero.sharding import collectives
from lightning_zero.strategy import ZeroStrategy


def _mb(n: float) -> str:
    return f"{n / 2**20:9.2f}"


class ZeroSummary(pl.Callback):
    """Times training batches (validation excluded) and prints tokens/s and each rank's bytes at the end.

    A batch is ``(x, y)`` with ``x`` of shape (B, T): every element of ``x`` is one token.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.samples = 0
        self.seconds = 0.0
        self.first_loss = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds += time.perf_counter() - self._start
        x = batch[0]
        self.tokens += x.numel() * trainer.world_size
        self.samples += x.shape[0] * trainer.world_size
        if self.first_loss is None and "train_loss" in trainer.callback_metrics:
            self.first_loss = float(trainer.callback_metrics["train_loss"])

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            return
        ranks = collectives.all_gather_object(strategy.memory_bytes())
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        psi = sum(p.numel() for p in trainable)
        name = f"zero{strategy.config.stage}"
        formula = formula_bytes(name, psi, trainer.world_size, trainable[0].element_size())
        lines = [
            f"{name}: {trainer.world_size} ranks, precision {trainer.precision}, {psi:,} trainable parameters (Psi)",
            f"throughput: {self.tokens / self.seconds:,.0f} tokens/s, {self.samples / self.seconds:,.1f} samples/s"
            f" ({trainer.global_step} optimizer steps, {self.seconds:.1f} s in training batches)",
            "per-rank MiB   parameters  gradients  optimizer state (master + optimizer)",
        ]
        if self.first_loss is not None and "train_loss" in trainer.callback_metrics:
            floor = getattr(trainer.datamodule, "loss_floor", None)
            reachable = f" (lowest reachable: {floor:.3f})" if floor is not None else ""
            last = float(trainer.callback_metrics["train_loss"])
            lines.insert(1, f"train loss: {self.first_loss:.3f} at the first step, {last:.3f} at the last{reachable}")
        for rank, mem in enumerate(ranks):
            state = mem["master"] + mem["optimizer_state"]
            lines.append(f"rank {rank:<8} {_mb(mem['parameters'])}  {_mb(mem['gradients'])}  {_mb(state)}")
        f = formula
        lines.append(
            f"formula       {_mb(f['parameters'])}  {_mb(f['gradients'])}  {_mb(f['optimizer_state'])}"
            "   (Adam; see lightning_zero/memory.py)"
        )
        rank_zero_info("\n".join(lines))

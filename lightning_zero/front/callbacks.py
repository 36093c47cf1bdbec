"""ZeroMetrics: the training metrics of the ZeRO strategies, in the progress bar, the logger and a summary.

It is Lightning's ``ThroughputMonitor`` (tokens/s, samples/s, and MFU when the LightningModule sets
``flops_per_batch`` and the device's peak FLOP/s is known or given as ``peak_flops``) for batches
``(x, y)`` whose ``x`` is (batch, tokens), plus: each rank's bytes of parameters / gradients /
optimizer state against the ZeRO formula, peak memory (the CUDA allocator's, or the process's RSS on
the CPU), and at the end of ``fit`` a summary table. fp16's loss scale and skipped steps are logged by
the precision plugin.

StepProgressBar: Lightning's RichProgressBar, correct for runs bounded by ``max_steps`` (the main job).
"""

from __future__ import annotations

import resource
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar, ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only

from lightning_zero.front.strategy import ZeroStrategy
from lightning_zero.planning.memory import formula_bytes
from lightning_zero.sharding import collectives


def _samples(batch: Any) -> int:
    return batch[0].shape[0]


def _tokens(batch: Any) -> int:
    return batch[0].numel()


def peak_memory_bytes(device: torch.device) -> int:
    """The most bytes held so far: the CUDA allocator's peak on a CUDA ``device``, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepProgressBar(RichProgressBar):
    """RichProgressBar that shows the optimizer step against ``max_steps`` and no bogus epoch bound.

    With ``max_steps`` and no ``max_epochs`` Lightning sets ``max_epochs = -1`` (no bound), which
    RichProgressBar (Lightning 2.6) prints as "Epoch 4/-2". Here the epoch has no bound then, and the
    metrics start with ``step: 480/600`` whenever ``max_steps`` is set. The bar stops at the end of training,
    so that ``ZeroMetrics``' summary table is printed after its last frame.

    It takes ``RichProgressBar``'s arguments (``refresh_rate``, ``leave``, ``theme``, ``console_kwargs``).
    """

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's only hook for this text
        if self.trainer.max_epochs not in (None, -1):
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"  # padded as Lightning's

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning stops the bar at teardown, so its last frame would print after ZeroMetrics' summary
        # table (on_train_end, listed after this callback): stopped here, the table comes last.
        super().on_train_end(trainer, pl_module)
        self._stop_progress()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.max_steps > 0:
            return {"step": f"{trainer.global_step}/{trainer.max_steps}", **metrics}
        return metrics


class ZeroMetrics(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` for the ZeRO strategies, with memory and an end-of-fit summary.

    Batches are ``(x, y)`` whose ``x`` is (batch, tokens): samples and tokens are counted from ``x`` (each
    rank of a sequence-parallel group counts its share). After each optimizer step rank 0 shows
    ``tokens_per_sec``, ``mfu`` (when the peak FLOP/s is known) and ``peak_mem_GiB`` in the progress bar, and
    logs the peak memory. At the end of ``fit`` each rank's persistent bytes are gathered (under a
    ``ZeroStrategy``: every rank takes part) and rank 0's logged; rank 0 prints a table of every rank's bytes
    against the ZeRO formula, the throughput over the run, the first and last training loss (``train_loss``)
    and, with fp16, the loss scale and the steps skipped.

    Args:
        peak_flops: the device's peak FLOP/s for MFU, where Lightning does not know it (CPUs); given, it is
            used instead of Lightning's figure.
        window_size: the number of batches the throughput is averaged over (``ThroughputMonitor``'s).
    """

    def __init__(self, peak_flops: float | None = None, window_size: int = 50) -> None:
        super().__init__(batch_size_fn=self._samples, length_fn=self._tokens, window_size=window_size)
        self.share = 1  # the ranks sharing each sample (a sequence-parallel group): each counts its part
        self.peak_flops = peak_flops
        self.last: dict[str, float] = {}
        self.memory: list[dict[str, int]] = []
        self.first_loss: float | None = None

    def _samples(self, batch: Any) -> float:
        return _samples(batch) / self.share

    def _tokens(self, batch: Any) -> float:
        return _tokens(batch) / self.share

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        sequence = getattr(trainer.strategy, "sequence_parallel", None)
        self.share = sequence.size if sequence is not None else 1
        if self.peak_flops:
            self.available_flops = int(self.peak_flops)
            for throughput in self._throughputs.values():
                throughput.available_flops = self.available_flops

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.first_loss is None and isinstance(outputs, dict) and "loss" in outputs:
            self.first_loss = float(outputs["loss"])
        if trainer.fit_loop._should_accumulate():
            return
        metrics = self._throughputs[trainer.state.stage].compute()
        self.last.update({k: float(v) for k, v in metrics.items()})
        shown = {"tokens_per_sec": metrics.get("items_per_sec"), "mfu": metrics.get("device/mfu")}
        shown["peak_mem_GiB"] = peak_memory_bytes(trainer.strategy.root_device) / 2**30
        for name, value in shown.items():
            if value is not None:
                to_logger = trainer.logger is not None and name == "peak_mem_GiB"  # throughput is logged already
                pl_module.log(name, float(value), prog_bar=True, logger=to_logger, rank_zero_only=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, ZeroStrategy):  # every rank takes part in the gather
            self.memory = collectives.all_gather_object(trainer.strategy.memory_bytes())
        if not trainer.is_global_zero:
            return
        if self.memory and trainer.logger is not None:
            trainer.logger.log_metrics({f"memory/rank0_{k}_bytes": float(v) for k, v in self.memory[0].items()})
        self._summary(trainer, pl_module)

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from rich.console import Console
        from rich.table import Table

        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        psi = sum(p.numel() for p in trainable)
        strategy = trainer.strategy
        name = f"zero{strategy.config.stage}" if isinstance(strategy, ZeroStrategy) else type(strategy).__name__
        if isinstance(strategy, ZeroStrategy) and strategy.config.offload_optimizer != "none":
            name += "+offload_param" if strategy.config.offload_param != "none" else "+offload"
        host = any(v for mem in self.memory for k, v in mem.items() if k.startswith("host_"))
        title = f"{name}: {trainer.world_size} ranks, precision {trainer.precision}, {psi:,} trainable parameters"
        table = Table(title=title, title_justify="left")
        table.add_column("")
        columns = ["parameters MiB", "gradients MiB", "optimizer state MiB"] + (["host MiB"] if host else [])
        for column in [*columns, "peak memory MiB"]:
            table.add_column(column, justify="right")
        mib = 2**20
        for rank, mem in enumerate(self.memory):
            peak = f"{peak_memory_bytes(strategy.root_device) / mib:.1f}" if rank == 0 else ""
            cells = [mem["parameters"], mem["gradients"], mem["master"] + mem["optimizer_state"]]
            cells += [sum(v for k, v in mem.items() if k.startswith("host_"))] if host else []
            table.add_row(f"rank {rank}", *(f"{c / mib:.2f}" for c in cells), peak)
        if self.memory and name.startswith("zero"):
            f = formula_bytes(name, psi, strategy.topology.shard_size, trainable[0].element_size())
            cells = [f[k] for k in ("parameters", "gradients", "optimizer_state")]
            cells += [sum(v for k, v in f.items() if k.startswith("host_"))] if host else []
            table.add_row("formula", *(f"{c / mib:.2f}" for c in cells), "")
        console = Console()
        console.print(table)
        stage = pl.trainer.states.RunningStage.TRAINING
        seconds = self._throughputs[stage]._time[-1] if self._throughputs[stage]._time else 0.0
        if seconds:
            world = trainer.world_size  # (each rank counted its part of the samples: see share)
            mfu = f", MFU {100 * self.last['device/mfu']:.1f}% (last steps)" if "device/mfu" in self.last else ""
            console.print(
                f"throughput: {self._lengths[stage] * world / seconds:,.0f} tokens/s,"
                f" {self._samples[stage] * world / seconds:,.1f} samples/s over {seconds:.1f} s of training{mfu}"
            )
        last = trainer.callback_metrics.get("train_loss")
        if self.first_loss is not None and last is not None:
            floor = getattr(trainer.datamodule, "loss_floor", None)
            reachable = f" (lowest reachable: {floor:.3f})" if floor is not None else ""
            console.print(
                f"train loss: {self.first_loss:.3f} at the first step, {float(last):.3f} at the last{reachable}"
            )
        if trainer.precision == "16-mixed" and "loss_scale" in trainer.callback_metrics:
            console.print(
                f"fp16 loss scale {float(trainer.callback_metrics['loss_scale']):g},"
                f" {int(trainer.callback_metrics['skipped_steps'])} steps skipped"
            )

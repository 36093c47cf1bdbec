"""Trains on 2 ranks, saving after every step (the newest checkpoint, plus last.ckpt overwritten each
time), until killed or done: a target ``DIR sync|async PHASE@N:MARKER`` (with "async" the saves finish in the
background) stops the N-th save (or removal) in each rank that reaches PHASE there (save.py's [Note: observing a
save]), writing MARKER first, for test_checkpoint_kill.py to kill it.

With "nvme" (the optimizer state on NVMe) the spec is ``step@N:MARKER``: rank 0 writes MARKER and kills both ranks
halfway through optimizer step N.

``kill_target.py --serve`` imports all this once and then forks a target per request line on its stdin (a JSON
list of those three arguments), answering the target's pid: each in a session of its own, for the test to kill as a
group, and none paying the imports again (seconds each)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.launch_local import spawn_local_ranks

STEPS = 6
NVME_SHAPE = (1024, 8)  # (width, depth) with the optimizer state on NVMe: a step long enough to be killed halfway


class PauseAt:
    """An observer of saves (``ZeroStrategy(on_save_phase=...)``) that stops this process's ``nth`` arrival at
    ``phase`` for good, once it has written ``marker``; ``spec``: "<phase>@<nth>:<marker file>"."""

    def __init__(self, spec: str) -> None:
        where, _, self.marker = spec.partition(":")
        self.phase, _, nth = where.partition("@")
        self.nth, self.reached = int(nth or 1), 0

    def __call__(self, phase: str, path: Path) -> None:
        if phase != self.phase:
            return
        self.reached += 1
        if self.reached == self.nth:
            Path(self.marker).write_text(phase)
            while True:
                time.sleep(1)


class KillMidStep(pl.Callback):
    """Optimizer state on NVMe: rank 0 writes ``marker`` and kills its process group (both ranks) halfway through
    optimizer step ``step``, its chunks streaming, as timed by the step before; ``spec``: "step@<step>:<marker>"."""

    def __init__(self, spec: str) -> None:
        where, _, self.marker = spec.partition(":")
        self.step, self.started, self.took = int(where.partition("@")[2]), 0.0, 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.started = time.perf_counter()
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            threading.Timer(self.took / 2, self._kill).start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.took = time.perf_counter() - self.started

    def _kill(self) -> None:
        Path(self.marker).write_text("in the step")
        os.killpg(os.getpgid(0), signal.SIGKILL)


class Wide(pl.LightningModule):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.data = TensorDataset(torch.randn(64, width, generator=torch.Generator().manual_seed(0)))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)


def trainer(world: int, dirpath: str, steps: int, mode: str = "sync", pause: str | None = None) -> pl.Trainer:
    """``mode``: "sync", "async" (background saves) or "nvme" (the optimizer state on NVMe, under DIR/../nvme);
    ``pause``: a ``PauseAt`` spec, watching the saves (a ``KillMidStep`` one with "nvme")."""
    config = ZeroConfig(stage=2, timeout=60, async_save=mode == "async")
    watch = None
    if mode == "nvme":
        nvme = Path(dirpath).parent / "nvme"
        nvme.mkdir(exist_ok=True)
        config = ZeroConfig(
            stage=2, timeout=60, offload_optimizer="nvme", nvme_path=str(nvme), nvme_buffer_numel=1 << 18
        )
    elif pause:
        watch = PauseAt(pause)
    callbacks = [ModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)]
    return pl.Trainer(
        strategy=ZeroStrategy(config, on_save_phase=watch),
        callbacks=callbacks + ([KillMidStep(pause)] if mode == "nvme" and pause else []),
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def train(
    rank: int,
    world: int,
    dirpath: str,
    steps: int,
    ckpt: str | None,
    mode: str = "sync",
    pause: str | None = None,
) -> None:
    pl.seed_everything(0)
    t = trainer(world, dirpath, steps, mode, pause)
    t.fit(Wide(*NVME_SHAPE) if mode == "nvme" else Wide(), ckpt_path=ckpt)
    assert t.global_step == steps


def run(dirpath: str, mode: str, pause: str) -> None:
    spawn_local_ranks(train, 2, str(Path(dirpath)), STEPS, None, mode, pause, start_method="fork")


def serve() -> None:
    """Forks a target per request line (see the module's docstring); ended targets are reaped by the kernel."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (the target waits for its ranks)
            os.setsid()
            quiet = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(quiet, fd)
            try:
                run(*json.loads(line))
            finally:
                os._exit(0)
        print(pid, flush=True)


if __name__ == "__main__":
    serve()

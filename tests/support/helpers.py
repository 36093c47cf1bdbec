"""Shared test helpers: the models the equivalence tests train, trainers, checkpoints, launches.

Distributed tests run their workers on the shared rank processes (the ``ranks`` fixture, pool.py); a
Trainer built inside a worker joins that world, so one worker can run several ``fit`` calls (stages,
models) on one process group, whose timeout turns a hang into an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_zero
from lightning_zero.checkpoint.format import WRITTEN_DIGEST, check_files, file_digest, read_metadata
from lightning_zero.kernels.adamw import FusedAdamW
from lightning_zero.models.data import SyntheticLanguage
from lightning_zero.models.gpt import GPT, GPTConfig

SUPPORT = Path(__file__).resolve().parent  # the scripts launched tests start live here
REPO = SUPPORT.parents[1]
COLLECTIVE_TIMEOUT_S = 120
TASK_DEADLINE_S = 900  # a distributed test's whole run on the shared ranks (tests/support/pool.py)


# --- models ---------------------------------------------------------------------------------------
VOCAB, SEQ = 13, 6


class ToyNet(nn.Module):
    """Everything that breaks naive sharding in one small model.

    Tied weights (``emb`` is also the head), a frozen layer, parameter sizes that divide by no
    world size (7, 11, 77, ...), a branch unused on every third step (no rank uses it), a branch
    used only by rare samples (unused on some ranks, used on others), and a buffer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(7, 11)
        self.branch = nn.Linear(11, 11)
        self.rare = nn.Linear(11, 11)
        self.out = nn.Linear(11, 7)
        self.head = nn.Linear(7, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.emb(x).mean(1)))  # (B, 7)
        h = torch.tanh(self.body(h))  # (B, 11)
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        rare = x[:, 0] == 0  # about 1 sample in 13
        if rare.any():
            h = h.clone()
            h[rare] = h[rare] + torch.tanh(self.rare(h[rare]))
        return self.head(self.out(h)) / self.temperature  # (B, VOCAB)


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim), requires_grad=False)  # frozen, inside a unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x))) * self.scale


class BlocksNet(nn.Module):
    """What stage 3 must get right, over units = the blocks of a ModuleList (dim 9: odd sizes).

    The embedding is tied to the head; block 2's weight is tied to block 0's (so it belongs to no
    block: the root unit holds it); block 1 runs twice per forward; block 2 runs only on some steps;
    block 3's weight is also read directly by the root's forward, outside its module.
    """

    def __init__(self, dim: int = 9) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(4))
        self.blocks[2].lin.weight = self.blocks[0].lin.weight
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.emb(x).mean(1)  # (B, dim)
        h = self.blocks[0](h)
        h = self.blocks[1](self.blocks[1](h))
        if step % 3 != 0:
            h = self.blocks[2](h)
        h = h + 0.1 * F.linear(h, self.blocks[3].lin.weight)
        return self.head(self.blocks[3](h))  # (B, VOCAB)


class EquivalenceModule(pl.LightningModule):
    """Trains ``kind`` ("gpt" or "toy") on fixed data that each rank splits explicitly.

    Lightning's own distributed sampler shuffles, so the split is built here: rank r of W gets
    samples r, r + W, ... and a per-rank batch of global_batch / W, which together are exactly the
    single-process batch. ``grad_norms`` records the global gradient norm before each step.
    """

    def __init__(
        self,
        kind: str,
        global_batch: int = 8,
        steps: int = 20,
        accumulate: int = 2,
        lr: float = 1e-3,
        optimizer: str = "adamw",
        lazy: bool = False,
        n_layer: int = 2,
        dropout: float = 0.0,
    ):
        """``lazy``: the GPT is built in ``configure_model`` (so ZeRO-3 builds it on the meta device)."""
        super().__init__()
        self.kind, self.global_batch, self.lr, self.optimizer = kind, global_batch, lr, optimizer
        n = steps * accumulate * global_batch
        g = torch.Generator().manual_seed(7)
        if kind == "gpt":
            # No biases: the attention key bias has a zero true gradient, so Adam turns rounding noise
            # into full-size updates and even DDP drifts from a single process there (~1e-4).
            self.gpt_config = GPTConfig(
                vocab_size=32, block_size=16, n_layer=n_layer, n_head=2, n_embd=32, bias=False, dropout=dropout
            )
            self.net = None if lazy else GPT(self.gpt_config)
            tokens = SyntheticLanguage(32, seed=3).sample(n * 17, seed=4)[0].view(n, 17)
            self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        else:
            self.net = ToyNet() if kind == "toy" else BlocksNet()
            self.data = TensorDataset(
                torch.randint(VOCAB, (n, SEQ), generator=g), torch.randint(VOCAB, (n,), generator=g)
            )
        self.grad_norms: list[float] = []
        self.grad_max: list[float] = []  # largest |gradient| this rank sees before each step
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.kind == "gpt":
            logits = self.net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        elif self.kind == "toy":
            loss = F.cross_entropy(self.net(x, use_branch=self.global_step % 3 != 0), y)
        else:
            loss = F.cross_entropy(self.net(x, step=self.global_step), y)
        self.losses.append(loss.item())
        return loss

    def forward(self, x):
        return self.net(x)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_model(self):
        if self.net is None:
            self.net = GPT(self.gpt_config)

    def init_module(self, module, generator):
        self.net.init_module(module, generator)

    def on_before_optimizer_step(self, optimizer):
        if hasattr(optimizer, "grad_norm"):
            norm = optimizer.grad_norm()
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
        self.grad_norms.append(float(norm))
        pieces = (
            optimizer.pieces()
            if hasattr(optimizer, "pieces")
            else [p for g in optimizer.param_groups for p in g["params"]]
        )
        grads = [p.grad for p in pieces if p.grad is not None]
        self.grad_max.append(max((float(g.abs().max()) for g in grads), default=0.0))

    def configure_optimizers(self):
        """Two param groups with their own lr and weight decay, and a per-step LR schedule."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": self.lr / 2},
        ]
        if self.optimizer == "sgd":
            optimizer = torch.optim.SGD(groups, lr=self.lr * 30, momentum=0.9)
        elif self.optimizer == "fusedadamw":
            optimizer = FusedAdamW(groups, lr=self.lr)
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.data, batch_size=self.global_batch // world, sampler=sampler)


class TrafficPerStep(pl.Callback):
    """Elements each collective covered during the last optimizer step (all its micro-batches)."""

    def __init__(self) -> None:
        self.per_step: list[Counter[str]] = []  # a kind that sent nothing reads 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._before = trainer.strategy.traffic.copy()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.per_step.append(trainer.strategy.traffic.since(self._before).elements)


def make_trainer(
    strategy, devices: int, *, steps: int = 20, accumulate: int = 2, clip: float = 0.05, callbacks=(), **kwargs
):
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **{"enable_checkpointing": False, "logger": False, **kwargs},
    )


def zero_strategy(stage: int, **config) -> lightning_zero.ZeroStrategy:
    config.setdefault("timeout", COLLECTIVE_TIMEOUT_S)
    return lightning_zero.ZeroStrategy(lightning_zero.ZeroConfig(stage=stage, **config))


# --- the CLI, in this process ----------------------------------------------------------------------
def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``lightning-zero ARGS`` through ``cli.main`` in this process: (exit code, stdout, stderr). The console
    script itself runs in tests/e2e."""
    from lightning_zero.cli.main import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


# --- the Hydra example, without its command line ----------------------------------------------------------
def hydra_app_config(*overrides: str):
    """examples/hydra_app.py's composed config for ``overrides``, and the app's function (undecorated): what
    ``python examples/hydra_app.py OVERRIDES`` runs, minus Hydra's command line and run directory."""
    import importlib.util

    import hydra

    spec = importlib.util.spec_from_file_location("hydra_app", REPO / "examples" / "hydra_app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    with hydra.initialize_config_dir(config_dir=str(REPO / "configs" / "hydra"), version_base=None):
        config = hydra.compose("config", overrides=list(overrides))
    return config, app.main.__wrapped__


# --- DeepSpeed checkpoints (tests/fixtures/deepspeed/make_fixtures.py wrote them with DeepSpeed) ------------
DEEPSPEED_FIXTURES = REPO / "tests" / "fixtures" / "deepspeed"


def deepspeed_expected(name: str) -> dict:
    """What converting the fixture ``name`` must give (saved next to it when it was made)."""
    return torch.load(DEEPSPEED_FIXTURES / f"{name}-expected.pt", weights_only=True)


# --- in this process ----------------------------------------------------------------------------------
@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone, destroyed after: what a Trainer on one device joins, so a
    test can train in the pytest process itself. Nothing is left behind: neither the group nor what Lightning
    sets for one (LOCAL_RANK, MASTER_PORT, OMP_NUM_THREADS and the thread count, the seed's variables), which
    a command launched later would inherit (a LOCAL_RANK makes Lightning wait for ranks it never starts)."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)


@contextlib.contextmanager
def file_size_limit(limit: int):
    """A full disk on this rank: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def save_stage2_checkpoint(root: Path) -> Path:
    """A real stage-2 checkpoint of BlocksNet after one step, saved by ModelCheckpoint into ``root``."""
    callbacks = [ModelCheckpoint(root, every_n_train_steps=1)]
    trainer = make_trainer(zero_strategy(2), 1, steps=1, accumulate=1, callbacks=callbacks, enable_checkpointing=True)
    with world_of_one():
        pl.seed_everything(0)
        trainer.fit(EquivalenceModule("blocks", steps=1, accumulate=1))
    (ckpt,) = root.iterdir()
    return ckpt


def snapshot_files(root: Path) -> dict[str, str | None]:
    """Every path under ``root`` with its content's hash (None for directories)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


# --- checkpoints ---------------------------------------------------------------------------------
def verify_checkpoint(ckpt: Path) -> int:
    """Checks every file of a sharded checkpoint (complete, sizes, checksums); returns its global step."""
    meta = read_metadata(ckpt)  # raises unless complete
    check_files(ckpt, meta, checksum=True)
    return meta.global_step


class Poison:
    """Unpickling it runs ``open(marker, "w")``: what a malicious checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def poison_checkpoint(ckpt: Path, marker: Path) -> None:
    """Puts a Poison into a checkpoint's lightning.pt and updates its size and hash in the metadata, so
    only safe unpickling can stop it."""
    state = torch.load(ckpt / "lightning.pt", weights_only=True)
    torch.save({**state, "poison": Poison(marker)}, ckpt / "lightning.pt")
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["files"]["lightning.pt"] = {
        "bytes": (ckpt / "lightning.pt").stat().st_size,
        WRITTEN_DIGEST: file_digest(ckpt / "lightning.pt"),
    }
    (ckpt / "metadata.json").write_text(json.dumps(meta))


# Tensor methods that read a tensor's value on the host (on a GPU each waits for the device)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

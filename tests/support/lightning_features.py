"""What the Lightning-feature tests share: a small LightningModule with a backbone and a head on data each
rank splits explicitly, a logger that keeps what it is given, and the Trainer and comparisons they use
(tests/dist/test_lightning_features.py, test_lightning_model_features.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.support.helpers import zero_strategy

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
GLOBAL_BATCH = 8
SAMPLES = 64  # 8 global batches an epoch


class Recorder(Logger):
    """A logger that keeps what it is given (LearningRateMonitor needs one)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, {k: float(v) for k, v in metrics.items()}))


class Features(pl.LightningModule):
    """A backbone and a head on fixed data that each rank splits explicitly (rank r of W takes samples r,
    r + W, ...: together exactly one process's global batch)."""

    def __init__(self, lr: float = 3e-3, batch_size: int = GLOBAL_BATCH, manual: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.batch_size = lr, batch_size
        self.automatic_optimization = not manual
        self.backbone = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, 3)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(SAMPLES, 12, generator=g)
        self.data = TensorDataset(x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long())
        self.losses: list[float] = []

    def forward(self, x):
        return self.head(self.backbone(x))

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        # Manual: the backbone and the head have their own optimizer, each stepped on its own loss.
        backbone_opt, head_opt = self.optimizers()
        backbone_sched, head_sched = self.lr_schedulers()
        for opt, sched, scale in ((backbone_opt, backbone_sched, 1.0), (head_opt, head_sched, 0.5)):
            self.toggle_optimizer(opt)
            self.manual_backward(scale * self._loss(batch))
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched.step()
            self.untoggle_optimizer(opt)
        return None

    def on_before_optimizer_step(self, optimizer):
        if self.automatic_optimization:  # the user's own "grad_norm", the head's (the strategy's: "zero/grad_norm")
            self.log("grad_norm", grad_norm(self.head, 2)["grad_2.0_norm_total"])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if not self.automatic_optimization:
            backbone = torch.optim.AdamW(self.backbone.parameters(), lr=self.lr)
            head = torch.optim.SGD(self.head.parameters(), lr=self.lr * 10, momentum=0.9)
            total = self.trainer.estimated_stepping_batches
            return [backbone, head], [
                torch.optim.lr_scheduler.OneCycleLR(backbone, max_lr=self.lr * 3, total_steps=total),
                torch.optim.lr_scheduler.StepLR(head, step_size=3, gamma=0.5),
            ]
        # BackboneFinetuning freezes the backbone before this runs: only what trains now is given.
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _loader(self, data):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(data, batch_size=max(1, self.batch_size // world), sampler=sampler)

    def train_dataloader(self):
        return self._loader(self.data)

    def val_dataloader(self):
        return self._loader(TensorDataset(*(t[:32] for t in self.data.tensors)))

    test_dataloader = val_dataloader

    def predict_dataloader(self):
        return self._loader(TensorDataset(self.data.tensors[0][:16]))


def strategy_for(name):
    if not isinstance(name, str) or name in ("ddp", "auto", "ddp_find_unused_parameters_true"):
        return name
    return zero_strategy(int(name[-1]), param_persistence_threshold=0, reduce_bucket_size=100)


def feature_trainer(name: str, world: int, root, **kwargs) -> pl.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        strategy=strategy_for(name),
        accelerator="cpu",
        devices=world,
        default_root_dir=root,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )

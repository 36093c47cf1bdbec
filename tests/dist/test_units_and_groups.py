"""Models that are not a ModuleList of blocks, and optimizers that change: stage 3's units by size (an
``nn.Sequential``), a warning when the root unit holds most of the model, two optimizers under manual
optimization (a GAN), and parameters unfrozen during training by Lightning's ``BackboneFinetuning``
(``ZeroOptimizer.add_param_group``). Each equals a single-process run at stages 1-3."""

from __future__ import annotations

import functools
import warnings

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.support.compare import relative_error
from tests.support.helpers import make_trainer, zero_strategy

STEPS, DIM = 4, 24


def _data(n: int = 64):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(4, (n,), generator=g))


class Base(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.data = _data()

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(self.data, batch_size=8 // world, sampler=DistributedSampler(self.data, world, rank, False))


class Sequential(Base):
    """No ModuleList: with a small ``unit_min_params`` every large layer becomes a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class GAN(Base):
    """Generator and discriminator with an optimizer each, stepped by hand (manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, DIM))
        self.discriminator = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        real = batch[0]
        noise = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + batch_idx))  # the global batch's
        z = noise[self.global_rank :: self.trainer.world_size]  # this rank's rows, as the sampler splits data
        fake = self.generator(z)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        loss_d = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        loss_d = loss_d + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.SGD(self.discriminator.parameters(), lr=1e-1),
        ]


class Finetuned(Base):
    """A backbone of blocks, frozen for the first epoch and then unfrozen by ``BackboneFinetuning``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM)) for _ in range(2))
        self.head = nn.Linear(DIM, 4)

    def training_step(self, batch, batch_idx):
        h = batch[0]
        for block in self.backbone:
            h = h + torch.tanh(block(h))
        return F.cross_entropy(self.head(h), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(kind: str, strategy, world: int):
    pl.seed_everything(0)
    module = {"sequential": Sequential, "gan": GAN, "finetune": Finetuned}[kind]()
    kwargs = {"max_epochs": 2, "steps": -1, "accumulate": 1, "clip": None} if kind == "finetune" else {}
    if kind == "gan":
        kwargs = {"accumulate": 1, "clip": None}
    callbacks = (
        [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)] if kind == "finetune" else []
    )
    trainer = make_trainer(strategy, world, callbacks=callbacks, **{"steps": STEPS, **kwargs})
    trainer.fit(module)
    return trainer, module


def _worker(rank: int, world: int, out_dir) -> None:
    for kind in ("sequential", "gan", "finetune"):
        for stage in (1, 2, 3):
            config = {"param_persistence_threshold": 0, "unit_min_params": 200} if stage == 3 else {}
            trainer, module = _fit(kind, zero_strategy(stage, **config), world)
            if kind == "sequential" and stage == 3:
                assert len(trainer.strategy.engine.stage3.scheduled) == 3  # the three Linear layers
                assert not trainer.strategy.engine.stage3.root
            torch.save(trainer.strategy.gather_module().state_dict(), out_dir / f"{kind}-{stage}-{rank}.pt")


@functools.cache
def _reference(kind: str):
    _, module = _fit(kind, "auto", 1)
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_sequential_gan_and_unfrozen_backbone_match_single_process(ranks, tmp_path):
    ranks(_worker, 2, tmp_path)
    for kind in ("sequential", "gan", "finetune"):
        reference = _reference(kind)
        for stage in (1, 2, 3):
            states = [torch.load(tmp_path / f"{kind}-{stage}-{r}.pt") for r in range(2)]
            for key, ref in reference.items():
                assert torch.equal(states[0][key], states[1][key]), (kind, stage, key)
                err = relative_error(states[0][key], ref)
                assert err <= 1e-5, f"{kind} stage {stage}: {key} differs from one process by {err:.2e}"
        if kind == "finetune":  # the backbone did train, from the second epoch on
            pl.seed_everything(0)
            assert relative_error(reference["backbone.0.1.weight"], Finetuned().backbone[0][1].weight) > 1e-3


class BigRoot(Sequential):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(200, 64))  # a parameter of no module below the root


def _warn_worker(rank: int, world: int) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(zero_strategy(3, unit_min_params=5000), world, steps=1).fit(BigRoot())
    if rank == 0:
        assert any("root unit" in str(w.message) and "12,800" in str(w.message) for w in caught), caught


def test_a_root_unit_holding_most_of_the_model_is_warned_about(ranks):
    ranks(_warn_worker, 2)

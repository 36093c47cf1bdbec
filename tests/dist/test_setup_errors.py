"""Mistakes in how a LightningModule hands parameters to its optimizers fail clearly on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy


class Orphan(EquivalenceModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.body.parameters(), lr=1e-3)


class RankDependentOrder(EquivalenceModule):
    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.trainer.global_rank == 1:
            params = params[::-1]
        return torch.optim.AdamW(params, lr=1e-3)


def _worker(rank: int, world: int) -> None:
    with pytest.raises(
        ValueError, match=r"parameters \['emb.weight'|parameters \['net.emb.weight'.*in no optimizer param group"
    ):
        make_trainer(zero_strategy(2), world, steps=1).fit(Orphan("toy", steps=1))
    with pytest.raises(RuntimeError, match="rank .* see different optimizer parameters"):
        make_trainer(zero_strategy(1), world, steps=1).fit(RankDependentOrder("toy", steps=1))


def test_parameter_mistakes_raise_on_every_rank(ranks):
    ranks(_worker, 2)

"""validate / test / predict under stage 3 with ranks holding different numbers of batches: every rank
completes, each sample's result equals one process's, and the ranks issue the same collectives.

Lightning's predict sampler does not pad (5 samples on 2 ranks: 3 and 2 batches); its validation and
test sampler pads (3 and 3); with ``use_distributed_sampler=False`` and an explicit split, validation
and test are uneven too. The model routes samples to experts that are units of their own, so ranks
also run different units within a step. ``gathered_parameters`` in such steps (stages 2 and 3) issues what
a rank out of batches issues too.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import lightning_zero
from lightning_zero.sharding import collectives
from tests.support.dynamic_models import DynamicModule, Indexed
from tests.support.helpers import zero_strategy

N = 5


def _trainer(world: int, config: dict, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=zero_strategy(3, **config),
        accelerator="cpu",
        devices=world,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def _worker(rank: int, world: int, out_dir) -> None:
    for name, config in (("default", {}), ("tight", {"param_persistence_threshold": 0, "max_live_parameters": 700})):
        pl.seed_everything(0)
        module = DynamicModule("experts")
        data = Indexed(module.data, N)
        results = {}
        with collectives.record() as log:
            predictions = _trainer(world, config).predict(module, DataLoader(data, batch_size=1))
            results["predict"] = [(int(i), out) for index, logits in predictions for i, out in zip(index, logits)]
            for phase, batch in (("validate", 1), ("test", 2)):
                module.evaluated = []
                getattr(_trainer(world, config), phase)(module, DataLoader(data, batch_size=batch), verbose=False)
                results[phase] = module.evaluated
                module.evaluated = []
                mine = Subset(data, range(rank, N, world))  # uneven: no padding
                trainer = _trainer(world, config, use_distributed_sampler=False)
                getattr(trainer, phase)(module, DataLoader(mine, batch_size=1), verbose=False)
                results[f"{phase}-uneven"] = module.evaluated
        problem = collectives.first_divergence(collectives.all_gather_object(log))
        assert problem is None, f"{name}: {problem}"
        torch.save(results, out_dir / f"{name}-{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_predict_validate_test_complete_with_single_process_results(ranks, world, tmp_path):
    ranks(_worker, world, tmp_path, timeout_s=60, deadline_s=600)
    pl.seed_everything(0)
    module = DynamicModule("experts")
    x, y = module.data[:N]
    with torch.no_grad():
        logits = module.net(x)
        losses = F.cross_entropy(logits, y, reduction="none")
    for name in ("default", "tight"):
        per_rank = [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(world)]
        batches = [len(r["predict"]) for r in per_rank]
        assert len(set(batches)) > 1, f"predict must be uneven for the test to mean anything: {batches}"
        predicted = [p for r in per_rank for p in r["predict"]]
        assert sorted(i for i, _ in predicted) == list(range(N))  # every sample exactly once
        for i, out in predicted:
            assert torch.allclose(out, logits[i], atol=1e-6), (name, i)
        for phase in ("validate", "test", "validate-uneven", "test-uneven"):
            seen = [s for r in per_rank for s in r[phase]]
            assert {i for i, _ in seen} == set(range(N)), (name, phase)
            if phase.endswith("uneven"):
                assert len(seen) == N and len({len(r[phase]) for r in per_rank}) > 1
            for i, loss in seen:
                assert abs(loss - float(losses[i])) <= 1e-6 * max(1.0, abs(float(losses[i]))), (name, phase, i)


class ReadsInPredict(DynamicModule):
    """Reads its weights inside ``gathered_parameters`` in each predict step, as code written for stage 3 does."""

    def predict_step(self, batch, batch_idx):
        with lightning_zero.gathered_parameters(self, self.net.head) as (weight, bias):
            self.head_sum = float(weight.sum() + bias.sum())
        return super().predict_step(batch, batch_idx)


def _reads_worker(rank: int, world: int) -> dict:
    """Stage 2 (built outside fit: the engine holds no module) and stage 3, predict with 3 and 2 batches."""
    results = {}
    for stage in (2, 3):
        pl.seed_everything(0)
        module = ReadsInPredict("experts")
        trainer = pl.Trainer(
            strategy=zero_strategy(stage, param_persistence_threshold=0),
            accelerator="cpu",
            devices=world,
            logger=False,
            enable_progress_bar=False,
        )
        predictions = trainer.predict(module, DataLoader(Indexed(module.data, N), batch_size=1))
        results[stage] = ([int(i) for index, _ in predictions for i in index], module.head_sum)
    return results


def test_gathered_parameters_in_uneven_predict_steps(ranks):
    results = ranks(_reads_worker, 2, timeout_s=60)
    pl.seed_everything(0)
    head = ReadsInPredict("experts").net.head
    for stage in (2, 3):
        assert sorted(i for r in results for i in r[stage][0]) == list(range(N)), stage
        assert all(abs(r[stage][1] - float(head.weight.sum() + head.bias.sum())) < 1e-5 for r in results), stage

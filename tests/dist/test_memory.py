"""Per-rank bytes equal the ZeRO formulas (byte counts, not timings) in fp32 and fp16, and per-step
communication equals the paper's 2 Psi: one reduce-scatter and one all-gather over the (padded)
parameters."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest

from lightning_zero import ZeroPrecision
from lightning_zero.planning.memory import formula_bytes
from lightning_zero.sharding import collectives
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer
from tests.support.helpers import EquivalenceModule, TrafficPerStep, make_trainer, zero_strategy

ACCUMULATE = 2


def _worker(rank: int, world: int) -> None:
    for precision, stage in itertools.product(("32-true", "16-mixed"), (1, 2)):
        pl.seed_everything(0)
        module = EquivalenceModule("toy", steps=3)
        traffic = TrafficPerStep()
        trainer = make_trainer(
            zero_strategy(stage, reduce_bucket_size=40),
            world,
            steps=3,
            accumulate=ACCUMULATE,
            callbacks=[traffic],
            plugins=[ZeroPrecision(precision)],
        )
        trainer.fit(module)

        (optimizer,) = trainer.strategy.optimizers
        assert isinstance(optimizer, ZeroOptimizer)
        trainable = [p for p in module.parameters() if p.requires_grad]
        b = 2 if precision == "16-mixed" else 4
        assert all(p.element_size() == b for p in module.parameters())
        psi = sum(p.numel() for p in trainable)
        frozen = sum(p.nbytes for p in module.parameters() if not p.requires_grad)
        padded = sum(u.layout.total_numel for u in optimizer.units)
        buckets = sum(len(u.layout.buckets) for u in optimizer.units)
        assert psi <= padded < psi + 2 * world * buckets

        mem = trainer.strategy.memory_bytes()
        assert mem["parameters"] == b * padded + frozen
        assert mem["master"] == (4 * padded // world if b == 2 else 0)  # fp32: stepped in place, no second copy
        if b == 4:  # what the optimizer steps is this rank's part of the flat parameter buffer itself
            for unit in optimizer.units:
                flat = unit.flat_param.untyped_storage().data_ptr()
                assert all(t.untyped_storage().data_ptr() == flat for t in unit.training.piece_tensors)
        assert mem["gradients"] == (b * padded if stage == 1 else b * padded // world)
        # Adam's moments: 8 bytes per element this rank owns; over all ranks exactly 8 Psi.
        moments = sum(
            v.nbytes for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
        )
        all_moments = collectives.all_gather_object(moments)
        assert sum(all_moments) == 8 * psi
        # Each rank owns padded / world slots, of which at most the padding is empty.
        assert all(8 * (padded // world - (padded - psi)) <= m <= 8 * padded // world for m in all_moments)
        # The whole per-rank footprint against the stage's formula, up to padding.
        formula = sum(formula_bytes(f"zero{stage}", psi, world, param_bytes=b).values())
        footprint = mem["parameters"] - frozen + mem["gradients"] + mem["master"] + moments
        assert abs(footprint - formula) <= 20 * (padded - psi), (precision, stage, footprint, formula)
        # Communication: stage 2 reduce-scatters every micro-batch, stage 1 once per step.
        n_params = sum(len(u.params) for u in optimizer.units)
        for step in traffic.per_step:
            assert step["reduce_scatter"] == padded * (ACCUMULATE if stage == 2 else 1)
            assert step["all_gather"] == padded
            # used-flags (+ the overflow flag in fp16), the clip norm, the test's norm read
            assert step["all_reduce"] <= n_params + 3


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_and_traffic_match_formulas(ranks, world):
    ranks(_worker, world)

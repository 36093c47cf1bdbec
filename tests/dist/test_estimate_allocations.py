"""`lightning-zero estimate`'s numbers are the bytes the strategies allocate, rank by rank, for the same model
and world size (the estimate's other checks: tests/unit/test_estimate.py)."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
from lightning.pytorch.core.optimizer import _configure_optimizers

from lightning_zero import ZeroPrecision
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.estimate import estimate, shape_of_module
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

OFFLOAD = {
    "zero1+offload": {},
    "zero2+offload": {},
    "zero3+offload": {},
    "zero3+offload_param": {"offload_param": "cpu"},
}
NVME = {"nvme_buffer_numel": 1024, "nvme_buffer_count": 3}  # (small chunks: several per unit)


def _worker(rank: int, world: int, tmp_path) -> None:
    runs = [(f"zero{stage}", precision) for stage, precision in itertools.product((1, 2, 3), ("32-true", "16-mixed"))]
    runs += [(name, precision) for name in OFFLOAD for precision in ("32-true", "16-mixed")]
    if world == 2:  # (the swap files' sizes are the partitions': world 3 adds nothing to what 2 checks)
        runs += [(name, "32-true") for name in ("zero1+nvme", "zero2+nvme", "zero3+nvme", "zero3+nvme_param")]
        runs += [("zero3+nvme_param", "16-mixed")]
    for name, precision in runs:
        stage = int(name[4])
        config = {"reduce_bucket_size": 3000, "param_persistence_threshold": 0}
        if name in OFFLOAD:
            config.update(offload_optimizer="cpu", **OFFLOAD[name])
        if "+nvme" in name:
            config.update(offload_optimizer="nvme", nvme_path=str(tmp_path), **NVME)
            config.update(offload_param="nvme" if name.endswith("nvme_param") else "none")
        pl.seed_everything(0)
        module = EquivalenceModule("gpt", steps=1, lazy=True)
        trainer = make_trainer(zero_strategy(stage, **config), world, steps=1, plugins=[ZeroPrecision(precision)])
        trainer.fit(module)
        measured = trainer.strategy.memory_bytes()

        fresh = EquivalenceModule("gpt", lazy=True)
        fresh.configure_model()
        optimizers, _, _ = _configure_optimizers(fresh.configure_optimizers())
        groups = [g["params"] for g in optimizers[0].param_groups]
        shape = shape_of_module(fresh, groups, ZeroConfig(stage=stage, **config))
        row = estimate(shape, world, precision, ZeroConfig(stage=stage, **config), offload="nvme")[name][rank]
        what = (name, precision, row, measured)
        assert row.parameters == measured["parameters"], what
        assert row.gradients == measured["gradients"], what
        assert row.optimizer_state == measured["master"] + measured["optimizer_state"], what
        assert row.host_parameters == measured["host_parameters"], what
        assert row.host_gradients == measured["host_gradients"], what
        assert row.host_optimizer_state == measured["host_master"] + measured["host_optimizer_state"], what
        assert row.nvme == measured["nvme"], what


@pytest.mark.parametrize("world", [2, 3])
def test_estimate_equals_what_the_strategy_allocates(ranks, world, tmp_path):
    ranks(_worker, world, tmp_path)

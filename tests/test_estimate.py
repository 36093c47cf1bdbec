"""`lightning-zero estimate`'s numbers are the bytes the strategies allocate, rank by rank, for the same model
and world size; a model given by its config is built on the meta device."""

from __future__ import annotations

import itertools
import subprocess
import sys

import lightning.pytorch as pl
import pytest
from helpers import EquivalenceModule, make_trainer, spawn_ranks, zero_strategy
from lightning.pytorch.core.optimizer import _configure_optimizers

from lightning_zero import ZeroPrecision
from lightning_zero.config import ZeroConfig
from lightning_zero.estimate import OFFLOADED, STRATEGIES, ModelShape, estimate, shape_of_count, shape_of_module
from lightning_zero.estimate_model import shape_of_config
from lightning_zero.memory import formula_bytes

OFFLOAD = {
    "zero1+offload": {},
    "zero2+offload": {},
    "zero3+offload": {},
    "zero3+offload_param": {"offload_param": "cpu"},
}


def _worker(rank: int, world: int) -> None:
    runs = [(f"zero{stage}", precision) for stage, precision in itertools.product((1, 2, 3), ("32-true", "16-mixed"))]
    runs += [(name, precision) for name in OFFLOAD for precision in ("32-true", "16-mixed")]
    for name, precision in runs:
        stage = int(name[4])
        config = {"reduce_bucket_size": 3000, "param_persistence_threshold": 0}
        if name in OFFLOAD:
            config.update(offload_optimizer="cpu", **OFFLOAD[name])
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
        row = estimate(shape, world, precision, ZeroConfig(stage=stage, **config), offload=True)[name][rank]
        what = (name, precision, row, measured)
        assert row.parameters == measured["parameters"], what
        assert row.gradients == measured["gradients"], what
        assert row.optimizer_state == measured["master"] + measured["optimizer_state"], what
        assert row.host_parameters == measured["host_parameters"], what
        assert row.host_gradients == measured["host_gradients"], what
        assert row.host_optimizer_state == measured["host_master"] + measured["host_optimizer_state"], what


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_estimate_equals_what_the_strategy_allocates(world):
    spawn_ranks(_worker, world)


def test_count_only_estimate_follows_the_formulas():
    psi, n = 10_000_003, 8
    table = estimate(shape_of_count(psi), n, "16-mixed", ZeroConfig())
    padded = psi + (-psi % (2 * n))
    assert table["zero2"][0].parameters == 2 * padded and table["zero2"][0].gradients == 2 * padded // n
    assert table["zero3"][0].total == pytest.approx(16 * psi / n, rel=1e-5)  # plus padding and a step counter
    assert table["ddp"][0].total == pytest.approx(16 * psi, rel=1e-5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("strategy", STRATEGIES + OFFLOADED)
def test_estimate_equals_the_formulas(strategy, precision):
    """`lightning-zero estimate`, `memory.formula_bytes` and the README's tables (which they are) agree: with
    no padding (Psi a multiple of 2N, one bucket) they differ only by Adam's step counter, 4 bytes per tensor."""
    psi, n = 1_000_000, 8
    rows = estimate(shape_of_count(psi), n, precision, ZeroConfig(), offload=True)[strategy]
    formula = formula_bytes(strategy, psi, n, param_bytes=2 if precision == "16-mixed" else 4)
    step = 4 if strategy in STRATEGIES else 0
    for row in rows:
        assert (row.parameters, row.gradients) == (formula["parameters"], formula["gradients"])
        assert row.optimizer_state == formula["optimizer_state"] + step
        if strategy in OFFLOADED:
            assert (row.host_parameters, row.host_gradients) == (formula["host_parameters"], formula["host_gradients"])
            assert row.host_optimizer_state == formula["host_optimizer_state"] + 4


def test_ddp_keeps_fp32_weights_under_16_mixed():
    """Lightning's ddp runs 16-mixed as autocast: frozen weights stay fp32 too, unlike ZeroPrecision's."""
    table = estimate(ModelShape([[1000]], [[1000]], 24), 2, "16-mixed", ZeroConfig())
    assert table["ddp"][0].parameters == 4 * 1024 and table["zero2"][0].parameters == 2 * 1024


def test_model_from_a_config_is_built_on_the_meta_device():
    shape, config = shape_of_config("configs/gpt.yaml")
    assert shape.psi == 805_632 and config.stage == 2 and config.reduce_bucket_size == 200_000
    assert [len(u) for u in shape.units] == [12] * 4 + [4]  # four blocks and the root (embeddings, final norm)
    out = subprocess.run(
        [sys.executable, "-m", "lightning_zero.cli", "estimate", "--model", "configs/gpt.yaml", "--devices", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "805,632 trainable parameters on 4 ranks" in out.stdout


def test_the_zero_paper_memory_figures():
    """ZeRO (Rajbhandari et al., 2020), Figure 1: a 7.5B-parameter model on 64 devices, Adam in mixed precision
    (K = 12 bytes of optimizer state per parameter): 120 GB per device for data parallelism, 31.4 GB with the
    optimizer state sharded (P_os), 16.6 GB with the gradients too (P_os+g), 1.9 GB with the parameters too."""
    table = estimate(shape_of_count(7_500_000_000), 64, "16-mixed", ZeroConfig())
    per_device_gb = {name: round(max(row.total for row in rows) / 1e9, 1) for name, rows in table.items()}
    assert per_device_gb == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}, per_device_gb

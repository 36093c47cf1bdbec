"""Registration, the typed config, and clear errors for bad values before any process starts."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf

import lightning_zero
from lightning_zero import LossScaleConfig, ZeroConfig, ZeroPrecision, ZeroStrategy

ROOT = Path(__file__).resolve().parents[2]


def test_import_registers_zero1_zero2_zero3():
    assert {"zero1", "zero2", "zero3"} <= set(StrategyRegistry)
    for stage in (1, 2, 3):
        trainer = pl.Trainer(strategy=f"zero{stage}", accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, ZeroStrategy)
        assert trainer.strategy.config.stage == stage


def test_strategy_takes_a_config_object():
    config = ZeroConfig(stage=1, reduce_bucket_size=1000, overlap_comm=False, timeout=30)
    strategy = ZeroStrategy(config)
    assert strategy.config is config
    assert strategy._timeout.total_seconds() == 30
    assert ZeroStrategy(config, stage=2).config.stage == 2


def test_config_is_an_omegaconf_structured_config():
    merged = OmegaConf.merge(OmegaConf.structured(ZeroConfig), {"stage": 1, "reduce_bucket_size": 123})
    config = OmegaConf.to_object(merged)
    assert isinstance(config, ZeroConfig) and config.stage == 1 and config.reduce_bucket_size == 123


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"stage": 4}, "zero.stage must be one of 1, 2, 3, got 4"),
        ({"stage": 0}, "zero.stage must be one of 1, 2, 3, got 0"),
        ({"stage": True}, "zero.stage must be one of 1, 2, 3, got True"),
        ({"reduce_bucket_size": -1}, "zero.reduce_bucket_size must be an integer > 0 (elements), got -1"),
        ({"reduce_bucket_size": 0}, "zero.reduce_bucket_size must be an integer > 0 (elements), got 0"),
        ({"reduce_bucket_size": 2.5}, "zero.reduce_bucket_size must be an integer > 0 (elements), got 2.5"),
        ({"overlap_comm": "yes"}, "zero.overlap_comm must be true or false, got 'yes'"),
        ({"checkpoint_on_signal": "no"}, "zero.checkpoint_on_signal must be true or false, got 'no'"),
        ({"timeout": 0}, "zero.timeout must be a number of seconds > 0, got 0"),
        ({"timeout": -5.0}, "zero.timeout must be a number of seconds > 0, got -5.0"),
        (
            {"unit_module_classes": "Block"},
            "zero.unit_module_classes must be a list of module class names, got 'Block'",
        ),
        ({"max_live_parameters": 0}, "zero.max_live_parameters must be an integer > 0 (elements), got 0"),
        (
            {"param_persistence_threshold": -1},
            "zero.param_persistence_threshold must be an integer >= 0 (elements), got -1",
        ),
    ],
)
def test_bad_config_values_name_key_value_and_allowed(kwargs, message):
    with pytest.raises(ValueError) as info:
        ZeroConfig(**kwargs)
    assert str(info.value) == message


def test_bad_stage_through_the_strategy():
    with pytest.raises(ValueError, match="zero.stage must be one of 1, 2, 3, got 4"):
        ZeroStrategy(stage=4)
    with pytest.raises(TypeError, match="config must be a ZeroConfig, got dict"):
        ZeroStrategy({"stage": 2})


@pytest.mark.parametrize("precision", ["fp8", "16-true", "64-true", "bf16"])
def test_unknown_precision_is_refused(precision):
    with pytest.raises(
        ValueError, match=f"the ZeRO strategies support precision 32-true, bf16-mixed, 16-mixed; got '{precision}'"
    ):
        ZeroPrecision(precision)


def test_fp16_plugin_and_its_loss_scale():
    plugin = ZeroPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale_power=8))
    assert plugin.scaler.scale == 256
    assert ZeroPrecision("32-true").scaler is None
    with pytest.raises(ValueError, match="loss_scale only applies to precision '16-mixed', got precision 'bf16-mixed'"):
        ZeroPrecision("bf16-mixed", loss_scale=LossScaleConfig())
    # On CUDA Lightning hands the strategy a MixedPrecision("16-mixed"): it becomes ours.
    strategy = ZeroStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu")
    assert isinstance(strategy.precision_plugin, ZeroPrecision)
    assert strategy.precision_plugin.precision == "16-mixed" and strategy.precision_plugin.device == "cpu"
    trainer = pl.Trainer(strategy="zero2", accelerator="cpu", devices=2, plugins=[plugin], logger=False)
    assert trainer.strategy.precision_plugin is plugin and trainer.precision == "16-mixed"


def test_trainer_precision_maps_onto_zero_precision():
    trainer = pl.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    assert isinstance(trainer.strategy.precision_plugin, ZeroPrecision)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    with pytest.raises(ValueError, match="support precision 32-true, bf16-mixed, 16-mixed; got '64-true'"):
        pl.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision="64-true", logger=False)
    with pytest.raises(ValueError, match="support precision 32-true, bf16-mixed, 16-mixed; got 'bf16-true'"):
        pl.Trainer(strategy="zero1", accelerator="cpu", devices=2, precision="bf16-true", logger=False)


def test_version_is_the_packages():
    """``__version__`` is the version pip installed and pyproject.toml declares."""
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert lightning_zero.__version__ == importlib.metadata.version("lightning-zero") == declared.group(1)

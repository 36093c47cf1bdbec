"""The dynamic loss scaler's state machine against hand-written tables (DeepSpeed's semantics)."""

from __future__ import annotations

import pytest

from lightning_zero.config import LossScaleConfig
from lightning_zero.front.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError
from tests.support.loss_scale_tables import CONSECUTIVE, WINDOW_3_HYSTERESIS_2, F, T


@pytest.mark.parametrize(
    "config,table",
    [
        (LossScaleConfig(initial_scale_power=4, scale_window=3, hysteresis=2), WINDOW_3_HYSTERESIS_2),
        (
            LossScaleConfig(initial_scale_power=4, scale_window=3, hysteresis=2, consecutive_hysteresis=True),
            CONSECUTIVE,
        ),
    ],
)
def test_scaler_follows_table(config, table):
    scaler = DynamicLossScaler(config)
    assert scaler.scale == 16 and scaler.hysteresis == 2
    for step, (overflow, scale, hysteresis) in enumerate(table):
        scaler.update(overflow)
        assert (scaler.scale, scaler.hysteresis) == (scale, hysteresis), f"after row {step}"
    assert scaler.skipped_steps == sum(o for o, _, _ in table)


def test_defaults_are_deepspeeds():
    scaler = DynamicLossScaler(LossScaleConfig())
    assert scaler.scale == 2.0**16 and scaler.hysteresis == 2
    for _ in range(999):
        scaler.update(False)
    assert scaler.scale == 2.0**16
    scaler.update(False)
    assert scaler.scale == 2.0**17


def test_floor_raises_with_advice():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=1))
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 1
    with pytest.raises(LossScaleAtMinimumError, match=r"already at its minimum \(1\).*bf16-mixed"):
        scaler.update(True)


def test_floor_can_warn_instead():
    config = LossScaleConfig(initial_scale_power=1, hysteresis=1, min_loss_scale=2, raise_at_min_scale=False)
    scaler = DynamicLossScaler(config)
    with pytest.warns(RuntimeWarning, match="already at its minimum"):
        scaler.update(True)
    assert scaler.scale == 2 and scaler.skipped_steps == 1


def test_min_scale_clamps_the_back_off():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=3, hysteresis=1, min_loss_scale=5))
    scaler.update(True)
    assert scaler.scale == 5


def test_static_scale_never_changes():
    scaler = DynamicLossScaler(LossScaleConfig(static_loss_scale=128.0, scale_window=1))
    for overflow in (F, T, T, F, F, T):
        scaler.update(overflow)
        assert scaler.scale == 128.0
    assert scaler.skipped_steps == 3 and not scaler.dynamic


def test_state_dict_round_trip():
    config = LossScaleConfig(initial_scale_power=4, scale_window=3, hysteresis=2)
    first = DynamicLossScaler(config)
    for overflow, _, _ in WINDOW_3_HYSTERESIS_2[:7]:
        first.update(overflow)
    second = DynamicLossScaler(config)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    for overflow, scale, hysteresis in WINDOW_3_HYSTERESIS_2[7:]:
        second.update(overflow)
        assert (second.scale, second.hysteresis) == (scale, hysteresis)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"static_loss_scale": -1}, "fp16.static_loss_scale must be a number >= 0 (0 = dynamic), got -1"),
        ({"initial_scale_power": 65}, "fp16.initial_scale_power must be an integer in [0, 64], got 65"),
        ({"scale_window": 0}, "fp16.scale_window must be an integer >= 1, got 0"),
        ({"scale_factor": 1}, "fp16.scale_factor must be a number > 1, got 1"),
        ({"hysteresis": 0}, "fp16.hysteresis must be an integer >= 1, got 0"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale must be a number > 0, got 0"),
        ({"initial_scale_power": 2, "min_loss_scale": 8}, "fp16.min_loss_scale must be <= the starting scale 4, got 8"),
        ({"raise_at_min_scale": "no"}, "fp16.raise_at_min_scale must be true or false, got 'no'"),
    ],
)
def test_bad_loss_scale_values(kwargs, message):
    with pytest.raises(ValueError) as info:
        LossScaleConfig(**kwargs)
    assert str(info.value) == message

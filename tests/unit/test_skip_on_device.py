"""fp16 steps skipped on the device, in one process: the loss scaler's transition from a device flag equals the one
from the host's bool, table for table; the host's view of it comes exactly HOST_LAG updates late (so the error at
the minimum scale comes at the same update on every rank); a state loaded over copies still in flight is what the
host then sees; and without the fused step it is refused at setup, in one line (the training runs:
tests/dist/test_skip_on_device.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import LossScaleConfig, ZeroPrecision
from lightning_zero.front.loss_scaler import HOST_LAG, DynamicLossScaler, LossScaleAtMinimumError
from tests.support.helpers import EquivalenceModule, make_trainer, world_of_one, zero_strategy
from tests.support.loss_scale_tables import CONSECUTIVE, WINDOW_3_HYSTERESIS_2

CONFIG = LossScaleConfig(hysteresis=1, skip_on_device=True)


def test_the_host_sees_the_state_a_fixed_number_of_updates_late():
    """So every rank raises at the same update, whatever the device's timing."""
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale_power=0, hysteresis=1, skip_on_device=True))
    overflow = torch.ones(1, dtype=torch.uint8)
    for update in range(HOST_LAG):  # at the minimum already: each overflow is one the host must hear of
        scaler.update(overflow if update == 0 else torch.zeros(1, dtype=torch.uint8))
        assert scaler.host_view().tolist()[3] == 0
    with pytest.raises(LossScaleAtMinimumError):
        scaler.update(torch.zeros(1, dtype=torch.uint8))
    assert scaler.host_view().tolist()[3] == 1
    # a checkpoint's state replaces copies still in flight: the host sees it, and nothing is raised for them
    scaler.update(overflow)
    scaler.load_state_dict({"scale": 4.0, "hysteresis": 1, "good_steps": 0, "skipped_steps": 0})
    assert scaler.host_view().tolist()[:4] == [4.0, 1, 0, 0]
    for _ in range(HOST_LAG + 1):
        scaler.update(torch.zeros(1, dtype=torch.uint8))
    assert scaler.host_view().tolist()[:4] == [4.0, 1, 1, 0]


@pytest.mark.parametrize("table", [WINDOW_3_HYSTERESIS_2, CONSECUTIVE])
def test_device_flags_advance_the_scaler_as_host_bools(table):
    consecutive = table is CONSECUTIVE
    config = dict(initial_scale_power=4, scale_window=3, hysteresis=2, consecutive_hysteresis=consecutive)
    host, device = DynamicLossScaler(LossScaleConfig(**config)), DynamicLossScaler(LossScaleConfig(**config))
    for overflow, scale, hysteresis in table:
        host.update(overflow)
        device.update(torch.tensor([overflow], dtype=torch.uint8))  # as prepare_grads returns it
        assert device.state_dict() == host.state_dict() and (device.scale, device.hysteresis) == (scale, hysteresis)


def test_refused_without_the_fused_step():
    trainer = make_trainer(
        zero_strategy(2, fused_step="never"), 1, steps=1, plugins=[ZeroPrecision("16-mixed", loss_scale=CONFIG)]
    )
    with (
        world_of_one(),
        pytest.raises(
            ValueError, match=r"^fp16.skip_on_device needs the fused AdamW step: .* got AdamW with fused_step 'never'$"
        ),
    ):
        trainer.fit(EquivalenceModule("toy", steps=1))

"""The step-based progress bar's description, in one process (the metrics' way to the logger:
tests/dist/test_metrics.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_zero.front.callbacks import StepProgressBar


@pytest.mark.parametrize("limits,description", [({"max_steps": 600}, "Epoch 4"), ({"max_epochs": 5}, "Epoch 4/4")])
def test_step_progress_bar(limits, description):
    """The main job is bounded by max_steps: Lightning's RichProgressBar showed "Epoch 4/-2" there."""
    bar = StepProgressBar()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[bar], **limits)
    trainer.fit_loop.max_epochs = limits.get("max_epochs", -1)  # what fit sets: -1 is "no bound"
    bar.setup(trainer, None, "fit")
    assert bar._get_train_description(4).strip() == description
    assert bar.get_metrics(trainer, None).get("step") == ("0/600" if "max_steps" in limits else None)

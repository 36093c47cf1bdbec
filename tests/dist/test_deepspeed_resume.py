"""A DeepSpeed checkpoint converted by lightning_zero resumes training on the shared ranks: every restored weight
and moment where it belongs, frozen parameters inside param groups included (the conversion itself:
tests/unit/test_deepspeed_import.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.checkpoint.deepspeed_import import convert
from tests.support.helpers import DEEPSPEED_FIXTURES, deepspeed_expected, make_trainer, zero_strategy


def _tiny_module():
    spec = importlib.util.spec_from_file_location("make_fixtures", DEEPSPEED_FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyModule


class _CheckRestored(pl.Callback):
    """Before the first step after resuming: the weights, Adam's state and the LR schedule are DeepSpeed's."""

    def __init__(self, expected: dict) -> None:
        self.expected = expected
        self.checked = False

    def on_train_start(self, trainer, pl_module):
        expected = self.expected
        module = trainer.strategy.gather_module()
        for name, value in module.state_dict().items():
            assert torch.equal(value, expected["weights"][name]), name
        assert trainer.global_step == expected["step"]
        assert [g["lr"] for g in trainer.optimizers[0].param_groups] == expected["lr"]
        states = list(trainer.optimizers[0].optimizer.state.values())
        for key in ("exp_avg", "exp_avg_sq"):
            total = sum(float(s[key].double().square().sum()) for s in states)
            want = sum(float(v.double().square().sum()) for v in expected[key].values())
            assert total == pytest.approx(want, rel=1e-12), key
        assert {float(s["step"]) for s in states} == {expected["step"]}
        self.checked = True


def _with_frozen_in_groups(tiny_module):
    """The same module, its optimizer given every parameter (the frozen one too, as people often write):
    DeepSpeed's groups leave it out, so the state is matched by the names the converted groups carry."""

    class AllParameters(tiny_module):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            frozen = [p for p in self.parameters() if not p.requires_grad]
            config["optimizer"].param_groups[0]["params"].extend(frozen)
            return config

    return AllParameters


def _resume_worker(rank: int, world: int, converted: Path) -> None:
    expected = deepspeed_expected("lightning")
    for stage, module in ((1, _tiny_module()), (3, _tiny_module()), (2, _with_frozen_in_groups(_tiny_module()))):
        check = _CheckRestored(expected)
        trainer = make_trainer(zero_strategy(stage), world, steps=expected["step"] + 1, accumulate=1, callbacks=[check])
        trainer.fit(module(), ckpt_path=converted)
        assert check.checked and trainer.global_step == expected["step"] + 1


def test_lightning_zero_resumes_from_a_converted_checkpoint(ranks, tmp_path):
    converted = tmp_path / "converted.ckpt"
    convert(DEEPSPEED_FIXTURES / "lightning.ckpt", converted, trust_pickles=True)
    ranks(_resume_worker, 1, converted)

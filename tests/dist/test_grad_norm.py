"""Gradient norms under ZeRO: ``ZeroOptimizer.grad_norm()`` is safe anywhere in a step and changes
nothing about training; Lightning's ``grad_norm`` utility and ``lightning_zero.grad_norm`` give the
unsharded model's per-parameter norms; any other read of a sharded ``.grad`` fails loudly."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

import lightning_zero
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer
from tests.support.compare import relative_error
from tests.support.dynamic_models import DynamicModule
from tests.support.helpers import make_trainer, zero_strategy

STEPS = 4


class Watched(DynamicModule):
    """Calls the norms from the hooks users call them from (when ``watch``), recording what they return."""

    def __init__(self, watch: bool) -> None:
        super().__init__("branch", steps=STEPS)
        self.watch = watch
        self.after_backward: list[float] = []
        self.per_param: list[dict[str, float]] = []
        self.ours: list[dict[str, float]] = []

    def _global_norm(self) -> float:
        (optimizer,) = self.trainer.strategy.optimizers
        if isinstance(optimizer, ZeroOptimizer):
            return float(optimizer.grad_norm())
        return float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None]))

    def on_after_backward(self) -> None:
        if self.watch:
            self.after_backward.append(self._global_norm())
            if isinstance(self.trainer.strategy, lightning_zero.ZeroStrategy):
                self.ours.append({k: float(v) for k, v in lightning_zero.grad_norm(self).items()})

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.watch:
            self.per_param.append({k: float(v) for k, v in lightning_grad_norm(self, 2).items()})

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.watch:
            self._global_norm()


def _worker(rank: int, world: int, out_dir) -> None:
    for stage in (1, 2, 3):
        states = {}
        for watch in (False, True):
            pl.seed_everything(0)
            module = Watched(watch)
            config = {"param_persistence_threshold": 0} if stage == 3 else {"reduce_bucket_size": 100}
            trainer = make_trainer(zero_strategy(stage, **config), world, steps=STEPS, clip=0.5)
            trainer.fit(module)
            states[watch] = trainer.strategy.gather_module().state_dict()
            if watch and rank == 0:
                torch.save(
                    {"after": module.after_backward, "per_param": module.per_param, "ours": module.ours},
                    out_dir / f"norms-{stage}.pt",
                )
        for key, value in states[False].items():
            assert torch.equal(value, states[True][key]), f"stage {stage}: calling the norms changed {key}"
        with pytest.raises(
            RuntimeError, match=r"is sharded across ranks by the ZeRO strategy.* Use `p.grad.norm\(2\)`"
        ):

            class Clipping(Watched):
                def on_before_optimizer_step(self, optimizer) -> None:
                    torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)  # reads sharded .grad: must fail loudly

            make_trainer(zero_strategy(stage), world, steps=1).fit(Clipping(False))


def test_grad_norms_anywhere_change_nothing_and_match_one_process(ranks, tmp_path):
    ranks(_worker, 2, tmp_path)
    pl.seed_everything(0)
    reference = Watched(True)
    make_trainer("auto", 1, steps=STEPS, clip=0.5).fit(reference)
    assert len(reference.per_param) == STEPS and len(reference.per_param[0]) == 1 + len(list(reference.parameters()))
    for stage in (1, 2, 3):
        seen = torch.load(tmp_path / f"norms-{stage}.pt")
        after = relative_error(torch.tensor(seen["after"]), torch.tensor(reference.after_backward))
        assert len(seen["after"]) == len(reference.after_backward) and after <= 1e-5, (stage, after)
        assert len(seen["per_param"]) == STEPS
        for step, (mine, ref) in enumerate(zip(seen["per_param"], reference.per_param)):
            assert list(mine) == list(ref), (stage, step)
            for key in ref:
                assert abs(mine[key] - ref[key]) <= 1e-5 * max(ref[key], 1e-3), (stage, step, key, mine[key], ref[key])
        # lightning_zero.grad_norm from on_after_backward: the norms of the gradients accumulated so far
        for mine, total in zip(seen["ours"], reference.after_backward):
            assert abs(mine["grad_2.0_norm_total"] - total) <= 1e-5 * total, (stage, mine["grad_2.0_norm_total"], total)

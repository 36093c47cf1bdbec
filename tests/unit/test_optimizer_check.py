"""Which optimizers can be sharded: elementwise ones by type, others only if a probe shows that stepping
a tensor in pieces equals stepping it whole (see sharding/optimizer_check.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.sharding.optimizer_check import check_elementwise


def _params():
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


class AdamWithExtras(torch.optim.AdamW):
    """A user subclass: not on the allow-list, so it is probed (and passes)."""


class LambLike(torch.optim.SGD):
    """Scales each tensor's update by its norm ratio, like LAMB's trust ratio: not elementwise."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                trust = p.norm() / p.grad.norm().clamp_min(1e-12)
                p.add_(p.grad, alpha=-group["lr"] * float(trust))


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD, AdamWithExtras])
def test_elementwise_optimizers_pass(cls):
    check_elementwise(cls(_params(), lr=0.1))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.optim.Adafactor(_params()), r"torch\.optim\..*Adafactor does not .* shape or norm"),
        (lambda: LambLike(_params(), lr=0.1), r"LambLike does not .* differs from stepping it whole"),
        (lambda: torch.optim.LBFGS(_params()), r"LBFGS could not be checked .*closure"),
    ],
)
def test_shape_or_norm_dependent_optimizers_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        check_elementwise(make())

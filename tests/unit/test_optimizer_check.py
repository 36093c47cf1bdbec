"""Which optimizers can be sharded: elementwise ones by type, torch's others refused with the reason, any other
only if a probe shows that stepping a tensor in pieces equals stepping it whole; and the state an optimizer holds
when it is handed over, cut into each rank's pieces (see sharding/optimizer_check.py)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import build_layout
from lightning_zero.sharding.optimizer_check import (
    ELEMENTWISE,
    REFUSED,
    _probe_error,
    check_elementwise,
    shard_held_state,
)


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


def test_a_norm_dependent_optimizer_is_refused_by_the_probe():
    with pytest.raises(ValueError, match=r"LambLike does not .* differs from stepping it whole"):
        check_elementwise(LambLike(_params(), lr=0.1))


TORCH_OPTIMIZERS = [
    c
    for c in vars(torch.optim).values()
    if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
]


@pytest.mark.parametrize("cls", TORCH_OPTIMIZERS, ids=lambda c: c.__name__)
def test_each_torch_optimizer_is_accepted_as_the_probe_confirms_or_refused_with_its_reason(cls):
    if cls in ELEMENTWISE:  # the allow-list skips the probe: the probe must agree with it
        assert _probe_error(cls, {}) <= 1e-6
        return
    reason = re.escape(REFUSED.get(cls.__name__, "SparseAdam does not support dense gradients"))
    params = [p for p in _params() if p.dim() == 2]  # (Muon takes matrices only)
    with pytest.raises(ValueError, match=rf"{cls.__name__} (does not|could not be checked) \(.*{reason}"):
        check_elementwise(cls(params))


def _unit(params: list[torch.nn.Parameter], rank: int) -> FlatUnit:
    """One unit holding ``params`` as rank ``rank`` of 2 holds it (with its pieces), in this process."""
    layout = build_layout([p.numel() for p in params], 2, 10**6)
    unit = FlatUnit([torch.nn.Parameter(p.detach().clone()) for p in params], ["w", "scale"], layout, rank)
    unit.make_trainable()
    return unit


def test_held_state_is_cut_into_each_ranks_pieces():
    """Adagrad's state from its ``__init__``, changed by hand to differ per element: the two ranks' pieces together
    are the whole of it, a 0-d parameter's "step" stays its count, and a frozen parameter's state goes."""
    whole = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.tensor(2.0))]
    frozen = torch.nn.Parameter(torch.randn(2))
    pieces = []
    for rank in (0, 1):
        optimizer = torch.optim.Adagrad([*whole, frozen], initial_accumulator_value=0.5)
        for p in whole:
            optimizer.state[p]["sum"] += torch.arange(p.numel()).view(p.shape)
        unit = _unit(whole, rank)
        shard_held_state(optimizer.state, {p: (unit, i) for i, p in enumerate(whole)})
        assert len(optimizer.state) == len(unit.training.piece_tensors)  # (the frozen parameter's went)
        pieces += [
            (piece, optimizer.state[tensor]) for piece, tensor in zip(unit.training.pieces, unit.training.piece_tensors)
        ]
    for index, p in enumerate(whole):
        mine = sorted((piece.lo, state) for piece, state in pieces if piece.param == index)
        assert torch.equal(torch.cat([s["sum"] for _, s in mine]), 0.5 + torch.arange(p.numel()).float())
        assert all(s["step"].shape == () and s["step"] == 0 for _, s in mine)


def test_held_state_that_is_neither_scalar_nor_per_element_is_refused():
    p = torch.nn.Parameter(torch.randn(4, 3))
    unit = _unit([p, torch.nn.Parameter(torch.tensor(1.0))], rank=1)
    state = {p: {"row_sums": torch.zeros(4)}}
    with pytest.raises(ValueError, match=r"state 'row_sums' of w has shape \[4\], neither a scalar .* \[4, 3\]"):
        shard_held_state(state, {p: (unit, 0)})

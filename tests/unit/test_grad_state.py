"""A unit's gradient lifecycle (unit_training.py's GradState), moved only by its own methods in the order the
reducer and the optimizer drive them; what each state answers (reduce first? zero the full gradient? a gradient
arriving now is an error?) follows from it."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import build_layout
from lightning_zero.sharding.unit_training import GradState

pytestmark = pytest.mark.unit


def _unit(*, full_grad: bool) -> FlatUnit:
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))]
    layout = build_layout([p.numel() for p in params], 1, 8)
    return FlatUnit(params, ["w", "b"], layout, 0, full_grad=full_grad)


def test_stage1_accumulates_then_must_reduce_then_steps():
    training = _unit(full_grad=True).training
    assert training.state is GradState.IDLE and training.needs_reduction()  # no backward reduced yet
    training.begin_backward()
    training.flat_grad.add_(1.0)  # (what the gradient hooks write)
    training.end_accumulating_backward()
    assert training.state is GradState.ACCUMULATED and training.needs_reduction()
    training.reduced_partition().add_(2.0)  # (a reduction's chunk)
    training.flat_grad.zero_()
    training.reductions_done()
    assert training.state is GradState.REDUCED and not training.needs_reduction()
    training.attach_grads([1, 0])
    assert training.state is GradState.ATTACHED and training.taken_by_step
    assert training.piece_tensors[0].grad is not None and training.piece_tensors[1].grad is None
    training.mark_params_written()
    assert training.params_written and training.taken_by_step
    training.forget_params_written()  # a load after the step: its copy is not current
    assert training.state is GradState.ATTACHED
    training.release_grads()
    assert training.state is GradState.IDLE and training.reduced is None and training.step_grad is None


def test_a_backward_after_the_step_took_the_gradients_stays_refused():
    training = _unit(full_grad=False).training
    training.begin_backward()
    training.reductions_done()
    training.attach_grads([1, 1])
    training.begin_backward()  # another backward before the step: its gradients must raise, so the state stays
    assert training.state is GradState.ATTACHED and training.taken_by_step


@pytest.mark.parametrize("ended", [False, True])
def test_zero_grad_clears_what_a_backward_left_unreduced(ended):
    training = _unit(full_grad=True).training
    training.begin_backward()
    training.flat_grad.add_(1.0)
    training.mark_used(0)
    if ended:
        training.end_accumulating_backward()
    training.zero_grad()
    assert not training.flat_grad.any() and not any(training.used)
    assert training.state is GradState.IDLE


def test_stage2_partition_survives_release_and_is_zeroed_by_zero_grad():
    training = _unit(full_grad=False).training
    training.begin_backward()
    training.reduced_partition().add_(1.0)
    training.reductions_done()
    training.attach_grads([1, 1])
    training.release_grads()  # (a step without zero_grad: the next backward adds on top, as torch's)
    assert training.reduced.any() and not training.needs_reduction()
    training.zero_grad()
    assert not training.reduced.any()

"""A stage-3 unit's states (flat_unit.py's [Note: a unit's states]) in one process: a second gather waits for
the first, resharding waits for a gather in flight, an error's forgetting leaves a unit sharded for the next
run's gather, and the int8 gather and the node's secondary part go through the same states."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_zero.sharding.flat_unit import FlatUnit, UnitState, unshard_together
from lightning_zero.sharding.layout import build_layout
from tests.support.helpers import world_of_one

pytestmark = pytest.mark.unit


def _unit() -> tuple[FlatUnit, list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    values = [p.detach().clone() for p in params]
    layout = build_layout([p.numel() for p in params], 1, 10**6)
    return FlatUnit(params, ["a", "b"], layout, 0, shard_params=True, trainable=False), values


def test_states_through_gathers_and_errors():
    with world_of_one():
        unit, values = _unit()
        assert unit.state is UnitState.SHARDED and not unit.gathered
        unit.unshard(async_op=True)
        assert unit.state is UnitState.GATHERING and unit.gathered
        unit.unshard(async_op=True)  # waits for the first gather before the second writes the buffer
        unit.wait_gathered()
        assert unit.state is UnitState.GATHERED
        assert all(torch.equal(p, v) for p, v in zip(unit.params, values))
        unit.reshard()
        unit.unshard(async_op=True)
        unit.reshard()  # waits for the gather in flight, then frees
        assert unit.state is UnitState.SHARDED and unit.flat_param.untyped_storage().nbytes() == 0
        unit.unshard(async_op=True)
        unit.forget_values()  # an error: counts as sharded, the buffer left to the next gather
        assert unit.state is UnitState.SHARDED and unit.flat_param.untyped_storage().nbytes() > 0
        unit.unshard(async_op=False)
        assert unit.state is UnitState.GATHERED and torch.equal(unit.params[1], values[1])
        unit.keep_secondary(0, 1)
        unit.reshard()
        unit.unshard_within_node()
        unit.wait_gathered()
        assert torch.equal(unit.params[0], values[0])
        unit.write_owned(0, torch.zeros(5, 3))  # a write drops the secondary part (it mirrors the shards)
        assert unit.secondary is None
        unit.reshard()
        unit.unshard(async_op=False, quantize_block=4)
        assert unit.quantized_values and unit.state is UnitState.GATHERED
        unit.reshard()
        unit.unshard(async_op=True)
        unshard_together([unit])  # waits for the gather in flight first
        assert unit.state is UnitState.GATHERED and torch.equal(unit.params[0], torch.zeros(5, 3))

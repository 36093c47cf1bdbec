"""Every elementwise optimizer of torch.optim (those optimizer_check.py accepts by type) under zero1, zero2 and
zero3 equals one process on the same global batches, ranks identical, with a state loaded before sharding (one
value per element, each different: each rank must keep exactly its pieces of it); Adagrad, which fills its state
in its ``__init__``, also fresh, and resumed from a checkpoint at another stage.

One Fabric loop per optimizer and stage on a tiny model: two ModuleList blocks and a root holding a head and a
0-d parameter (whose per-element state has the shape of a step count), odd sizes that split parameters across
the ranks, two param groups; stage 3 builds the model sharded (``empty_init``), so the optimizer is created on
sharded parameters, and gathers every unit (``param_persistence_threshold=0``).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroConfig, ZeroFabricStrategy
from lightning_zero.sharding.optimizer_check import ELEMENTWISE
from tests.support.compare import assert_close
from tests.support.helpers import COLLECTIVE_TIMEOUT_S

STEPS, SAVED_AT, BATCH = 4, 2, 8
# Each with the options that make it hold all the state it can (momentum, amsgrad, centered, averaging, ...).
OPTIONS = {
    "Adadelta": {"lr": 1.0, "weight_decay": 0.01},
    "Adagrad": {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.5},
    "Adam": {"lr": 0.01, "amsgrad": True},
    "AdamW": {"lr": 0.01, "weight_decay": 0.1},
    "Adamax": {"lr": 0.01},
    "ASGD": {"lr": 0.01, "t0": 1},
    "NAdam": {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1},
    "RAdam": {"lr": 0.01},
    "RMSprop": {"lr": 0.01, "momentum": 0.9, "centered": True},
    "Rprop": {"lr": 0.01},
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 7)])
        self.head = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x) * self.scale  # (B, 3)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS * BATCH, 5, generator=g), torch.randint(3, (STEPS * BATCH,), generator=g)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups: the matrices, and the rest at half the learning rate."""
    options = OPTIONS[name]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": matrices}, {"params": rest, "lr": options["lr"] / 2}]
    return getattr(torch.optim, name)(groups, **options)


def _train(model, optimizer, backward, steps: range, rank: int, world: int) -> None:
    """Steps ``steps`` of the loop: global batch k is samples [8k, 8k + 8), of which rank r takes its r-th share."""
    x, y = _data()
    for k in steps:
        share = slice(k * BATCH + rank * BATCH // world, k * BATCH + (rank + 1) * BATCH // world)
        backward(F.cross_entropy(model(x[share]), y[share]))
        optimizer.step()
        optimizer.zero_grad()


def _held_state(name: str) -> dict:
    """A state for ``name`` to load before sharding, one value per element that differ: what two steps of
    another model (seed 1) left (``optimizer.load_state_dict`` before ``fabric.setup``)."""
    pl.seed_everything(1)
    model = Tiny()
    optimizer = _optimizer(name, model)
    _train(model, optimizer, torch.Tensor.backward, range(2), 0, 1)
    return optimizer.state_dict()


def _single(name: str, held: dict | None) -> dict[str, torch.Tensor]:
    pl.seed_everything(0)
    model = Tiny()
    optimizer = _optimizer(name, model)
    if held is not None:
        optimizer.load_state_dict(copy.deepcopy(held))  # (loading keeps the tensors it is given, and steps them)
    _train(model, optimizer, torch.Tensor.backward, range(STEPS), 0, 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _setup(stage: int, world: int, name: str, held: dict | None):
    config = ZeroConfig(stage=stage, param_persistence_threshold=0, timeout=COLLECTIVE_TIMEOUT_S)
    fabric = Fabric(strategy=ZeroFabricStrategy(config), accelerator="cpu", devices=world)
    fabric.launch()
    pl.seed_everything(0)
    with fabric.init_module(empty_init=stage == 3):  # stage 3: the optimizer is created on sharded parameters
        model = Tiny()
    optimizer = _optimizer(name, model)
    if held is not None:
        optimizer.load_state_dict(copy.deepcopy(held))
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def _state(fabric: Fabric, model) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in fabric.strategy.get_module_state_dict(model).items()}


def _runs(rank: int, world: int, root, held: dict) -> dict:
    """Each optimizer with ``held[name]`` loaded before sharding, and Adagrad also fresh (its state as its
    ``__init__`` filled it), at every stage; the fresh zero1 run saves after step 2, resumed at zero3."""
    out = {}
    for name, fresh in [(name, False) for name in OPTIONS] + [("Adagrad", True)]:
        for stage in (1, 2, 3):
            fabric, model, optimizer = _setup(stage, world, name, None if fresh else held[name])
            _train(model, optimizer, fabric.backward, range(SAVED_AT), rank, world)
            if fresh and stage == 1:
                fabric.save(root / "adagrad", {"model": model, "optimizer": optimizer})
            _train(model, optimizer, fabric.backward, range(SAVED_AT, STEPS), rank, world)
            out[name, fresh, f"zero{stage}"] = _state(fabric, model)
    # A fresh Adagrad (its state filled again by its __init__) at stage 3 resumes the zero1 checkpoint's state.
    fabric, model, optimizer = _setup(3, world, "Adagrad", None)
    fabric.load(root / "adagrad", {"model": model, "optimizer": optimizer})
    _train(model, optimizer, fabric.backward, range(SAVED_AT, STEPS), rank, world)
    out["Adagrad", True, "zero1 resumed at zero3"] = _state(fabric, model)
    return out


def test_elementwise_optimizers_equal_one_process_at_every_stage(ranks, tmp_path):
    """The loop covers every torch optimizer optimizer_check.py accepts by type: none is claimed untested."""
    assert set(OPTIONS) == {c.__name__ for c in ELEMENTWISE if c.__module__.startswith("torch.optim")}
    held = {name: _held_state(name) for name in OPTIONS}
    results = ranks(_runs, 2, tmp_path, held)
    singles = {(name, fresh): _single(name, None if fresh else held[name]) for name, fresh, _ in results[0]}
    for (name, fresh, run), state in results[0].items():
        what = f"{name} ({'fresh' if fresh else 'state loaded before sharding'}) {run}"
        for key, value in singles[name, fresh].items():
            assert torch.equal(state[key], results[1][name, fresh, run][key]), f"{what}: {key} differs between ranks"
            assert_close(state[key], value, f"{what}: {key} against one process")

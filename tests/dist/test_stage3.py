"""Stage 3 specifics: gathered bytes stay within the prefetch bound, per-step traffic is the paper's
3 Psi, per-rank bytes are 16 Psi / N, and sharded initialization never holds the whole model yet
gives the values of a plain initialization with the same seed. (Equivalence with a single process is
in test_equivalence.py.)"""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn

from lightning_zero import ZeroPrecision
from lightning_zero.models.gpt import GPT
from lightning_zero.planning.memory import formula_bytes
from lightning_zero.sharding import collectives
from tests.support.compare import full_state
from tests.support.helpers import EquivalenceModule, TrafficPerStep, make_trainer, zero_strategy

ACCUMULATE, STEPS, LAYERS = 2, 3, 4


class Observe(TrafficPerStep):
    """Records, while the strategy still shards, what the tests below assert on."""

    def on_train_start(self, trainer, pl_module):
        runtime = trainer.strategy.engine.stage3
        self.flat_bytes_at_start = [u.flat_param.untyped_storage().nbytes() for u in runtime.units]
        self.initial_state = full_state(trainer.strategy)

    def on_train_end(self, trainer, pl_module):
        runtime = trainer.strategy.engine.stage3
        self.units = runtime.units
        self.root = runtime.root
        self.peak_live_numel = runtime.peak_live_numel
        self.memory = trainer.strategy.memory_bytes()


def _fit(world: int, *, precision: str = "32-true", **config):
    pl.seed_everything(0)
    module = EquivalenceModule("gpt", steps=STEPS, lazy=True, n_layer=LAYERS)
    observe = Observe()
    config.setdefault("param_persistence_threshold", 0)
    trainer = make_trainer(
        zero_strategy(3, **config),
        world,
        steps=STEPS,
        accumulate=ACCUMULATE,
        callbacks=[observe],
        plugins=[ZeroPrecision(precision)],
    )
    trainer.fit(module)
    return trainer, module, observe


def _bytes_and_traffic_worker(rank: int, world: int) -> None:
    for precision in ("32-true", "16-mixed"):
        trainer, module, seen = _fit(world, precision=precision)
        b = 2 if precision == "16-mixed" else 4
        psi = sum(p.numel() for p in module.parameters() if p.requires_grad)
        padded = sum(u.layout.total_numel for u in seen.units)
        assert psi <= padded < psi + 2 * world * len(seen.units)
        mem = seen.memory
        assert mem["parameters"] == b * padded // world  # the shards; nothing is kept gathered
        assert mem["gradients"] == b * padded // world
        assert mem["master"] == (4 * padded // world if b == 2 else 0)  # fp32 shards double as the master
        (optimizer,) = trainer.strategy.optimizers
        moments = sum(
            v.nbytes for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
        )
        assert sum(collectives.all_gather_object(moments)) == 8 * psi
        formula = sum(formula_bytes("zero3", psi, world, param_bytes=b).values())
        assert formula == 16 * psi / world
        footprint = mem["parameters"] + mem["gradients"] + mem["master"] + moments
        assert abs(footprint - formula) <= 20 * (padded - psi), (precision, footprint, formula)
        # Per micro-batch: every block gathered for forward and again for backward, the root once;
        # one reduce-scatter of everything. About 3 Psi, the paper's number.
        root = sum(u.layout.total_numel for u in seen.root)
        for step in seen.per_step:
            assert step["reduce_scatter"] == ACCUMULATE * padded
            assert step["all_gather"] == ACCUMULATE * (2 * (padded - root) + root)


def test_bytes_and_traffic_match_formulas(ranks):
    ranks(_bytes_and_traffic_worker, 2)


def _live_bound_worker(rank: int, world: int) -> None:
    block = None
    for blocks in (1, 2):
        probe = EquivalenceModule("gpt", n_layer=LAYERS)
        numel = sum(p.numel() for p in probe.net.blocks[0].parameters())
        block = -(-numel // (2 * world)) * 2 * world  # padded as the layout pads
        _, _, seen = _fit(world, max_live_parameters=blocks * block)
        assert {u.layout.total_numel for u in seen.units if u not in seen.root} == {block}
        # Prefetch fills the bound and never passes it.
        assert seen.peak_live_numel == blocks * block, (blocks, seen.peak_live_numel, block)


def test_gathered_parameters_stay_within_the_live_bound(ranks):
    ranks(_live_bound_worker, 2)


def _sharded_init_worker(rank: int, world: int) -> None:
    trainer, module, seen = _fit(world, max_live_parameters=1)  # construction: one module whole at a time
    torch.manual_seed(0)
    plain = GPT(module.gpt_config)  # a plain, whole initialization with the same seed
    assert list(seen.initial_state) == [f"net.{k}" for k in plain.state_dict()]
    for name, value in plain.state_dict().items():
        assert torch.equal(seen.initial_state[f"net.{name}"], value), name
    # Byte accounting: no unit was whole after set-up, and initialization never held more than one
    # module's own parameters at a time, far below the model.
    assert seen.flat_bytes_at_start == [0] * len(seen.units)
    whole = sum(p.nbytes for p in plain.parameters())
    largest_module = max(sum(p.nbytes for p in m.parameters(recurse=False)) for m in plain.modules())
    assert trainer.strategy.sharded_init_peak_bytes == largest_module
    assert largest_module < whole / 4


def test_sharded_initialization_equals_plain_initialization(ranks):
    ranks(_sharded_init_worker, 2)


class Uninitialized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(5))


class MetaWithoutInit(EquivalenceModule):
    def configure_model(self):
        if self.net is None:
            with torch.device("meta"):  # built on the meta device by the user: initialized shard by shard
                self.net = nn.ModuleDict({"odd": Uninitialized()})

    def init_module(self, module, generator):
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


class BuiltOnMeta(EquivalenceModule):
    def configure_model(self):
        if self.net is None:
            with torch.device("meta"):
                self.net = GPT(self.gpt_config)


def _error_worker(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"parameter 'net.odd.weight' \(Uninitialized\) was not initialized"):
        make_trainer(zero_strategy(3), world, steps=1).fit(MetaWithoutInit("gpt", lazy=True))
    with pytest.raises(ValueError, match="meta device, which only stage 3 can materialize; zero.stage is 2"):
        make_trainer(zero_strategy(2), world, steps=1).fit(BuiltOnMeta("gpt", lazy=True))


def test_meta_models_fail_clearly(ranks):
    ranks(_error_worker, 2)


def _evaluate_worker(rank: int, world: int) -> None:
    pl.seed_everything(0)
    module = EquivalenceModule("gpt", lazy=True)
    trainer = make_trainer(zero_strategy(3, param_persistence_threshold=0), world, steps=1)
    outputs = trainer.predict(module, dataloaders=torch.utils.data.DataLoader(module.data, batch_size=4))
    pl.seed_everything(0)
    plain = EquivalenceModule("gpt")
    for x, _ in itertools.islice(torch.utils.data.DataLoader(module.data, batch_size=4), 2):
        expected = plain.net(x)
        assert torch.allclose(outputs.pop(0), expected, atol=1e-6)


def test_predict_with_a_sharded_model(ranks):
    ranks(_evaluate_worker, 2)

"""Stage 3 around the steps: saving gathers nothing, teardown leaves the model sharded (whole only when
asked), ``load_state_dict`` during ``fit`` loads into the shards (and, under stage 2, into the master),
an error in a step surfaces as itself, and optimizers whose update depends on a parameter's shape are
refused before training starts."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.resilience.peer_failure import EXIT_CODE
from lightning_zero.sharding import collectives
from lightning_zero.sharding.unit_index import UnitIndex
from tests.support.compare import full_state, relative_error
from tests.support.dynamic_models import DynamicModule
from tests.support.helpers import make_trainer, zero_strategy
from tests.support.pool import RankFailure

WIDTH, DEPTH = 1024, 16  # 16 units of 4 MiB: the whole model is 64 MiB, one unit 4 MiB


def _peak_allocated(run) -> int:
    """Most bytes allocated at once (above the start) by torch on the CPU while ``run()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH))
        self.data = TensorDataset(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0)))

    def training_step(self, batch, batch_idx):
        h = batch[0]
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h.square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=2)


class SaveProbe(pl.Callback):
    """At the end of training, saves a checkpoint and measures what that allocated and gathered."""

    def __init__(self, path) -> None:
        self.path = path
        self.traffic = collectives.Traffic()  # observed around the whole fit, its teardown included

    def on_train_end(self, trainer, pl_module):
        units = trainer.strategy.engine.units
        self.shard_bytes = sum(u.param_shard.nbytes for u in units)
        self.unit_bytes = max(u.flat_param.nbytes for u in units)
        gathers = self.traffic.elements["all_gather"]
        self.peak = _peak_allocated(lambda: trainer.save_checkpoint(self.path))
        self.save_gathers = self.traffic.elements["all_gather"] - gathers
        self.last_state = full_state(trainer.strategy)  # asked for: gathered unit by unit
        self.gathers_at_end = self.traffic.elements["all_gather"]


def _save_worker(rank: int, world: int, root) -> None:
    torch.manual_seed(0)
    probe = SaveProbe(root / "wide.ckpt")
    strategy = zero_strategy(3, param_persistence_threshold=0)
    trainer = make_trainer(strategy, world, steps=2, accumulate=1, callbacks=[probe])
    module = Wide()
    with collectives.observing(probe.traffic):
        trainer.fit(module)
    assert probe.save_gathers == 0, "saving gathered parameters"
    # What the save allocated at its peak: the optimizer-state copies it writes (Adam's two moments of
    # this rank's shard, fp32), at most one unit more, and 1 MiB of slack; gathering the model whole
    # (as Lightning's state dict would) adds 64 MiB.
    allowed = 2 * probe.shard_bytes + probe.unit_bytes + 2**20
    assert probe.peak <= allowed, f"saving allocated {probe.peak / 2**20:.1f} MiB, allowed {allowed / 2**20:.1f}"
    # Teardown gathered nothing and left the parameters sharded (placeholders without storage, which raise
    # when read rather than give NaN).
    assert probe.traffic.elements["all_gather"] == probe.gathers_at_end
    for k, layer in enumerate(module.layers):
        assert layer.weight.stride() == (0, 0)
        with pytest.raises(RuntimeError, match=rf"'layers.{k}.weight' is sharded .* not gathered outside a step"):
            layer.weight.sum()
    # Made whole on request, one unit at a time: the last step's values.
    whole = trainer.strategy.gather_module("cpu")
    for key, value in whole.state_dict().items():
        assert torch.equal(value, probe.last_state[key]), key


def test_saving_and_teardown_gather_nothing(ranks, tmp_path):
    ranks(_save_worker, 2, tmp_path)


class Reloaded(DynamicModule):
    """Loads ``target`` with ``load_state_dict`` in the middle of fit (before the 4th micro-batch)."""

    def __init__(self, target: dict) -> None:
        super().__init__("moe", steps=4)
        self.target = target

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 3:
            assert not self.load_state_dict(self.target).missing_keys


def _target() -> dict:
    torch.manual_seed(1)
    return DynamicModule("moe").state_dict()


LOAD_RUNS = (
    ("zero2", 2, {}),
    ("default", 3, {}),
    ("tight", 3, {"param_persistence_threshold": 0, "max_live_parameters": 3000}),
)


def _load_worker(rank: int, world: int, out_dir) -> None:
    for name, stage, config in LOAD_RUNS:
        pl.seed_everything(0)
        module = Reloaded(_target())
        trainer = make_trainer(zero_strategy(stage, **config), world, steps=4)
        trainer.fit(module)
        torch.save(full_state(trainer.strategy), out_dir / f"{name}-{rank}.pt")


def test_load_state_dict_during_fit_loads_into_the_shards(ranks, tmp_path):
    ranks(_load_worker, 2, tmp_path)
    pl.seed_everything(0)
    reference = Reloaded(_target())
    make_trainer("auto", 1, steps=4).fit(reference)
    untouched = DynamicModule("moe").state_dict()
    for name, _, _ in LOAD_RUNS:
        state = torch.load(tmp_path / f"{name}-0.pt")
        for key, ref in reference.state_dict().items():
            assert relative_error(state[key], ref) <= 1e-5, (name, key)
        assert any(relative_error(state[k], v) > 1e-2 for k, v in untouched.items())  # the load changed things


class Failing(DynamicModule):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2 and self.global_rank == 0:
            raise ValueError("boom on rank 0")
        return super().training_step(batch, batch_idx)


def _failing_worker(rank: int, world: int, out_dir) -> None:
    pl.seed_everything(0)
    strategy = zero_strategy(3, param_persistence_threshold=0, timeout=20)
    start = time.monotonic()
    try:
        make_trainer(strategy, world, steps=6).fit(Failing("branch"))
        outcome = ("finished", "")
    except Exception as error:  # noqa: BLE001 - the test looks at what surfaced
        outcome = (type(error).__name__, str(error))
    torch.save((*outcome, time.monotonic() - start), out_dir / f"failing-{rank}.pt")


def test_an_error_in_a_step_surfaces_as_itself(ranks, tmp_path):
    """Rank 0's own error reaches its caller; rank 1, whose collective fails when rank 0 leaves, ends with
    peer_failure's exit code (one line, no teardown) within the timeout: nothing waits forever."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as failed:
        ranks(_failing_worker, 2, tmp_path)
    assert (failed.value.raised, failed.value.died, failed.value.hung) == ([], {1: EXIT_CODE}, [])
    assert time.monotonic() - start < 60
    kind, message, _ = torch.load(tmp_path / "failing-0.pt")
    assert (kind, message) == ("ValueError", "boom on rank 0")
    assert not (tmp_path / "failing-1.pt").exists()


def _refused_worker(rank: int, world: int) -> None:
    class Factored(DynamicModule):
        def configure_optimizers(self):
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)

    for stage in (2, 3):
        with pytest.raises(ValueError, match=r"torch\.optim\..*Adafactor does not .*depends on the parameter's shape"):
            make_trainer(zero_strategy(stage), world, steps=1).fit(Factored("branch"))


def test_shape_dependent_optimizers_are_refused_on_every_rank(ranks):
    ranks(_refused_worker, 2)


class GatherAtTrainEnd(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        trainer.strategy.gather_module("cpu")  # inside the run: its hooks must go with the shards
        self.peak = trainer.strategy.peak_gathered_bytes


def _gather_in_run_worker(rank: int, world: int) -> None:
    pl.seed_everything(0)
    module = DynamicModule("branch")
    make_trainer(zero_strategy(3, param_persistence_threshold=0), world, steps=2).fit(module)
    entries = len(UnitIndex.of(module)._entries)
    assert entries > 0
    with pytest.raises(ValueError, match="shard_group_size must divide the world size"):  # fails at set-up
        make_trainer(zero_strategy(3, shard_group_size=3), world, steps=2).fit(module)
    assert len(UnitIndex.of(module)._entries) == entries  # still sharded: the units stay findable
    end = GatherAtTrainEnd()
    make_trainer(zero_strategy(3, param_persistence_threshold=0), world, steps=2, callbacks=[end]).fit(module)
    assert end.peak > 0
    x, _ = module.data[:4]
    module.net(x).sum()  # a forward after fit: plain whole parameters, no hook shards them again
    assert all(type(p) is nn.Parameter and p.stride() != (0,) * p.dim() for p in module.parameters())


def test_a_failed_set_up_keeps_the_shards_and_gather_module_inside_a_run_ends_sharding(ranks):
    ranks(_gather_in_run_worker, 2)

"""User code that reads parameters, as under ``ddp``, with stage 3 really sharding (every unit gathered only
when used): never a NaN.

- Inside ``training_step``, iterating ``self.parameters()`` / ``named_parameters()`` sees the real values: an
  L2 penalty over every parameter added to the loss, and a weight norm logged from ``named_parameters()``,
  equal ddp's (and one process's) under every stage; so does the forward after ``gathered_parameters`` was
  entered in the step (a read inside it keeps the unit gathered for the step).
- Between steps a read of a sharded parameter raises one error naming the parameter and the ways to read it
  (an EMA over ``self.parameters()`` in ``on_train_batch_end``, ``pl_module.state_dict()`` in a callback, a
  frozen parameter read in ``on_train_end``, rank 0 alone reading after ``fit`` without waiting for the
  others); ``lightning_zero.parameter_norms(pl_module)`` there gives every parameter's norm, as one process
  computes them, with no all-gather; inside ``lightning_zero.gathered_parameters(pl_module)`` the same
  code (and ddp's, unchanged) sees the real values: the EMA equals ddp's, the frozen parameter its
  constructor's value, and ``trainer.strategy.full_state_dict()`` equals ddp's state dict.
- ``trainer.strategy.lightning_module_state_dict()`` (what Lightning's checkpoint holds) has every key of
  ddp's, issues no collective, and under stage 3 its sharded parameters raise the same error when read.
- ``gathered_parameters(..., modifier_rank=0)`` writes rank 0's values into every rank's shards and master
  weights: training goes on from them.
- Writes inside ``gathered_parameters`` without ``modifier_rank`` (in ``on_fit_start``, as a ddp user edits
  weights) are kept under every stage: an edit through ``.data``, a new tensor as ``.data``, ``nn.init`` on
  rank 0 only and ``add_`` on the last rank only (both in one block, in one unit); and in ``training_step`` a
  write through the parameters the block yields followed by the step's forward inside the block; training
  then equals ddp's with the same edits on every rank. So does a new tensor given as ``.data`` outside any
  context, between steps and in a step (param_writes.py's [Note: a replaced .data]).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import lightning_zero
from lightning_zero.sharding import collectives
from tests.support.compare import full_state, relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS = 6
PENALTY = 1e-3
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
READ_ERROR = r"is sharded across ranks by the ZeRO strategy \(stage 3\) and is not gathered outside a step"


class Reads(EquivalenceModule):
    """BlocksNet with an L2 penalty over every parameter, a logged weight norm, and a frozen scale."""

    def __init__(self) -> None:
        super().__init__("blocks", steps=STEPS)
        self.frozen_scale = torch.nn.Parameter(torch.linspace(1.0, 2.0, 9), requires_grad=False)
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        with lightning_zero.gathered_parameters(self, self.net.blocks[1]):  # read as an attribute: kept for the step
            self.block_norm = self.net.blocks[1].lin.weight.detach().norm()
        if self.global_step == 3 and batch_idx % 2 == 0:  # a new tensor, outside any context, as under ddp
            self.net.blocks[3].norm.bias.data = torch.full((9,), -0.1)
        with lightning_zero.gathered_parameters(self, self.net.blocks[0]) as params:
            if self.global_step == 2 and batch_idx % 2 == 0:  # a write, then the forward inside the block
                for p in params:
                    if p.dim() == 1:
                        p.data.mul_(0.5)
            loss = super().training_step(batch, batch_idx)
        norm = torch.stack([p.detach().norm() for _, p in self.named_parameters()]).norm()
        self.norms.append(float(norm))
        self.log("param_norm", norm)
        return loss + PENALTY * sum(p.pow(2).sum() for p in self.parameters() if p.requires_grad)


class ReadsBetweenSteps(pl.Callback):
    """An EMA of every parameter, a state dict and the frozen parameter, read the way a ddp user reads them."""

    def __init__(self, sharded: bool) -> None:
        self.sharded = sharded  # stage 3: the plain reads must raise
        self.ema: list[torch.Tensor] | None = None
        self.errors: list[str] = []

    def _plain(self, read) -> None:
        if not self.sharded:
            read()
            return
        with pytest.raises(RuntimeError, match=READ_ERROR) as info:
            read()
        self.errors.append(str(info.value).split("'")[1])  # the parameter it names

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and batch_idx % 2 == 1:  # between steps, outside any context, as under ddp
            pl_module.net.blocks[2].lin.bias.data = torch.full((9,), 0.2)
        self._plain(lambda: [p.detach().clone() for p in pl_module.parameters()])
        with lightning_zero.gathered_parameters(pl_module) as params:
            values = [p.detach().clone() for p in params]
        self.ema = values if self.ema is None else [0.9 * e + 0.1 * v for e, v in zip(self.ema, values)]

    def on_train_epoch_end(self, trainer, pl_module):
        self._plain(lambda: pl_module.state_dict())
        with collectives.record() as issued:
            by_reference = trainer.strategy.lightning_module_state_dict()
        self.reference_keys, self.reference_collectives = list(by_reference), list(issued)
        self._plain(lambda: [v.sum() for v in by_reference.values()])
        self.state = full_state(trainer.strategy)
        with collectives.record() as issued:  # (the ZeRO strategies' collectives)
            self.weight_norms = lightning_zero.parameter_norms(pl_module)
        self.gathers = [c for c in issued if c[0] == "all_gather"]

    def on_train_end(self, trainer, pl_module):
        self._plain(lambda: pl_module.frozen_scale.sum())
        with lightning_zero.gathered_parameters(pl_module, pl_module.frozen_scale):
            self.frozen = pl_module.frozen_scale.detach().clone()


class WritesAtFitStart(pl.Callback):
    """Edits weights before training as a ddp user does; under the ZeRO strategies some only on one rank."""

    def __init__(self, every_rank: bool) -> None:
        self.every_rank = every_rank

    def on_fit_start(self, trainer, pl_module):
        rank, last = trainer.global_rank, trainer.world_size - 1
        blocks = pl_module.net.blocks
        with lightning_zero.gathered_parameters(pl_module, blocks[1], blocks[3]):
            blocks[1].lin.weight.data.fill_(0.01)  # every rank (.data: no version counter moves)
            blocks[1].norm.weight.data = torch.linspace(0.5, 1.5, 9)  # a new tensor, every rank
            if self.every_rank or rank == 0:
                torch.nn.init.constant_(blocks[3].lin.bias, 0.5)
            if self.every_rank or rank == last:  # another parameter of a unit rank 0 wrote to: kept too
                with torch.no_grad():
                    blocks[1].norm.bias.add_(0.25)


def _strategy(name: str):
    if name in ("ddp", "auto"):
        return name
    return zero_strategy(int(name[-1]), param_persistence_threshold=0, reduce_bucket_size=40)


def _fit(name: str, world: int) -> tuple[Reads, ReadsBetweenSteps, pl.Trainer]:
    pl.seed_everything(0)
    module = Reads()
    reads = ReadsBetweenSteps(sharded=name == "zero3")
    writes = WritesAtFitStart(every_rank=not name.startswith("zero"))
    trainer = make_trainer(_strategy(name), world, steps=STEPS, callbacks=[writes, reads])
    trainer.fit(module)
    return module, reads, trainer


def _worker(rank: int, world: int) -> dict:
    results = {}
    for name in STRATEGIES:
        module, reads, trainer = _fit(name, world)
        if name == "zero3":
            assert set(reads.errors) == {"frozen_scale"}, reads.errors  # the first parameter read, named
            assert len(reads.errors) == STEPS * 2 + 3, reads.errors  # each batch, the epoch's end (2), the train's end
            if rank == 0:  # rank 0 alone, after fit: an error, and nothing waits for rank 1
                with pytest.raises(RuntimeError, match=READ_ERROR):
                    module.state_dict()
        assert not reads.gathers, f"{name}: parameter_norms gathered {reads.gathers}"
        assert not reads.reference_collectives, f"{name}: {reads.reference_collectives}"
        assert reads.reference_keys == list(reads.state), name
        results[name] = {
            "weight_norms": reads.weight_norms,
            "state": {k: v.float() for k, v in full_state(trainer.strategy).items()},
            "epoch_state": {k: v.float() for k, v in reads.state.items()},
            "norms": module.norms,
            "ema": reads.ema,
            "frozen": reads.frozen,
        }
    return results


def _modified_worker(rank: int, world: int) -> dict:
    """Rank 0 re-initializes block 1 between steps; every rank trains on from its values."""
    pl.seed_everything(0)
    module = EquivalenceModule("blocks", steps=STEPS)

    class Reinitialize(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and batch_idx % 2 == 1:
                lin = pl_module.net.blocks[1].lin
                with lightning_zero.gathered_parameters(pl_module, lin, modifier_rank=0):
                    if trainer.global_rank == 0:
                        lin.weight.data.fill_(0.01)
                with lightning_zero.gathered_parameters(pl_module, lin):
                    self.seen = lin.weight.detach().clone()

    watch = Reinitialize()
    strategy = zero_strategy(3, param_persistence_threshold=0)
    make_trainer(strategy, world, steps=STEPS, callbacks=[watch]).fit(module)
    return {"seen": watch.seen, "state": full_state(strategy)}


def _reference() -> dict:
    """One process, the same global batches."""
    module, reads, trainer = _fit("auto", 1)
    return {
        "state": module.state_dict(),
        "norms": module.norms,
        "ema": reads.ema,
        "frozen": reads.frozen,
        "weight_norms": reads.weight_norms,
    }


def test_parameters_read_in_and_between_steps_equal_ddp(ranks):
    results = ranks(_worker, 2)
    reference = _reference()
    ddp = results[0]["ddp"]
    for name in STRATEGIES:
        for rank, result in enumerate(results):
            run = result[name]
            for key, value in ddp["state"].items():
                assert torch.equal(run["state"][key], results[0][name]["state"][key]), (name, key, rank)
                err = relative_error(run["state"][key], value)
                assert err <= 1e-5, f"{name} rank {rank}: {key} differs from ddp's by {err:.2e}"
                err = relative_error(run["epoch_state"][key], ddp["epoch_state"][key])
                assert err <= 1e-5, f"{name}: the state dict at the epoch's end differs from ddp's by {err:.2e}"
                assert relative_error(value, reference["state"][key].float()) <= 1e-5, key
            err = relative_error(torch.tensor(run["norms"]), torch.tensor(reference["norms"]))
            assert err <= 1e-5, f"{name}: the logged norms differ from one process's by {err:.2e}"
            assert set(run["weight_norms"]) == set(reference["weight_norms"]), name
            for key, ref in reference["weight_norms"].items():
                err = relative_error(run["weight_norms"][key], ref)
                assert err <= 1e-5, f"{name}: parameter_norms()[{key!r}] differs from one process's by {err:.2e}"
            for ema, ref in zip(run["ema"], reference["ema"], strict=True):
                assert relative_error(ema, ref) <= 1e-5, f"{name}: the EMA differs from one process's"
            assert torch.equal(run["frozen"], torch.linspace(1.0, 2.0, 9)), name


def test_a_modifier_rank_writes_every_rank_s_shards(ranks):
    results = ranks(_modified_worker, 2)
    for result in results:
        assert torch.equal(result["seen"], torch.full_like(result["seen"], 0.01))  # every rank sees rank 0's
        assert torch.equal(result["state"]["net.blocks.1.lin.weight"], results[0]["state"]["net.blocks.1.lin.weight"])
    moved = results[0]["state"]["net.blocks.1.lin.weight"]
    assert not torch.equal(moved, torch.full_like(moved, 0.01))  # trained on from the written values


class PenaltyMLP(pl.LightningModule):
    """A 2-block MLP with LayerNorm whose head is a unit of its own (``unit_min_params=64``), trained with an L2
    penalty over ``self.parameters()`` and reading the whole model in ``training_step`` as a ddp user does: the
    head is still gathered when the penalty reads it after the forward, so nothing but the read keeps it so."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(2)
        )
        self.head = torch.nn.Linear(16, 4)
        g = torch.Generator().manual_seed(5)
        self.data = torch.utils.data.TensorDataset(
            torch.randn(36, 16, generator=g), torch.randint(4, (36,), generator=g)
        )
        self.vector_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = x + block(x)
        loss = torch.nn.functional.cross_entropy(self.head(x), y)
        loss = loss + PENALTY * sum(p.pow(2).sum() for p in self.parameters())
        self.vector_norms.append(float(torch.nn.utils.parameters_to_vector(self.parameters()).detach().norm()))
        self.state_sum = float(sum(v.sum() for v in self.state_dict().values()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = torch.utils.data.DistributedSampler(self.data, world, rank, shuffle=False)
        return torch.utils.data.DataLoader(self.data, batch_size=12 // world, sampler=sampler)


def _penalty_fit(rank: int, world: int) -> dict:
    pl.seed_everything(0)
    module = PenaltyMLP()
    strategy = (
        zero_strategy(3, param_persistence_threshold=0, unit_min_params=64, reduce_bucket_size=40)
        if world > 1
        else "auto"
    )
    trainer = make_trainer(strategy, world, steps=3, accumulate=1, clip=None)
    trainer.fit(module)
    return {
        "state": {k: v.float() for k, v in full_state(trainer.strategy).items()},
        "vector_norms": module.vector_norms,
        "state_sum": module.state_sum,
    }


def test_a_penalty_over_every_parameter_with_every_unit_gathered_and_freed(ranks):
    reference = _penalty_fit(0, 1)
    for world in (2, 4):
        for rank, run in enumerate(ranks(_penalty_fit, world)):
            for key, value in reference["state"].items():
                err = relative_error(run["state"][key], value)
                assert err <= 1e-5, f"{world} ranks, rank {rank}: {key} differs from one process's by {err:.2e}"
            err = relative_error(torch.tensor(run["vector_norms"]), torch.tensor(reference["vector_norms"]))
            assert err <= 1e-5, f"{world} ranks: the parameters' norm read in a step differs by {err:.2e}"
            assert abs(run["state_sum"] - reference["state_sum"]) <= 1e-5 * abs(reference["state_sum"]), world

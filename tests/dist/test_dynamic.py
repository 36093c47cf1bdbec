"""Dynamic models under ZeRO: ranks that run different units and parameters in the same step issue the
same collectives in the same order, never hang, and train exactly as one process does.

Each run records every collective the strategy issues on each rank (``collectives.record``) and
asserts the sequences are identical; each stage-3 case runs with the defaults (small units stay
gathered) and with units really gathered and freed (persistence threshold 0, a live budget of about
two units). Every multi-process run is bounded by the process group's timeout and a deadline.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.sharding import collectives
from tests.support import dynamic_models
from tests.support.compare import relative_error
from tests.support.dynamic_models import DynamicModule
from tests.support.helpers import make_trainer, zero_strategy

STEPS = 6
KINDS = ("branch", "moe", "experts", "skip", "twice", "checkpoint", "reentrant", "container")
CLIP = 1.0


def _unit_budget(module: DynamicModule) -> int:
    """About two units' elements: units are the children of the ModuleLists (padding included)."""
    sizes = [
        sum(p.numel() for p in child.parameters())
        for m in module.modules()
        if isinstance(m, torch.nn.ModuleList)
        for child in m.children()
    ]
    return 2 * max(sizes) + 64


# The models whose blocks the engine's activation checkpointing takes (the others checkpoint themselves): blocks
# recomputed in backward on the ranks that ran them only, twice, or returning a dataclass, with units really gathered.
CHECKPOINTED = {
    "branch": {"activation_checkpointing": "units", "offload_activations": "cpu"},
    "moe": {"activation_checkpointing": "selective"},
    "experts": {"activation_checkpointing": "units"},
    "skip": {"activation_checkpointing": "units", "offload_activations": "cpu"},
    "twice": {"activation_checkpointing": "selective", "offload_activations": "cpu"},
    "container": {"activation_checkpointing": "units"},
}


# On 4 ranks (the slowest on 2 cores) the checkpointed runs of the models whose ranks run different blocks
CHECKPOINTED_AT_4 = ("branch", "experts")


def _configs(module: DynamicModule, world: int = 2):
    tight = {"param_persistence_threshold": 0, "max_live_parameters": _unit_budget(module)}
    yield "zero2", 2, {"reduce_bucket_size": 100}
    yield "zero3", 3, {}
    yield "zero3-tight", 3, tight
    if module.kind in CHECKPOINTED and (world == 2 or module.kind in CHECKPOINTED_AT_4):
        yield "zero3-tight-checkpointed", 3, {**tight, **CHECKPOINTED[module.kind]}


class SameLaunchOrder(pl.Callback):
    """After each optimizer step, before the next backward launches anything: every rank launches its gradient
    buckets' reduce-scatters in the same order (grad_reduce.py's order, agreed after the first backward; a
    rank-dependent order issues mismatched collectives, which gloo answers with an abort or a hang)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        order = [(unit.names[0], bucket.start) for unit, bucket in trainer.strategy.engine.reducer.order]
        orders = collectives.all_gather_object(order)
        first = next((k for k in range(len(order)) if len({o[k] for o in orders}) > 1), None)
        assert first is None, (
            f"the ranks launch reduce-scatters in different bucket orders at step {trainer.global_step}: the"
            f" {first}-th launch is {[o[first] for o in orders]} (rank by rank)"
        )


def _worker(rank: int, world: int, out_dir) -> None:
    for kind in KINDS:
        forwards = {}
        for name, stage, config in _configs(DynamicModule(kind), world):
            pl.seed_everything(0)
            module = DynamicModule(kind, steps=STEPS)
            callbacks = [SameLaunchOrder()]
            trainer = make_trainer(zero_strategy(stage, **config), world, steps=STEPS, clip=CLIP, callbacks=callbacks)
            dynamic_models.trace.clear()
            runs = []  # block 0's forwards: twice as many with checkpointing (its recomputation in backward)
            module.net.blocks[0].register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
            with collectives.record() as log:
                trainer.fit(module)
            forwards[name] = len(runs)
            if name == "zero3-tight-checkpointed":
                assert forwards[name] == 2 * forwards["zero3-tight"], (kind, forwards)
            sequences = collectives.all_gather_object(log)
            problem = collectives.first_divergence(sequences)
            assert problem is None, f"{kind} {name}: {problem}"
            traces = collectives.all_gather_object(list(dynamic_models.trace))
            state = trainer.strategy.gather_module().state_dict()
            torch.save(
                {"state": state, "ranks_differed": len({tuple(t) for t in traces}) > 1, "collectives": len(log)},
                out_dir / f"{kind}-{name}-{rank}.pt",
            )


@functools.cache
def _reference(kind: str):
    pl.seed_everything(0)
    module = DynamicModule(kind, steps=STEPS)
    make_trainer("auto", 1, steps=STEPS, clip=CLIP).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("world", [2, 4])
def test_dynamic_models_match_single_process_with_one_collective_schedule(ranks, world, tmp_path):
    ranks(_worker, world, tmp_path)
    for kind in KINDS:
        reference = _reference(kind)
        for name, _, _ in _configs(DynamicModule(kind), world):
            results = [torch.load(tmp_path / f"{kind}-{name}-{r}.pt") for r in range(world)]
            assert results[0]["collectives"] > 0
            if kind in ("branch", "moe", "experts", "skip"):
                assert results[0]["ranks_differed"], f"{kind}: the ranks never ran different parts; the test is moot"
            for r, result in enumerate(results):
                assert list(result["state"]) == list(reference)
                for key, ref in reference.items():
                    assert torch.equal(result["state"][key], results[0]["state"][key]), (kind, name, key, r)
                    err = relative_error(result["state"][key], ref)
                    assert err <= 1e-5, f"{kind} {name} world {world}: {key} differs from one process by {err:.2e}"


class Diverge(pl.Callback):
    """Makes rank 0's record of collectives differ before step 3 (as a rank-dependent collective would)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 4 and trainer.global_rank == 0:
            trainer.strategy.engine.collective_check.log.append(("all_reduce", "world", 1, "torch.float32"))


def _check_worker(rank: int, world: int) -> None:
    pl.seed_everything(0)
    strategy = zero_strategy(3, param_persistence_threshold=0, check_collectives=True)
    make_trainer(strategy, world, steps=STEPS).fit(DynamicModule("experts", steps=STEPS))  # no false alarm
    strategy = zero_strategy(3, param_persistence_threshold=0, check_collectives=True)
    with pytest.raises(RuntimeError, match=r"different collectives before global step 2: collective #\d+ differs"):
        make_trainer(strategy, world, steps=STEPS, callbacks=[Diverge()]).fit(DynamicModule("experts", steps=STEPS))


def test_check_collectives_names_the_first_difference_on_every_rank(ranks):
    ranks(_check_worker, 2)

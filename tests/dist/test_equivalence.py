"""Sharded training equals single-process training (fp32), and every rank holds the same parameters.

Stages 1, 2 and 3, world sizes 2 and 4, 20 AdamW steps (two param groups, a per-step LR schedule) with
gradient accumulation and norm clipping, on the small GPT (built on the meta device and initialized
shard by shard for stage 3), on ToyNet (tied weights, a frozen layer, odd sizes, parameters unused in
some steps or on some ranks, a buffer; also with SGD + momentum, FusedAdamW, and clipping by value) and on
BlocksNet (stage 3's units: ties across units, a frozen parameter inside a unit, a unit run twice per
forward, a unit run only on some steps, a parameter read outside its module). Small buckets put
parameters across chunk and bucket borders.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from tests.support.compare import full_state, relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

CLIP = 0.3
STEPS = 20
BUCKET = {"gpt": 3000, "toy": 50, "blocks": 40}
# (model, optimizer, clipping algorithm, stages); stage 3 builds the GPT on the meta device
RUNS = [
    ("gpt", "adamw", "norm", (1, 2, 3)),
    ("toy", "adamw", "norm", (1, 2, 3)),
    ("toy", "sgd", "norm", (1, 2)),
    ("toy", "fusedadamw", "norm", (2,)),
    ("toy", "adamw", "value", (1, 2)),
    ("blocks", "adamw", "norm", (1, 2, 3)),
    ("blocks", "sgd", "value", (3,)),
]
CLIP_VALUE = 0.02
# The GPT's runs also check activation checkpointing (activations/checkpointing.py): each against the same
# single-process run without it, so checkpointing, its selective policy and its host offload change nothing.
GPT_ACTIVATIONS = {  # (world, stage) -> ZeroConfig fields; plain blocks and ToyNet cover every stage without
    (2, 1): {"activation_checkpointing": "units"},
    (2, 2): {"activation_checkpointing": "selective", "offload_activations": "cpu"},
    (2, 3): {"activation_checkpointing": "units", "offload_activations": "cpu"},
    (4, 1): {"activation_checkpointing": "selective"},
    (4, 2): {"activation_checkpointing": "units", "offload_activations": "cpu"},
    (4, 3): {"activation_checkpointing": "selective", "offload_activations": "cpu"},
}
# At 4 ranks (on 2 cores, the slowest) the runs whose partitions differ with the world size; optimizer and
# clipping variants are the same code at any world size and run at 2.
RUNS_AT_4 = [run for run in RUNS if run[1:3] == ("adamw", "norm")]


def _runs(world: int) -> list:
    return RUNS_AT_4 if world == 4 else RUNS


class RanksAgree(pl.Callback):
    """After every optimizer step, asserts all ranks hold bitwise identical (full) parameters, as the
    strategy's state dict reports them (stage 3 gathers it unit by unit)."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.state = full_state(trainer.strategy)
        assert list(self.state) == list(pl_module.state_dict(keep_vars=True))  # (the keys: no value read)
        flat = torch.cat([v.reshape(-1).float() for v in self.state.values()])
        gathered = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, flat)
        for r, other in enumerate(gathered):
            assert torch.equal(other, flat), (
                f"rank {r} differs from rank {trainer.global_rank} at step {trainer.global_step}"
            )
        self.checked += 1
        activations = trainer.strategy.engine.activations  # (checkpointed blocks, and the host pool's bytes)
        self.checkpointed = (
            (len(activations.modules), trainer.strategy.memory_bytes().get("host_activations", 0))
            if activations
            else (0, 0)
        )


def _trainer(strategy, devices: int, algorithm: str, callbacks=()):
    clip = CLIP if algorithm == "norm" else CLIP_VALUE
    return make_trainer(
        strategy, devices, steps=STEPS, clip=clip, gradient_clip_algorithm=algorithm, callbacks=callbacks
    )


def _worker(rank: int, world: int, out_dir) -> None:
    for kind, optimizer, algorithm, stages in _runs(world):
        for stage in stages:
            pl.seed_everything(0)
            module = EquivalenceModule(kind, steps=STEPS, optimizer=optimizer, lazy=stage == 3)
            agree = RanksAgree()
            # ToyNet is one small unit, kept gathered (persistent); the others are gathered on demand.
            config = {"reduce_bucket_size": BUCKET[kind]}
            if kind != "toy":
                config["param_persistence_threshold"] = 0
            if kind == "gpt":
                config.update(GPT_ACTIVATIONS[world, stage])
            trainer = _trainer(zero_strategy(stage, **config), world, algorithm, [agree])
            trainer.fit(module)
            assert agree.checked == STEPS
            asked = GPT_ACTIVATIONS[world, stage] if kind == "gpt" else {}
            blocks, host_bytes = agree.checkpointed
            assert blocks == (module.gpt_config.n_layer if asked else 0) and (host_bytes > 0) == (
                "offload_activations" in asked
            )
            # After fit a stage-3 module stays sharded until asked; made whole, it equals the last gathered state.
            state = trainer.strategy.gather_module().state_dict()
            assert all(torch.equal(state[k].float(), v.float()) for k, v in agree.state.items())
            torch.save(
                {"state": state, "norms": module.grad_norms},
                out_dir / f"{kind}-{optimizer}-{algorithm}-{stage}-{rank}.pt",
            )


@functools.cache
def _reference(kind: str, optimizer: str, algorithm: str):
    pl.seed_everything(0)
    module = EquivalenceModule(kind, steps=STEPS, optimizer=optimizer)
    _trainer("auto", 1, algorithm).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}, module.grad_norms, module.grad_max


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_training_matches_single_process(ranks, world, tmp_path):
    ranks(_worker, world, tmp_path)
    for kind, optimizer, algorithm, stages in _runs(world):
        ref_state, ref_norms, ref_max = _reference(kind, optimizer, algorithm)
        # Clipping must be active for the test to mean anything.
        assert len(ref_norms) == STEPS and (max(ref_norms) > CLIP if algorithm == "norm" else max(ref_max) > CLIP_VALUE)
        for stage in stages:
            results = [torch.load(tmp_path / f"{kind}-{optimizer}-{algorithm}-{stage}-{r}.pt") for r in range(world)]
            for r, result in enumerate(results):
                assert list(result["state"]) == list(ref_state)
                for name, ref in ref_state.items():
                    assert torch.equal(result["state"][name], results[0]["state"][name]), (name, r)
                    err = relative_error(result["state"][name], ref)
                    assert err <= 1e-5, (
                        f"{kind}/{optimizer}/{algorithm} stage {stage} rank {r}: {name} differs by {err:.2e}"
                    )
                norm_err = relative_error(torch.tensor(result["norms"]), torch.tensor(ref_norms))
                assert norm_err <= 1e-5, (
                    f"{kind}/{optimizer}/{algorithm} stage {stage}: grad norms differ by {norm_err:.2e}"
                )

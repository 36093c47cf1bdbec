"""Sharded training equals single-process training (fp32), and every rank holds the same parameters.

Stages 1 and 2, world sizes 2 and 4, 20 AdamW steps (two param groups, a per-step LR schedule) with
gradient accumulation and norm clipping, on the small GPT and on ToyNet (tied weights, a frozen
layer, odd sizes, parameters unused in some steps or on some ranks, a buffer); ToyNet also with SGD
+ momentum and with clipping by value. Small buckets put parameters across chunk and bucket borders.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import EquivalenceModule, make_trainer, relative_error, spawn_ranks, zero_strategy

CLIP = 0.3
STEPS = 20
BUCKET = {"gpt": 3000, "toy": 50}
# (model, optimizer, clipping algorithm); each runs at stages 1 and 2
RUNS = [("gpt", "adamw", "norm"), ("toy", "adamw", "norm"), ("toy", "sgd", "norm"), ("toy", "adamw", "value")]
CLIP_VALUE = 0.02


class RanksAgree(pl.Callback):
    """After every optimizer step, asserts all ranks hold bitwise identical parameters."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, flat)
        for r, other in enumerate(gathered):
            assert torch.equal(other, flat), (
                f"rank {r} differs from rank {trainer.global_rank} at step {trainer.global_step}"
            )
        self.checked += 1


def _trainer(strategy, devices: int, algorithm: str, callbacks=()):
    clip = CLIP if algorithm == "norm" else CLIP_VALUE
    return make_trainer(
        strategy, devices, steps=STEPS, clip=clip, gradient_clip_algorithm=algorithm, callbacks=callbacks
    )


def _worker(rank: int, world: int, out_dir) -> None:
    for kind, optimizer, algorithm in RUNS:
        for stage in (1, 2):
            pl.seed_everything(0)
            module = EquivalenceModule(kind, steps=STEPS, optimizer=optimizer)
            agree = RanksAgree()
            trainer = _trainer(zero_strategy(stage, reduce_bucket_size=BUCKET[kind]), world, algorithm, [agree])
            trainer.fit(module)
            assert agree.checked == STEPS
            state = trainer.strategy.lightning_module_state_dict()
            assert list(state) == list(module.state_dict())
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


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_training_matches_single_process(world, tmp_path):
    spawn_ranks(_worker, world, tmp_path)
    for kind, optimizer, algorithm in RUNS:
        ref_state, ref_norms, ref_max = _reference(kind, optimizer, algorithm)
        # Clipping must be active for the test to mean anything.
        assert len(ref_norms) == STEPS and (max(ref_norms) > CLIP if algorithm == "norm" else max(ref_max) > CLIP_VALUE)
        for stage in (1, 2):
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

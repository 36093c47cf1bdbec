"""Quantized weight gathers (ZeRO++'s qwZ, ``ZeroConfig(quantized_weights=True)``) on 2 ranks:

- one gather's error: every element dequantized from the int8 gather is within half a step of its block
  (its rank's block's largest magnitude / 254) of the exact gather's value, and every rank holds the same;
- a GPT trained at zero3 with it sends at most 0.3x the all-gather bytes of the exact run, issues the same
  collectives on every rank (``check_collectives``), and ends within 2% of the exact run's loss;
- what is read outside the step is exact: ``full_state_dict()`` equals the norms of the fp32 masters
  (``parameter_norms``, read from the shards) and the consolidated checkpoint, both ranks alike;
- ``gathered_parameters(..., modifier_rank=0)`` inside a step refuses to write quantized values back, and so
  does a write found inside ``gathered_parameters`` there.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn

import lightning_zero
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import build_layout
from lightning_zero.sharding.quantize import LEVELS
from tests.support.compare import full_state
from tests.support.helpers import EquivalenceModule, TrafficPerStep, make_trainer, zero_strategy

BLOCK, STEPS = 64, 6


def _one_gather(rank: int, world: int) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(37, 11) * 10.0**k) for k in range(-2, 2)]
    layout = build_layout([p.numel() for p in params], world, 10**9)
    unit = FlatUnit(params, [f"p{k}" for k in range(4)], layout, rank, shard_params=True, trainable=False)
    unit.unshard(async_op=False)
    exact = unit.flat_param.clone()
    unit.reshard()
    unit.unshard(async_op=False, quantize_block=BLOCK)
    assert unit.quantized_values
    quantized = unit.flat_param.clone()
    unit.reshard()
    rows = exact.view(world, -1)
    blocks = -(-rows.shape[1] // BLOCK)
    padded = torch.zeros(world, blocks * BLOCK)
    padded[:, : rows.shape[1]] = rows
    absmax = padded.view(world, blocks, BLOCK).abs().amax(dim=2)
    bound = (absmax / LEVELS / 2).repeat_interleave(BLOCK, dim=1)[:, : rows.shape[1]].reshape(-1)
    error = (quantized - exact).abs()
    assert torch.all(error <= bound * (1 + 1e-5) + 1e-7), float((error - bound).max())
    assert error.max() > 0
    assert collectives.all_gather_object(quantized.tolist()) == [quantized.tolist()] * world


def test_one_quantized_gather_is_within_half_a_step(ranks):
    ranks(_one_gather, 2)


class WritesInAStep(EquivalenceModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1 and self.trainer.strategy.config.quantized_weights:
            with pytest.raises(RuntimeError, match="quantized values in the master weights"):
                with lightning_zero.gathered_parameters(self, self.net.ln_f, modifier_rank=0):
                    pass
            with pytest.raises(RuntimeError, match="quantized values in the master weights"):  # a write found
                with lightning_zero.gathered_parameters(self, self.net.ln_f):
                    self.net.ln_f.weight.data.mul_(2)
            self.net.ln_f.weight.data.mul_(0.5)  # (exactly the step's values again)
            self.refused = True
        return loss


def _fit(world: int, quantized: bool, root) -> dict:
    pl.seed_everything(0)
    module = WritesInAStep("gpt", steps=STEPS, n_layer=2)
    traffic = TrafficPerStep()
    strategy = zero_strategy(
        3,
        param_persistence_threshold=0,
        quantized_weights=quantized,
        quantization_block_size=BLOCK,
        check_collectives=True,
    )
    trainer = make_trainer(strategy, world, steps=STEPS, callbacks=[traffic])
    trainer.fit(module)
    state = full_state(strategy)
    norms = strategy.parameter_norms()
    path = root / f"q{int(quantized)}.ckpt"
    trainer.save_checkpoint(path)
    return {
        "losses": module.losses,
        "state": state,
        "norms": norms,
        "gathered": [step["all_gather"] for step in traffic.per_step],
        "gathered_bytes": trainer.strategy.traffic.bytes["all_gather"],
        "refused": getattr(module, "refused", False),
        "checkpoint": path,
    }


def _training(rank: int, world: int, root) -> dict:
    return {"exact": _fit(world, False, root), "quantized": _fit(world, True, root)}


def test_training_with_quantized_gathers(ranks, tmp_path):
    results = ranks(_training, 2, tmp_path)
    for rank, result in enumerate(results):
        exact, quantized = result["exact"], result["quantized"]
        assert quantized["refused"], rank
        ratio = quantized["gathered_bytes"] / exact["gathered_bytes"]
        assert ratio <= 0.3, f"rank {rank}: quantized gathers sent {ratio:.3f}x the exact ones' bytes"
        final = (sum(quantized["losses"][-4:]), sum(exact["losses"][-4:]))
        assert abs(final[0] - final[1]) <= 0.02 * final[1], final
        assert quantized["losses"] != exact["losses"]  # it did quantize the forward
        for key, value in quantized["state"].items():
            assert torch.equal(value, results[0]["quantized"]["state"][key]), (rank, key)
        # read outside the step: the fp32 masters, exactly
        named = {k: v for k, v in quantized["norms"].items() if k.startswith("weight_2.0_norm/")}
        assert len(named) >= 10
        for key, norm in named.items():
            value = quantized["state"][key.removeprefix("weight_2.0_norm/")]
            assert torch.allclose(value.norm(), norm, rtol=1e-6), key
    consolidated = torch.load(
        consolidate(results[0]["quantized"]["checkpoint"], tmp_path / "out.ckpt"), weights_only=True
    )
    for key, value in results[0]["quantized"]["state"].items():
        assert torch.equal(consolidated["state_dict"][key], value), key

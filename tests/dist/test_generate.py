"""``generate()`` inside ``validation_step`` under stage 3 with every unit really gathered and freed: the tokens
equal one process's, and a validation step gathers each unit at most twice, however many tokens it generates
(from its second pass on a forward-only step keeps its units gathered while they fit ``max_live_parameters``:
stage3_schedule.py). A write
inside ``gathered_parameters`` there is refused on every rank (only training steps and between steps keep one)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import lightning_zero
from lightning_zero.sharding import collectives
from tests.support.helpers import make_trainer, zero_strategy

pytest.importorskip("transformers")

from tests.support.hf_models import HFModule  # noqa: E402

NEW_TOKENS = 6


class Generates(HFModule):
    """Validation batch 0 runs one forward, the others ``generate()``: the all-gathers each issues are counted."""

    def __init__(self) -> None:
        super().__init__("gpt2", steps=2, accumulate=1, global_batch=4)
        self.tokens: list[torch.Tensor] = []
        self.gathers: list[int] = []

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        with collectives.record() as issued:
            if batch_idx == 0:
                self.model(input_ids=x)
            else:
                out = self.model.generate(x[:, :4], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                          do_sample=False, pad_token_id=0)  # fmt: skip
                self.tokens.append(out[:, 4:])
        self.gathers.append(sum(op == "all_gather" for op, *_ in issued))
        if batch_idx > 0 and isinstance(self.trainer.strategy, lightning_zero.ZeroStrategy):
            block = self.model.transformer.h[1]
            with pytest.raises(RuntimeError, match="inside a validation/test/predict step"):
                with lightning_zero.gathered_parameters(self, block):
                    block.mlp.c_fc.weight.data.mul_(2)  # (the step's copy, freed when it ends: shards intact)

    def val_dataloader(self):
        return self.train_dataloader()


def _validate(rank: int, world: int) -> dict:
    pl.seed_everything(0)
    module = Generates()
    strategy = zero_strategy(3, param_persistence_threshold=0) if world > 1 else "auto"
    make_trainer(strategy, world).validate(module)
    return {"tokens": torch.cat(module.tokens), "gathers": module.gathers}


def test_generate_gathers_each_unit_once_per_step_and_equals_one_process(ranks):
    reference = _validate(0, 1)
    results = ranks(_validate, 2)
    for rank, result in enumerate(results):
        assert torch.equal(result["tokens"], reference["tokens"][rank::2]), rank
        forward, *generates = result["gathers"]
        assert forward > 0 and generates, result["gathers"]
        assert all(g <= 2 * forward for g in generates), f"one forward gathers {forward}, generate() {generates}"

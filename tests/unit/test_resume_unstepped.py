"""A checkpoint saved while a parameter has never been stepped (it got no gradient yet) resumes and steps it: the step
reads every piece's optimizer state, which leaves an empty entry for such a piece, and a save must not write that as
state (a load would give it moments without a step count, and AdamW's next step would fail on the missing count)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from tests.support.helpers import make_trainer, world_of_one, zero_strategy

pytestmark = pytest.mark.unit


class LateLayer(pl.LightningModule):
    """``late`` gets its first gradient at the second step."""

    def __init__(self) -> None:
        super().__init__()
        self.early, self.late = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        out = self.early(batch[0])
        return (out if self.global_step == 0 else self.late(out)).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_parameter_never_stepped_when_saved_steps_after_the_resume(tmp_path, offload):
    with world_of_one():
        trainer = make_trainer(zero_strategy(2, offload_optimizer=offload), 1, steps=1, accumulate=1, clip=0.0)
        trainer.fit(LateLayer())
        trainer.save_checkpoint(tmp_path / "step1.ckpt")
        resumed = make_trainer(zero_strategy(2, offload_optimizer=offload), 1, steps=3, accumulate=1, clip=0.0)
        resumed.fit(LateLayer(), ckpt_path=tmp_path / "step1.ckpt")
        (zero,) = resumed.strategy.optimizers
        assert resumed.global_step == 3
        assert sorted(float(state["step"]) for state in zero.optimizer.state.values() if state) == [2.0, 2.0, 3.0, 3.0]

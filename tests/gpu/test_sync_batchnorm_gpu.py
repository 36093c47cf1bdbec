"""``sync_batchnorm=True`` on CUDA (skipped without a GPU; run by benchmarks/gpu_check.sh): BatchNorm becomes
torch's SyncBatchNorm under zero2 and zero3 (stage 3 gathering every unit) and trains as under ddp. (On the CPU
the strategies refuse it at set-up: tests/dist/test_lightning_model_features.py.)"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from tests.dist.test_lightning_model_features import Normed
from tests.support.compare import assert_close, whole_state
from tests.support.helpers import zero_strategy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _runs(rank: int, world: int, root) -> dict:
    out = {}
    for name in ("ddp", "zero2", "zero3"):
        pl.seed_everything(0)
        module = Normed()
        strategy = "ddp" if name == "ddp" else zero_strategy(int(name[-1]), param_persistence_threshold=0)
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="gpu",
            devices=world,
            sync_batchnorm=True,
            max_epochs=2,
            default_root_dir=root,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module)
        synced = any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())
        out[name] = {"synced": synced, "state": {k: v.cpu() for k, v in whole_state(trainer).items()}}
    return out


def test_sync_batchnorm_trains_as_under_ddp_on_cuda(ranks, tmp_path):
    (result,) = ranks(_runs, 1, tmp_path)
    for name in ("zero2", "zero3"):
        assert result[name]["synced"], f"{name}: no SyncBatchNorm in the model"
        for key, value in result["ddp"]["state"].items():
            assert_close(result[name]["state"][key], value, f"{name} with sync_batchnorm: {key} against ddp's")

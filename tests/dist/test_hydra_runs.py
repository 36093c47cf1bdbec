"""The Hydra example's composition on the shared ranks: another strategy group and precision than the launched
run (tests/e2e/test_hydra.py), built and trained by the app's own function."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

from tests.support.helpers import hydra_app_config

SHORT = ["model=tiny", "model.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2"]


def _run(rank: int, world: int, root) -> str:
    config, app = hydra_app_config(*SHORT, "strategy=zero1", "precision=16-mixed")
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        app(config)
    return out.getvalue()


def test_strategy_and_precision_groups(ranks, tmp_path):
    printed, _ = ranks(_run, 2, tmp_path)
    assert "zero1: 2 ranks, precision 16-mixed" in printed and "throughput:" in printed, printed[-3000:]

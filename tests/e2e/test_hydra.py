"""The Hydra example, launched as a user runs it: configs/hydra/ composed with the README's override, 2 ranks
(Lightning re-runs the app for rank 1). Another composition runs on the shared ranks
(tests/dist/test_hydra_runs.py); a bad value is refused in-process (tests/unit/test_hydra_config.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.helpers import REPO

SHORT = ["model=tiny", "model.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2"]


def test_the_example_override_runs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "examples/hydra_app.py", *SHORT, "strategy.stage=3", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "zero3: 2 ranks, precision 32-true" in out and "throughput:" in out

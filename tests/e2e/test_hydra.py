"""The Hydra example composes the Trainer, the strategy and the model from configs/hydra/, with overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hydra  # noqa: F401  (the optional extra 'hydra'; the test extra installs it)
import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["model=tiny", "model.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2"]


def _app(*overrides: str, run_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "examples/hydra_app.py", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# The default composition (zero2, fp32) is the main job's, run through the CLI in test_cli.py.
@pytest.mark.parametrize(
    "overrides,heading",
    [
        (["strategy.stage=3"], "zero3: 2 ranks, precision 32-true"),  # the example override
        (["strategy=zero1", "precision=16-mixed"], "zero1: 2 ranks, precision 16-mixed"),
    ],
)
def test_composed_runs(overrides, heading, tmp_path):
    result = _app(*SHORT, *overrides, run_dir=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert heading in out and "throughput:" in out


def test_bad_value_fails_before_any_process_starts(tmp_path):
    result = _app(*SHORT, "strategy.config.reduce_bucket_size=-1", run_dir=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "zero.reduce_bucket_size must be an integer > 0 (elements), got -1" in result.stderr
    assert "Initializing distributed" not in result.stdout + result.stderr  # no process group was started

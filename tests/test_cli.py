"""The console script: --help, and the README's main job run short through it (the real launcher:
rank 1 is started by Lightning re-running the command)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("lightning-zero")


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_console_script_help():
    result = _run("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for sub in ("fit", "validate", "test", "predict"):
        assert sub in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,heading",
    [
        ("configs/gpt_zero2_cpu.yaml", "zero2: 2 ranks, precision 32-true"),
        ("configs/gpt_zero2_fp16.yaml", "zero2: 2 ranks, precision 16-mixed"),
        ("configs/gpt_zero3_cpu.yaml", "zero3: 2 ranks, precision 32-true"),
    ],
)
def test_main_job_short_run(config, heading, tmp_path):
    result = _run(
        "fit",
        "--config",
        config,
        "--trainer.max_steps=12",
        "--trainer.val_check_interval=6",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert heading in out
    assert "throughput:" in out and "tokens/s" in out
    assert "rank 1" in out and "formula" in out

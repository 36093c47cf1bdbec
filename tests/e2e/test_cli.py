"""The console script runs the README's main job, its command taken from the README (zero2, the small GPT, 2
ranks: rank 1 is started by Lightning re-running the command), short, with a clean console. The other stages,
precisions and configs run through ``main()`` on the shared ranks (tests/dist/test_cli_runs.py); --help and
estimate in-process (tests/unit/test_cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.docs import snippet_command
from tests.support.helpers import REPO

SCRIPT = Path(sys.executable).with_name("lightning-zero")
SHORT = ["--trainer.max_steps=12", "--trainer.val_check_interval=6", "--trainer.limit_val_batches=2"]


def test_main_job_short_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    program, *args = snippet_command("main-job")  # the README's command, shortened
    assert program == SCRIPT.name, program
    command = [str(SCRIPT), *args, *SHORT, f"--trainer.default_root_dir={tmp_path}"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out, heading = result.stdout + result.stderr, "zero2: 2 ranks, precision 32-true"
    assert heading in out
    assert "throughput:" in out and "tokens/s" in out
    assert "rank 1" in out and "formula" in out
    # A clean console: the summary ends the output (the bar's last frame comes before it), no warnings.
    assert "Epoch 0/-2" not in out and "step: 12/12" in out
    assert result.stdout.rindex("step: 12/12") < result.stdout.index(heading), result.stdout[-1500:]
    assert "Warning" not in out, out[-3000:]

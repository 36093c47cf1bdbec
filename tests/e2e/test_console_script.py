"""The console script answers bad input as ``main()`` does in-process (tests/unit/test_bad_input.py): one line
on stderr (not even Lightning's), exit code 2, nothing written; two commands run side by side."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from lightning_zero.cli.main import DEBUG_ENV
from tests.support.helpers import REPO, poison_checkpoint, snapshot_files

SCRIPT = Path(sys.executable).with_name("lightning-zero")
STAGE_HINT = "(the stage is chosen with --trainer.strategy zero1|zero2|zero3)"


def test_the_console_script_answers_bad_input_with_one_line(stage2_checkpoint, tmp_path):
    shutil.copytree(stage2_checkpoint, tmp_path / "run.ckpt")
    poison_checkpoint(tmp_path / "run.ckpt", tmp_path / "marker")
    fit = [SCRIPT, "fit", "--config", REPO / "configs" / "gpt.yaml", "--zero.stage", "4"]
    consolidate = [sys.executable, "-m", "lightning_zero.cli.main", "consolidate", "run.ckpt", "out.pt"]
    expected = [
        (fit, f"lightning-zero fit: error: unrecognized arguments: --zero.stage 4 {STAGE_HINT}"),
        (consolidate, "lightning-zero consolidate: error: "),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(DEBUG_ENV, None)
    before = snapshot_files(tmp_path)
    runs = [
        (subprocess.Popen(list(map(str, command)), cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True), line)
        for command, line in expected
    ]
    for process, line in runs:
        _, err = process.communicate(timeout=240)
        assert process.returncode == 2 and len(err.strip().splitlines()) == 1 and line in err, err
    assert "--trust-pickles" in err and not (tmp_path / "marker").exists()
    assert snapshot_files(tmp_path) == before

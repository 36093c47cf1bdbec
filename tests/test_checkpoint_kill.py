"""kill -9 at random moments, during steps and during saves: every checkpoint that is visible is complete
and intact, and the latest one always loads and resumes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import spawn_ranks
from kill_target import resume

from lightning_zero.checkpoint.format import check_file, latest, read_metadata

TRIALS = 4


def _visible_checkpoints_are_intact(dirpath: Path) -> list[Path]:
    visible = [p for p in dirpath.iterdir() if not p.name.startswith(".")]
    for ckpt in visible:
        meta = read_metadata(ckpt)  # raises unless complete
        for name, expected in meta.files.items():
            check_file(ckpt, name, expected, checksum=True)
    return visible


@pytest.mark.slow
def test_kill_minus_nine_never_leaves_a_corrupt_checkpoint(tmp_path):
    rng = random.Random(1234)
    killed_during_save = 0
    for trial in range(TRIALS):
        dirpath = tmp_path / f"trial{trial}"
        dirpath.mkdir()
        target = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("kill_target.py")), str(dirpath)],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 120
        while time.time() < deadline and not any(not p.name.startswith(".") for p in dirpath.iterdir()):
            time.sleep(0.05)  # until the first checkpoint is complete
        time.sleep(rng.uniform(0.0, 3.0))
        os.killpg(target.pid, signal.SIGKILL)
        target.wait()
        killed_during_save += any(p.name.startswith(".") for p in dirpath.iterdir())
        visible = _visible_checkpoints_are_intact(dirpath)
        assert visible, f"trial {trial}: no checkpoint was completed before the kill"
        newest = latest(dirpath)
        step = read_metadata(newest).global_step
        assert newest in visible and step == max(read_metadata(p).global_step for p in visible)
        spawn_ranks(resume, 2, str(newest), step + 1)
    print(f"{killed_during_save} of {TRIALS} kills landed during a save")
    assert killed_during_save >= 1, "no kill hit a save: the test did not exercise it"

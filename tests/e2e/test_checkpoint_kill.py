"""kill -9 inside each phase of the save protocol (kill_target.py's observer of saves, save.py's [Note: observing a
save], stops a save at a chosen phase; the test kills the process group there): every visible checkpoint is complete
and intact, the name being replaced (last.ckpt) always holds the old or the new checkpoint, latest()
returns the newest, and resuming from it cleans up what the killed save left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_zero.checkpoint.format import latest, read_metadata
from tests.support.helpers import SUPPORT, verify_checkpoint
from tests.support.kill_target import train

# Per step the target saves epoch=0-step=N.ckpt, removes step N-1's, then overwrites last.ckpt. The n-th
# occurrence of a phase is chosen so that a step-1 checkpoint and last.ckpt exist when it is reached.
PHASES = {
    "prepared": 3,  # step 2's checkpoint: its hidden directory just created
    "shards": 3,  # every rank's shard written
    "metadata": 3,  # Lightning's state and the metadata written, COMPLETE not yet
    "complete": 3,  # COMPLETE written, not yet renamed into place
    "published": 3,  # renamed into place, the ranks not yet told
    "removing": 1,  # step 1's checkpoint renamed aside, not yet deleted
    "exchanged": 1,  # last.ckpt exchanged for step 2's: the old one is under the hidden name
}
# A background save's name stands in for the newest complete checkpoint until it is published over it (save.py's
# [Note: a background save's name]), an exchange too: last.ckpt's first save, then step 2's, come before.
ASYNC_NTH = {**PHASES, "exchanged": 3}


def _visible(dirpath: Path) -> dict[str, int]:
    """Every visible checkpoint, fully verified, by name -> global step."""
    steps = {}
    for ckpt in (p for p in dirpath.iterdir() if not p.name.startswith(".")):
        steps[ckpt.name] = verify_checkpoint(ckpt)
    return steps


def _kill_at(phase: str, nth: int, dirpath: Path, mode: str) -> None:
    marker = dirpath.parent / f"{phase}.paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    target = subprocess.Popen(
        [sys.executable, str(SUPPORT / "kill_target.py"), str(dirpath), mode, f"{phase}@{nth}:{marker}"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not marker.exists() and target.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(target.pid, signal.SIGKILL)
    target.wait()
    assert marker.exists(), f"the save never reached phase {phase!r} (exit code {target.returncode})"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("phase", PHASES)
def test_kill_during_each_phase_of_a_save(ranks, tmp_path, phase, mode):
    """``mode`` async: the same saves finishing in the background (ZeroConfig(async_save=True)) leave the same."""
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    _kill_at(phase, (ASYNC_NTH if mode == "async" else PHASES)[phase], dirpath, mode)
    visible = _visible(dirpath)
    assert "last.ckpt" in visible, f"{phase}: last.ckpt vanished: {sorted(visible)}"
    expected_last = 2 if phase == "exchanged" else 1
    assert visible["last.ckpt"] == expected_last
    assert set(visible) <= {"last.ckpt", "epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"}
    newest = latest(dirpath)
    assert newest is not None and newest.name in visible
    assert read_metadata(newest).global_step == max(visible.values())
    if phase == "exchanged":  # resuming cleans up what the killed save left (the old checkpoint, hidden)
        ranks(train, 2, str(dirpath), max(visible.values()) + 2, str(newest))
        assert not [p.name for p in dirpath.iterdir() if p.name.startswith(".")]
        assert _visible(dirpath)["last.ckpt"] == max(visible.values()) + 2

"""kill -9 inside each phase of the save protocol (kill_target.py's observer of saves, save.py's [Note: observing a
save], stops a save at a chosen phase; the test kills the process group there): every visible checkpoint is complete
and intact, the name being replaced (last.ckpt) always holds the old or the new checkpoint, latest()
returns the newest, and resuming from it cleans up what the killed save left. With the optimizer state on NVMe, a
kill halfway through a step leaves the last checkpoint intact."""

from __future__ import annotations

import contextlib
import json
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


@pytest.fixture(scope="module")
def targets():
    """kill_target.py's server of targets (imports once, forks one per save to kill)."""
    server = subprocess.Popen(
        [sys.executable, str(SUPPORT / "kill_target.py"), "--serve"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    yield server
    server.stdin.close()
    server.wait(timeout=60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_at(targets, phase: str, nth: int, dirpath: Path, mode: str) -> None:
    marker = dirpath.parent / f"{phase}.paused"
    targets.stdin.write(json.dumps([str(dirpath), mode, f"{phase}@{nth}:{marker}"]) + "\n")
    targets.stdin.flush()
    pid = int(targets.stdout.readline())
    deadline = time.time() + 120
    while not marker.exists() and _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):  # (a target that ended by itself: the assertion below says so)
        os.killpg(pid, signal.SIGKILL)
    while _alive(pid):
        time.sleep(0.01)
    assert marker.exists(), f"the save never reached phase {phase!r}"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("phase", PHASES)
def test_kill_during_each_phase_of_a_save(ranks, targets, tmp_path, phase, mode):
    """``mode`` async: the same saves finishing in the background (ZeroConfig(async_save=True)) leave the same."""
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    _kill_at(targets, phase, (ASYNC_NTH if mode == "async" else PHASES)[phase], dirpath, mode)
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


def test_kill_halfway_through_a_step_with_the_optimizer_state_on_nvme(ranks, targets, tmp_path):
    """Both ranks killed (SIGKILL) halfway through the third optimizer step, the state's chunks streaming through the
    swap files: the checkpoints are complete and intact (the last is the second step's), the swap files the kill left
    are removed by the next run's set-up, which resumes from it to the end."""
    dirpath, marker = tmp_path / "ckpts", tmp_path / "step.killed"
    dirpath.mkdir()
    targets.stdin.write(json.dumps([str(dirpath), "nvme", f"step@2:{marker}"]) + "\n")
    targets.stdin.flush()
    pid = int(targets.stdout.readline())
    deadline = time.time() + 120
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the target was not killed inside its third step"
    visible = _visible(dirpath)
    assert visible == {"last.ckpt": 2, "epoch=0-step=2.ckpt": 2}, visible
    left = set((tmp_path / "nvme").iterdir())
    assert left  # (a kill -9 skips the removal at exit)
    ranks(train, 2, str(dirpath), 4, str(latest(dirpath)), "nvme")
    assert _visible(dirpath)["last.ckpt"] == 4 and not left & set((tmp_path / "nvme").iterdir())

"""The writer of background saves (checkpoint/background.py) in one process: what follows a save runs only after
it succeeded (also when it finished before being asked), a failure is raised by ``wait``, host copies are taken
at save time and reused by the next save, and Lightning's state keeps its kinds and ties when copied."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.checkpoint.save import _copy_tensors

pytestmark = pytest.mark.unit


def test_deferred_work_follows_only_a_successful_save():
    saves, ran = BackgroundSaves(), []
    release = threading.Event()
    saves.start(lambda: release.wait())
    saves.defer(lambda: ran.append("after the first"))
    assert ran == []  # still in flight
    release.set()
    saves.wait()
    assert ran == ["after the first"]

    def fail():
        raise OSError("disk full")

    saves.start(fail)
    saves._thread.join()  # done (its error not yet raised) when ModelCheckpoint asks to remove the old best
    saves.defer(lambda: ran.append("after the failed one"))
    with pytest.raises(OSError, match="disk full"):
        saves.wait()
    assert ran == ["after the first"]  # the old checkpoint stays: the new one was never written
    saves.defer(lambda: ran.append("now"))
    assert ran[-1] == "now"  # no save in flight: at once


def test_host_copies_are_taken_at_save_time_and_reused():
    saves = BackgroundSaves()
    master = torch.arange(6.0)
    copy = saves.host_copy(master)
    master += 100  # training goes on
    assert torch.equal(copy, torch.arange(6.0))
    saves.start(lambda: None)
    saves.wait()
    again = saves.host_copy(master)
    assert again.data_ptr() == copy.data_ptr()  # the previous save's buffer
    zeros = saves.host_zeros(4, torch.float32)
    assert torch.equal(zeros, torch.zeros(4))
    saves.release()
    assert saves._pool == {} and saves._taken == {}  # released: nothing kept


def test_copied_state_keeps_its_kinds_and_ties():
    tied = torch.ones(3)
    state = OrderedDict(a=tied, b=tied, nested={"c": [torch.zeros(2), (torch.ones(1),)]})
    copied = _copy_tensors(state, lambda t: t.clone())
    assert type(copied) is OrderedDict and list(copied) == ["a", "b", "nested"]
    assert copied["a"] is copied["b"] and copied["a"] is not tied
    assert torch.equal(copied["nested"]["c"][1][0], torch.ones(1))

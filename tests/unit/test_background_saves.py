"""The writer of background saves (checkpoint/background.py) in one process: what follows a save runs only after
it succeeded (also when it finished before being asked), a failure is raised by ``wait``, the snapshot is awaited
before the state changes but the writing is not, host copies are reused by the next save, Lightning's state keeps
its kinds and ties when copied, and a synchronous save's files skip torch's per-record CRC (ours covers them)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.checkpoint.snapshot import copy_tensors

pytestmark = pytest.mark.unit


def test_deferred_work_follows_only_a_successful_save():
    saves, ran = BackgroundSaves(), []
    release = threading.Event()
    saves.start(lambda: None, lambda *_: release.wait())
    saves.defer(lambda: ran.append("after the first"))
    assert ran == []  # still in flight
    release.set()
    saves.wait()
    assert ran == ["after the first"]

    def fail(*_):
        raise OSError("disk full")

    saves.start(lambda: None, fail)
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
    saves.start(lambda: None, lambda *_: None)
    saves.wait()
    again = saves.host_copy(master)
    assert again.data_ptr() == copy.data_ptr()  # the previous save's buffer
    buffer = saves.host_empty(4, torch.float32)
    assert buffer.shape == (4,) and buffer.dtype == torch.float32
    saves.release()
    assert saves._pool == {} and saves._taken == {}  # released: nothing kept


def test_copied_state_keeps_its_kinds_and_ties():
    tied = torch.ones(3)
    state = OrderedDict(a=tied, b=tied, nested={"c": [torch.zeros(2), (torch.ones(1),)]})
    copied = copy_tensors(state, lambda t: t.clone())
    assert type(copied) is OrderedDict and list(copied) == ["a", "b", "nested"]
    assert copied["a"] is copied["b"] and copied["a"] is not tied
    assert torch.equal(copied["nested"]["c"][1][0], torch.ones(1))


def test_the_step_waits_for_the_snapshot_not_for_the_writing():
    saves, order = BackgroundSaves(), []
    copying, writing = threading.Event(), threading.Event()

    def snapshot():
        copying.wait()
        order.append("copied")
        return "taken"

    def work(taken, failure):
        order.append(f"writing what was {taken}")
        writing.wait()

    saves.start(snapshot, work)
    waiter = threading.Thread(target=lambda: (saves.wait_snapshot(), order.append("step")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and order == []  # the optimizer step waits while the copy is not taken
    copying.set()
    waiter.join()
    assert order[0] == "copied" and "step" in order and saves.in_flight  # the writing goes on
    assert saves.snapshot_wait_s > 0.1
    writing.set()
    saves.wait()
    saves.wait_snapshot()  # none in flight: at once


def test_a_synchronous_save_skips_torch_per_record_crc(tmp_path):
    import zipfile

    from lightning_zero.checkpoint.snapshot import zip_crc32

    tensors = {"a": torch.arange(1000.0)}
    with zip_crc32(False):
        torch.save(tensors, tmp_path / "fast.pt")
    assert torch.serialization.get_crc32_options()  # put back
    torch.save(tensors, tmp_path / "usual.pt")
    crcs = {
        n: {i.filename.split("/", 1)[1]: i.CRC for i in zipfile.ZipFile(tmp_path / n).infolist()}
        for n in ("fast.pt", "usual.pt")
    }
    assert crcs["fast.pt"]["data/0"] == 0 and crcs["usual.pt"]["data/0"] != 0
    assert torch.equal(torch.load(tmp_path / "fast.pt", weights_only=True, mmap=True)["a"], tensors["a"])


def test_a_failed_copy_still_reaches_the_writing():
    saves, seen = BackgroundSaves(), []

    def snapshot():
        raise RuntimeError("CUDA error: out of memory")

    saves.start(snapshot, lambda taken, failure: seen.append((taken, str(failure))))
    saves.wait_snapshot()  # never left waiting
    saves.wait()
    assert seen == [(None, "CUDA error: out of memory")]  # the writer reports it, so the ranks agree on it

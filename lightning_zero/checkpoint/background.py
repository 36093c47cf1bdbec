"""Saves that finish in the background (``ZeroConfig(async_save=True)``): the step that saves copies only
rank 0's Lightning state to host memory; a writer thread copies this rank's shards (the snapshot) and then
does the rest of the save protocol (save.py's [Note: the save protocol]) while training goes on.

[Note: background saves]
- The snapshot is taken beside the next step's forward and backward, which read the masters and the
  optimizer's state but do not change them (as DataStates-LLM's lazy copies): the next optimizer step waits
  for it (``wait_snapshot``, a step pre-hook of every ZeRO optimizer), so the copy holds the state as the
  saving step left it. On a CUDA device the writer copies on a stream of its own, after the work queued
  when the save was called. Whatever else changes the masters or the state (loading a checkpoint, the end
  of a run) waits for the whole save first.
- At most one save is in flight: the next save, the end of the run (``wait``) and a preemption wait for it.
- What must follow a save's success (ModelCheckpoint's removal of the checkpoint it replaces as the best, the
  generators recorded after a validation) is deferred to after it (``defer``), as a synchronous save orders it: a
  kill in between never leaves neither. It runs in the training thread once that learns the save succeeded
  (``wait``, so also ``poll``), never in the writer: a removal moves links (ModelCheckpoint's last.ckpt) that
  Lightning changes in the training thread.
- The writers agree on each phase's verdict over a group of their own (a gloo group of every rank, made at
  set-up, used by no one else), so their collectives never interleave with training's.
- Whether the save is done is agreed at a step boundary (``poll``: one MIN all-reduce of a flag per step while
  a save is in flight, issued by every rank at the same point), so a failed save raises its one-line
  ``CheckpointError`` on every rank at the same step, never on one rank while the others go on.
- A kill during a background save leaves exactly what a synchronous save killed at the same phase leaves: the
  writer runs the same phases on the same files.
- Host copies are reused from one save to the next (the previous save is done when the next copies), pinned
  when they come from a CUDA device, so a save of the same model allocates nothing after the first.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.sharding import collectives


class BackgroundSaves:
    """``group``: the writers' own group of every rank (None in a world of one); ``poll_group``: the training
    thread's group of every rank for CPU tensors (topology.py's ``host_world``; None: the world)."""

    def __init__(self, group=None, poll_group=None) -> None:
        self.group, self.poll_group = group, poll_group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pool: dict[tuple, list[Tensor]] = {}  # the previous save's host copies, by (shape, dtype, pinned)
        self._taken: dict[tuple, list[Tensor]] = {}
        self._snapshot = threading.Event()
        self.snapshot_wait_s = 0.0
        self._deferred: list[Callable[[], None]] = []  # what follows the success of the save in flight

    @property
    def in_flight(self) -> bool:
        """Whether a save's writing thread has been started and not yet waited for."""
        return self._thread is not None

    def release(self) -> None:
        """Frees the host copies kept for the next save (at the end of a run, once no save is in flight)."""
        self._pool, self._taken = {}, {}

    def host_copy(self, tensor: Tensor) -> Tensor:
        """A host copy of ``tensor`` that stays as it is while training changes ``tensor`` (see the Note)."""
        pinned = tensor.is_cuda
        copy = self._host_empty(tuple(tensor.shape), tensor.dtype, pinned)
        copy.copy_(tensor.detach(), non_blocking=pinned)
        return copy

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool = False) -> Tensor:
        """A host buffer for this save (one the previous save wrote, when it had one of this size)."""
        return self._host_empty((numel,), dtype, pinned)

    def _host_empty(self, shape: tuple, dtype: torch.dtype, pinned: bool) -> Tensor:
        key = (shape, dtype, pinned)
        free = self._pool.get(key)
        buffer = free.pop() if free else torch.empty(shape, dtype=dtype, pin_memory=pinned)
        self._taken.setdefault(key, []).append(buffer)
        return buffer

    def start(self, snapshot: Callable[[], Any], work: Callable[[Any, BaseException | None], None]) -> None:
        """Runs ``snapshot()`` (the host copies) and then ``work(what it returned, None)`` (the rest of a save) in
        the writer thread, or ``work(None, error)`` if the copy failed: ``work`` always runs, so the ranks' writers
        always agree. The next optimizer step waits for the snapshot (see the Note). A ``SaveJob`` hands over its
        ``snapshot`` and ``finish`` (save.py's [Note: a save as a job])."""
        queued = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the work queued so far on this rank's device: the state as the saving step leaves it. (A new thread
            # starts on device 0: the writer takes this one, as torch's pin-memory thread does.)
            queued = (torch.cuda.current_device(), torch.cuda.Event())
            queued[1].record()
        self._error = None
        self._snapshot = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(snapshot, work, queued), name="lightning_zero-save", daemon=True
        )
        try:
            self._thread.start()
        except BaseException as error:  # (no thread to be had): the rest here, so the ranks still agree, and
            self._thread = _Finished()  # its error is raised at the next step boundary, as the other ranks' are
            self._snapshot.set()
            try:
                work(None, error)
            except BaseException as failed:  # noqa: BLE001
                self._error = failed

    def wait_snapshot(self) -> None:
        """Returns once the save in flight, if any, has copied what it saves (before the state changes);
        ``snapshot_wait_s`` is how long the last call waited (benchmarks/checkpoint_speed.py reports it)."""
        if self._thread is not None:
            start = time.perf_counter()
            self._snapshot.wait()
            self.snapshot_wait_s = time.perf_counter() - start

    def _copy(self, snapshot: Callable[[], Any], queued: tuple | None) -> Any:
        try:
            if queued is None:
                return snapshot()
            device, event = queued
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            stream.wait_event(event)
            with torch.cuda.stream(stream):
                taken = snapshot()
            stream.synchronize()  # the copies have landed before the writer reads them
            return taken
        finally:
            self._pool, self._taken = self._taken, {}  # the next save reuses this one's copies
            self._snapshot.set()

    def _run(self, snapshot: Callable[[], Any], work: Callable[[Any, BaseException | None], None], queued) -> None:
        try:
            try:
                taken, failure = self._copy(snapshot, queued), None
            except BaseException as error:  # noqa: BLE001 - reported through ``work``, which the ranks agree on
                taken, failure = None, error
            _lower_priority()  # the writing yields to training where they share cores (the copy did not: it is awaited)
            work(taken, failure)
        except BaseException as error:  # noqa: BLE001 - raised in the training thread (poll, wait)
            self._error = error

    def defer(self, then: Callable[[], None]) -> None:
        """Runs ``then`` once the save in flight, if any, is known to have succeeded (``wait``; dropped if it failed),
        else now."""
        if self._thread is None:
            then()
        else:
            self._deferred.append(then)

    def poll(self) -> None:
        """At a step boundary, on every rank: once every rank's writer is done, its error (the same on every
        rank: the writers agreed on it) is raised here. Collective while a save is in flight."""
        if self._thread is None:
            return
        done = torch.tensor([0 if self._thread.is_alive() else 1], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            collectives.all_reduce(done, dist.ReduceOp.MIN, group=self.poll_group)
        if int(done.item()):
            self.wait()

    def wait(self) -> None:
        """Waits for the save in flight, if any; raises its error, or runs what was deferred to its success."""
        thread = self._thread
        if thread is None:
            return
        thread.join()
        self._thread = None
        error, deferred = self._error, self._deferred
        self._error, self._deferred = None, []
        if error is not None:
            raise error
        for then in deferred:
            then()


class _Finished:
    """Stands for a writer thread that has already finished (its work ran in the training thread)."""

    def is_alive(self) -> bool:
        return False

    def join(self) -> None:
        pass


def _lower_priority() -> None:
    """This thread at the lowest scheduling priority (Linux: a thread's nice value is its own), so that on cores
    training keeps busy the writer takes what training leaves; where the writer has cores of its own (a GPU
    node's) nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the writer keeps the training's priority
        pass


def background_saves(async_save: bool, timeout_s: float, poll_group) -> BackgroundSaves | None:
    """With ``ZeroConfig.async_save``: the writer and its own group of every rank (collective: made at set-up), its
    peers waited for at most ``timeout_s`` (``ZeroConfig.timeout``); ``poll_group``: the topology's ``host_world``."""
    if not async_save:
        return None
    many = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    timeout = timedelta(seconds=timeout_s)  # (torch's default would leave a lost peer's save waiting 30 min)
    group = torch.distributed.new_group(backend="gloo", timeout=timeout) if many else None
    return BackgroundSaves(group, poll_group=poll_group)

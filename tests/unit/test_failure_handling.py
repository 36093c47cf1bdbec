"""Telling a lost peer from other errors, refusing unknown signals, and a signal outside training (no handler
that runs a collective): the parts of failure handling that need no launch (tests/e2e/test_preemption.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import types

import pytest
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed import DistBackendError

from lightning_zero import PreemptionCheckpoint
from lightning_zero.resilience.peer_failure import peer_failure
from lightning_zero.resilience.preemption import end_on_signal_outside_training


def test_peer_failures_are_told_from_other_errors():
    """What gloo and NCCL say when a peer is gone, and errors that are not that (they keep their traceback)."""
    gloo_reset = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:30115:"
        " Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    assert peer_failure(RuntimeError(gloo_reset)) == "Read error [127.0.0.1]:30115: Connection reset by peer"
    timeout = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
    assert peer_failure(RuntimeError(timeout)) == "Timed out waiting 3000ms for recv operation to complete"
    wrapped = ValueError("while saving")
    wrapped.__cause__ = RuntimeError("Application timeout caused pair closure")
    assert peer_failure(wrapped) == "Application timeout caused pair closure"
    assert peer_failure(DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited")) is not None
    mismatch = "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 32 vs 16"
    invalid = DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage, NCCL version 2.27")
    for other in (RuntimeError("CUDA out of memory"), RuntimeError(mismatch), invalid, ValueError("bad")):
        assert peer_failure(other) is None


def test_preemption_callback_rejects_unknown_signals():
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE': name one like 'SIGTERM' or 'SIGUSR1'"):
        PreemptionCheckpoint(signals=("SIGNOPE",))


def _predicting_then_signalled() -> None:
    end_on_signal_outside_training(types.SimpleNamespace(state=types.SimpleNamespace(fn=TrainerFn.PREDICTING)))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)


def test_outside_training_a_signal_ends_the_process_at_once():
    """validate/test/predict and the sanity check: no handler that runs a collective, no signal ignored (in a
    process forked for it: the signal ends it)."""
    process = multiprocessing.get_context("fork").Process(target=_predicting_then_signalled)
    process.start()
    process.join(timeout=60)
    assert process.exitcode == -signal.SIGTERM, process.exitcode

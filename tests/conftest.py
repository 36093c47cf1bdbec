"""The test tiers and the fixtures every tier shares.

- ``tests/unit``: in one process: pure logic, configs, schedules, formats, the kernels' CPU references and
  emulator, the CLI through its ``main()``, error paths at world size 1;
- ``tests/dist``: real multi-process sharding, on the rank processes the whole run shares (``ranks``);
- ``tests/e2e``: whole launches a user makes: the console script, torchrun, kills, several nodes, preemption;
- ``tests/gpu``: what needs a CUDA GPU (skipped without one).

Each test is marked with its folder's tier, so ``-m unit`` selects the same tests as ``tests/unit``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support import cuda_emulator
from tests.support.environment import launcher_environ
from tests.support.helpers import COLLECTIVE_TIMEOUT_S, TASK_DEADLINE_S, save_stage2_checkpoint
from tests.support.pool import RankPools

TIERS = ("unit", "dist", "e2e", "gpu")
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.fspath).relative_to(HERE).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in one of tests/{{{','.join(TIERS)}}}")
        item.add_marker(tier)


@pytest.fixture(autouse=True)
def _leaves_no_process_group():
    """A test that trains in this process (world size 1) must leave no process group, and none of the variables
    Lightning, a launcher or a scheduler sets for one (environment.py), behind: the next test's Trainer, or a
    command it launches, would inherit them."""
    before = launcher_environ()
    yield
    after = launcher_environ()
    leaked = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    initialized = torch.distributed.is_initialized()
    for k in leaked:
        if k in before:
            os.environ[k] = before[k]
        else:
            os.environ.pop(k)
    if initialized:
        torch.distributed.destroy_process_group()
    assert not initialized and not leaked, f"the test left a process group ({initialized}) or set {leaked}"


@pytest.fixture(scope="session")
def rank_pools(tmp_path_factory):
    pools = RankPools(tmp_path_factory.mktemp("ranks"), timeout_s=COLLECTIVE_TIMEOUT_S, deadline_s=TASK_DEADLINE_S)
    yield pools
    pools.close()


@pytest.fixture
def ranks(rank_pools):
    """``ranks(fn, world_size, *args)``: runs ``fn(rank, world_size, *args)`` on the run's shared world of
    ``world_size`` rank processes and returns each rank's result, in rank order; a rank that raises, dies or
    hangs past the deadline fails the test with its traceback (or stacks). Keyword arguments ``timeout_s``
    (each collective) and ``deadline_s`` (the whole task) override the defaults."""
    return rank_pools.run


@pytest.fixture
def emulated_gpu(monkeypatch):
    """The CUDA kernels run on the CPU emulator for CPU tensors, through the launchers and the ops."""
    reason = cuda_emulator.available()
    if reason:
        pytest.skip(reason)
    cuda_emulator.build_all()  # (once: the builds are cached)
    cuda_emulator.emulate(monkeypatch)


@pytest.fixture(scope="session")
def stage2_checkpoint(tmp_path_factory) -> Path:
    """A real stage-2 checkpoint, saved once for the run in this process at world size 1 (tests damage copies)."""
    return save_stage2_checkpoint(tmp_path_factory.mktemp("stage2_checkpoint"))

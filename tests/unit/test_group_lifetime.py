"""A fitted ZeRO strategy does not keep the process group alive past ``destroy_process_group`` (issue 39, item 14).

A group kept alive keeps its gloo worker threads. When one of them frees a finished collective's tensor while the
interpreter exits, it must take the GIL; Python ends the thread instead, and the unwind through gloo's work
destructor aborts the rank with "terminate called without an active exception" (seen in benchmarks/compare.py)."""

from __future__ import annotations

import gc
import weakref

import torch.distributed as dist

from lightning_zero.sharding.topology import topology_for
from tests.support.helpers import EquivalenceModule, make_trainer, world_of_one, zero_strategy


def test_the_process_group_dies_with_destroy_while_the_trainer_lives():
    trainer = make_trainer(zero_strategy(3), 1, steps=1, accumulate=1)
    with world_of_one():
        group = weakref.ref(dist.distributed_c10d._get_default_group())
        trainer.fit(EquivalenceModule("toy", steps=1))
    gc.collect()  # (cycles aside: only what the trainer reaches could keep it)
    assert group() is None
    strategy = trainer.strategy
    with world_of_one():  # a new process group gets a topology of its own, kept while that group lives
        fresh = topology_for(strategy.topology, strategy.config, 0, 1, 1)
        assert fresh is not strategy.topology and fresh.world() is dist.distributed_c10d._get_default_group()
        assert topology_for(fresh, strategy.config, 0, 1, 1) is fresh

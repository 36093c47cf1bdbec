"""Run a function on N local ranks over gloo, with Lightning's environment variables set.

For tests, benchmarks and ``lightning-zero estimate --measure`` (planning/time_model.py): each rank is
a process from ``torch.multiprocessing.spawn``; the process group is created here, with a timeout,
before ``fn`` runs. Because LOCAL_RANK and friends are set, a ``Trainer`` built inside ``fn`` joins
these processes instead of launching its own, so one spawn can run several ``fit`` calls side by side.

A bottom-layer module: it depends on torch alone, so planning/, front/ and cli/ may all use it.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick), for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn_local_ranks(
    fn,
    world_size: int,
    *args,
    timeout_s: float = 120.0,
    deadline_s: float = 1200.0,
    start_method: str = "spawn",
) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` processes; re-raises a rank's failure.

    ``fn`` must be importable by name (a module-level function), as the processes are spawned.
    ``timeout_s`` bounds each collective (the process group's timeout); ``deadline_s`` the whole run:
    processes still running then are killed and a TimeoutError is raised, so nothing waits forever.
    ``start_method="fork"`` starts the ranks from this process's imports instead of importing everything
    again in each (seconds saved per rank); only safe before this process has started threads.
    """
    context = mp.start_processes(
        _rank_main,
        args=(world_size, free_port(), timeout_s, fn, args),
        nprocs=world_size,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish within {deadline_s:.0f} s")

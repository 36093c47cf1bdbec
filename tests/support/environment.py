"""The environment of the processes tests start, and what a launcher or scheduler sets in it.

One list for every use: the ``ranks`` pool (pool.py) and the commands tests launch (``launch_env``) strip
these from a child's environment, so a test starts its own ranks whatever pytest runs under; conftest.py
fails a test that leaves any of them changed in the pytest process. Light on purpose (no torch): the pool's
rank processes import it.
"""

from __future__ import annotations

import os
from pathlib import Path

# what torchrun, Lightning and torch.distributed read or set for a rank
LAUNCHER_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
)
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_")  # a scheduler's and torchrun's own families

_REPO = Path(__file__).resolve().parents[2]


def is_launcher_var(name: str) -> bool:
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def launcher_environ() -> dict[str, str]:
    """The launcher's and scheduler's variables in this process's environment now."""
    return {k: v for k, v in os.environ.items() if is_launcher_var(k)}


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without what a launcher or scheduler set, and ``extra``: what a child
    process (a pool rank, a launched command) starts from."""
    return {**{k: v for k, v in os.environ.items() if not is_launcher_var(k)}, **extra}


def launch_env(**extra: str) -> dict[str, str]:
    """``child_env`` for a command a test launches: the repository importable (the scripts in tests/support
    import ``tests.support``), one thread per rank, unbuffered output, and ``extra``."""
    path = os.pathsep.join(p for p in (str(_REPO), os.environ.get("PYTHONPATH")) if p)
    return child_env(**{"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})

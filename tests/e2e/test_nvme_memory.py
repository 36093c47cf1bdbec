"""A model whose optimizer state is three times the memory its ranks may use trains with that state on NVMe (issue 43),
for real: the two ranks (tests/support/nvme_target.py, ZeRO-3 with the optimizer state and the parameters on NVMe)
run in a memory cgroup (v1, made and removed here) whose limit is a third of the state's bytes; they train to the
end, and their weights and Adam's moments equal bitwise those of the same run offloaded to host memory outside the
cgroup (the state's round trip through the swap files over several steps: tests/dist/test_nvme_optimizer.py); the
same run offloaded to host memory inside the cgroup is killed by its limit. Needs root and the cgroup v1 memory
controller (this machine's and CI's); the peak usage the cgroup saw is printed (``-s``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.environment import launch_env
from tests.support.helpers import SUPPORT

MEMORY = Path("/sys/fs/cgroup/memory")
LIMIT = 768 << 20  # bytes the launcher and its two ranks may use together (640 MiB: the NVMe run is killed too)
WIDTH, LAYERS, STEPS = 2048, 48, 1  # 201M parameters: 2.4 GB of master weights and Adam's moments

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (MEMORY / "cgroup.procs").exists(), reason="needs root and cgroup v1's memory controller"
)


@contextmanager
def memory_cgroup(limit: int, name: str) -> Iterator[Path]:
    """A memory cgroup of its own with ``limit`` bytes (swap off for it); every process left in it is killed and the
    group removed at the end."""
    group = MEMORY / f"lightning_zero_{name}_{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if (group / "memory.swappiness").exists():
            (group / "memory.swappiness").write_text("0")
        yield group
    finally:
        for _ in range(50):
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        group.rmdir()


def _start(offload: str, root: Path, name: str, group: Path | None) -> subprocess.Popen:
    """Starts the target (in ``group``, if any: its two ranks, forked from it, are in the group too); ``_finish`` waits
    for it."""
    out, nvme = root / name, root / f"{name}-nvme"
    out.mkdir()
    nvme.mkdir()
    command = [sys.executable, str(SUPPORT / "nvme_target.py"), "--offload", offload, "--nvme-dir", str(nvme)]
    command += ["--out", str(out), "--width", str(WIDTH), "--layers", str(LAYERS), "--steps", str(STEPS)]

    def join_group() -> None:  # (in the child, before it runs)
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    # glibc raises its mmap threshold as large buffers are freed, and then keeps what later ones free in its heap: a
    # fixed threshold gives freed buffers back (README: ZeRO-Infinity on a machine without a GPU)
    env = launch_env(MALLOC_MMAP_THRESHOLD_=str(1 << 16))
    return subprocess.Popen(command, env=env, preexec_fn=join_group, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _finish(run: subprocess.Popen, root: Path, name: str) -> tuple[int, list[str], str]:
    """The target's exit code, each rank's digests of its shards and of its optimizer state (none if it did not
    finish) and the end of its stderr."""
    _, err = run.communicate(timeout=400)
    out, nvme = root / name, root / f"{name}-nvme"
    digests = [(out / f"rank{r}.txt").read_text().split()[:2] for r in range(2) if (out / f"rank{r}.txt").exists()]
    left = sorted(p.name for p in nvme.iterdir())
    assert not left, f"{len(left)} swap files left behind, e.g. {left[:3]}"
    return run.returncode, digests, err[-3000:]


def _oom_kills(group: Path) -> int:
    stat = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return int(stat.get("oom_kill", 0))


def test_optimizer_state_three_times_the_memory_limit_trains_on_nvme(tmp_path):
    psi = LAYERS * (WIDTH * WIDTH + WIDTH)
    assert 12 * psi >= 3 * LIMIT  # master weights and Adam's two moments, fp32
    # the three runs at once, each in its own group (or none): they share the cores, not a limit
    with memory_cgroup(LIMIT, "nvme") as nvme_group, memory_cgroup(LIMIT, "cpu") as cpu_group:
        runs = {
            "nvme": _start("nvme", tmp_path, "nvme", nvme_group),
            "cpu-limited": _start("cpu", tmp_path, "cpu-limited", cpu_group),
            "cpu": _start("cpu", tmp_path, "cpu", None),
        }
        code, in_host_memory, err = _finish(runs["cpu-limited"], tmp_path, "cpu-limited")
        assert code != 0 and not in_host_memory and _oom_kills(cpu_group) > 0, err  # killed by the limit
        code, on_nvme, err = _finish(runs["nvme"], tmp_path, "nvme")
        assert code == 0 and len(on_nvme) == 2, err
        peak = int((nvme_group / "memory.max_usage_in_bytes").read_text())
        assert peak <= LIMIT and _oom_kills(nvme_group) == 0
        print(f"\nNVMe: {12 * psi / 2**30:.2f} GiB of optimizer state, the ranks' peak {peak / 2**30:.2f} GiB")
        code, reference, err = _finish(runs["cpu"], tmp_path, "cpu")
    assert code == 0 and len(reference) == 2, err
    assert on_nvme == reference  # bitwise, rank by rank

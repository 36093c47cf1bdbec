"""Multi-node runs on one machine: 2 "nodes" x 2 ranks over loopback, started the way users start them.

- Lightning's own multi-node launch: one ``python train.py`` per node with ``NODE_RANK``, ``MASTER_ADDR``
  and ``MASTER_PORT`` set and ``Trainer(num_nodes=2, devices=2)``; Lightning starts each node's second
  rank. And ``torchrun --nnodes=2 --nproc-per-node=2 --node-rank=K --rdzv-endpoint=HOST:PORT``.
- Both train zero1, zero2, zero3 and zero2 with ``shard_group_size="node"`` (hybrid: each node shards,
  the nodes replicate) on BlocksNet (data-dependent blocks; accumulation, clipping) to within 1e-5 of a
  single-process run, with ranks 0-1 on node 0 and 2-3 on node 1.
- The checkpoints the 2 x 2 run wrote mid-run resume on 1 node x 2 ranks (the shared ranks: only the
  checkpoint is multi-node there), to within 1e-5 of the uninterrupted single-process run (resuming at the
  same world size is covered in tests/dist/test_checkpoint.py).
Every launch runs under a timeout; a node that fails or hangs fails the test with its output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_zero.launch_local import free_port
from tests.support import multinode_target
from tests.support.compare import relative_error
from tests.support.environment import launch_env
from tests.support.helpers import SUPPORT, EquivalenceModule, make_trainer

TARGET = SUPPORT / "multinode_target.py"
HALF = 3
TIMEOUT_S = 420


def _run_nodes(commands: list[tuple[list[str], dict[str, str]]], logs: Path) -> None:
    """Starts every node's command at once and waits for all; fails with the log of any that failed."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for k, (command, env) in enumerate(commands):
        log = open(logs / f"node{k}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for k, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(f"node {k} exited with {code}:\n" + (logs / f"node{k}.log").read_text()[-3000:])
    assert not failed, "\n".join(failed)


def _lightning(nodes: int, devices: int, out: Path, *extra: str) -> list[tuple[list[str], dict[str, str]]]:
    port = str(free_port())
    command = [sys.executable, str(TARGET), "--nodes", str(nodes), "--devices", str(devices), "--out", str(out)]
    env = {**launch_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return [([*command, *extra], {**env, "NODE_RANK": str(k)}) for k in range(nodes)]


def _torchrun(nodes: int, devices: int, out: Path, *extra: str) -> list[tuple[list[str], dict[str, str]]]:
    endpoint = f"127.0.0.1:{free_port()}"
    script = [str(TARGET), "--nodes", str(nodes), "--devices", str(devices), "--out", str(out), *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={devices}"]
    return [
        ([*launcher, f"--node-rank={k}", f"--rdzv-endpoint={endpoint}", *script], launch_env()) for k in range(nodes)
    ]


def _reference() -> dict[int, dict[str, torch.Tensor]]:
    pl.seed_everything(0)
    module = EquivalenceModule("blocks", steps=HALF)
    make_trainer("auto", 1, steps=2 * HALF).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _check(out: Path, reference: dict[str, torch.Tensor], what: str, *, ranks: int, per_node: int) -> None:
    for rank in range(ranks):
        where = json.loads(out.with_name(f"{out.name}.rank{rank}").read_text())
        assert (where["node_rank"], where["local_rank"]) == divmod(rank, per_node), (what, where)
    results = torch.load(out)
    assert sorted(results) == ["z1", "z2", "z2-node", "z3"], sorted(results)
    for run, state in results.items():
        for name, value in reference.items():
            err = relative_error(state[name], value)
            assert err <= 1e-5, f"{what}, {run}: {name} differs from one process by {err:.2e}"


def _resume_on_one_node(rank: int, world: int, out: Path, saved: Path) -> None:
    multinode_target.main(["--nodes", "1", "--devices", str(world), "--out", str(out), "--resume", str(saved)])


def test_two_nodes_by_lightning_and_by_torchrun_and_resume_on_one_node(ranks, tmp_path):
    """The resume on one node runs on the shared ranks: what is multi-node there is the checkpoint."""
    reference = _reference()
    saved = tmp_path / "ckpt"
    _run_nodes(_lightning(2, 2, tmp_path / "lightning.pt", "--save", str(saved)), tmp_path / "logs-lightning")
    _check(tmp_path / "lightning.pt", reference, "Lightning 2 x 2", ranks=4, per_node=2)
    _run_nodes(_torchrun(2, 2, tmp_path / "torchrun.pt"), tmp_path / "logs-torchrun")
    _check(tmp_path / "torchrun.pt", reference, "torchrun 2 x 2", ranks=4, per_node=2)
    out = tmp_path / "resumed-1x2.pt"  # one node, half the world
    ranks(_resume_on_one_node, 2, out, saved)
    _check(out, reference, "2 x 2 resumed on 1 x 2", ranks=2, per_node=2)

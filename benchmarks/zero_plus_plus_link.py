"""ZeRO++ on a real link: two "nodes" as two network namespaces joined by a veth pair.

Each node is a network namespace (made and removed here; addresses 10.77.0.1 and .2 exist only inside them)
running ``torchrun --nnodes 2 --nproc_per_node 2``: a node's two ranks talk over its own loopback, the
nodes over the veth pair, optionally rate-limited with ``tc`` (a token bucket on each end). Cross-node bytes
per step are read from the kernel's counters of the veth interface (received + sent on node 0's end:
everything that crossed, TCP/IP headers included), next to what ``planning/comm_model.py`` predicts for our
collectives on gloo.

1. Unlimited link: plain stage 3, qwZ, hpZ, qgZ and all three; bytes per step and their ratio to plain.
2. Limited link (``--rate``): plain stage 3 and all three, interleaved over ``--rounds`` rounds, beside the
   same step with all four ranks in one namespace (loopback only: compute and local communication); medians
   and spread of each run's median step; the time model's predicted gain beside the measured one.

Needs root (``ip netns``, ``tc``).

    python benchmarks/zero_plus_plus_link.py --rate 40mbit --out benchmarks/results/zero_plus_plus_link_cpu.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAMESPACES = ("lzpp-n0", "lzpp-n1")
LINKS = ("lzpp-v0", "lzpp-v1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
VARIANTS = {
    "plain": {},
    "qwZ": {"quantized_weights": True},
    "hpZ": {"secondary_partition": True},
    "qgZ": {"quantized_gradients": True},
    "all": {"quantized_weights": True, "secondary_partition": True, "quantized_gradients": True},
}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


@contextlib.contextmanager
def two_nodes(rate: str | None):
    """The two namespaces and the veth pair between them (with ``rate``: a token bucket on both ends)."""
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
    try:
        for ns in NAMESPACES:
            _ip("netns", "add", ns)
        _ip("link", "add", LINKS[0], "type", "veth", "peer", "name", LINKS[1])
        for ns, link, address in zip(NAMESPACES, LINKS, ADDRESSES):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate:
                tbf = [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    link,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "64kb",
                    "latency",
                    "400ms",
                ]
                subprocess.run(["ip", "netns", "exec", ns, *tbf], check=True)
        yield
    finally:
        for ns in NAMESPACES:  # (deleting a namespace deletes its end of the veth pair, and so the pair)
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def run(variant: str, args, out: Path, *, one_node: bool = False) -> dict:
    """One training run of ``variant``: two torchruns (one per namespace), or four ranks in namespace 0."""
    port = 29600 + int(time.time() * 1000) % 300
    worker = [__file__, "--worker", variant, "--steps", str(args.steps), "--out", str(out)]
    worker += ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--batch", str(args.batch)]
    launches = []
    for node, (ns, link) in enumerate(zip(NAMESPACES, LINKS)):
        if one_node and node:
            break
        nodes = (
            ["--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "4"]
            if one_node
            else ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2"]
        )
        env = {**os.environ, "GLOO_SOCKET_IFNAME": link, "LZ_LINK_IFACE": LINKS[0], "OMP_NUM_THREADS": "1"}
        torchrun = [sys.executable, "-m", "torch.distributed.run", *nodes, "--master_addr", ADDRESSES[0]]
        torchrun += ["--master_port", str(port)]
        command = ["ip", "netns", "exec", ns, *torchrun, *worker]
        launches.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for launch in launches:
        _, err = launch.communicate(timeout=args.timeout)
        if launch.returncode:
            raise RuntimeError(f"{variant}: a node failed ({launch.returncode}):\n{err.decode()[-3000:]}")
    return json.loads(out.read_text())


def _worker(args) -> None:
    """A rank: trains the GPT at zero3 with the variant's options; rank 0 writes its step times, the bytes the
    veth interface counted over the timed steps (its namespace's end) and our own traffic counters."""
    import lightning.pytorch as pl
    import torch

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    torch.set_num_threads(1)
    iface = os.environ["LZ_LINK_IFACE"]

    def link_bytes() -> int:
        base = Path("/sys/class/net") / iface / "statistics"
        return sum(int((base / f"{way}_bytes").read_text()) for way in ("tx", "rx")) if base.exists() else 0

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                self.bytes_start, self.ours = link_bytes(), trainer.strategy.traffic.copy()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.start)
            self.losses.append(float(outputs["loss"]))
            if batch_idx == args.steps - 1:
                self.bytes = link_bytes() - self.bytes_start
                since = trainer.strategy.traffic.since(self.ours).bytes_by_group
                self.our_bytes = {f"{role}/{op}": n for (role, op), n in since.items()}

    pl.seed_everything(0)
    config = GPTConfig(vocab_size=32, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    data = SyntheticTextDataModule(block_size=64, batch_size=args.batch, num_train=4096, seed=0)
    zero = ZeroConfig(stage=3, node_size=2, param_persistence_threshold=0, **VARIANTS[args.worker])
    clock = Clock()
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = pl.Trainer(
        strategy=ZeroStrategy(zero),
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(GPTModule(config, max_steps=args.steps), data)
    if trainer.global_rank == 0:
        timed = args.steps - args.warmup
        record = {
            "step_s": statistics.median(clock.times[args.warmup :]),
            "link_bytes_per_step": clock.bytes / timed,
            "our_bytes_per_step": {k: v / timed for k, v in clock.our_bytes.items()},
            "losses": clock.losses,
            "psi": sum(p.numel() for p in trainer.lightning_module.parameters()),
        }
        Path(args.out).write_text(json.dumps(record))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _predicted_gain(psi: int, rate_bytes: float, compute_s: float, tokens: int, block: int) -> tuple[float, float]:
    """The time model's plain and all-three steps at this link (per rank: half of a node's egress)."""
    from lightning_zero.planning.time_model import Hardware, flops_per_token, predict_step

    flops = flops_per_token(psi)
    hardware = Hardware(tflops=flops * tokens / compute_s / 1e12, intra_gbs=100.0, inter_gbs=rate_bytes / 2 / 1e9)
    common = dict(tokens=tokens, world_size=4, per_node=2, algorithm="direct", flops=flops)
    plain = predict_step("zero3", psi, hardware, **common)
    plus = predict_step("zero3", psi, hardware, **common, zero_plus_plus=("qwZ", "hpZ", "qgZ"), block=block)
    return plain.total, plus.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rate", default="40mbit", help="tc rate of the limited link (e.g. 40mbit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "run.json"
        with two_nodes(None):
            unlimited = {name: run(name, args, record) for name in VARIANTS}
        limited: dict[str, list[dict]] = {"plain": [], "all": [], "one node": []}
        with two_nodes(args.rate):
            for _ in range(args.rounds):  # interleaved: each round runs every configuration once
                limited["plain"].append(run("plain", args, record))
                limited["all"].append(run("all", args, record))
                limited["one node"].append(run("plain", args, record, one_node=True))
    report(args, unlimited, limited)


def _rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for suffix, factor in units.items():
        if rate.endswith(suffix):
            return float(rate.removesuffix(suffix)) * factor
    raise ValueError(f"--rate must end in kbit, mbit or gbit, got {rate!r}")


def report(args, unlimited: dict, limited: dict) -> None:
    from lightning_zero.planning.comm_model import link_bytes, step_collectives

    psi = unlimited["plain"]["psi"]
    total = psi  # (the padded total differs by a few elements per unit)
    lines = [
        "# ZeRO++ on a real link: two network namespaces joined by a veth pair",
        "",
        f"- date: {datetime.date.today()}; {os.cpu_count()} cores; 2 nodes x 2 ranks (gloo); GPT {args.n_layer} x"
        f" {args.n_embd} ({psi:,} parameters), fp32, zero3, batch {args.batch} x 64 tokens per rank, 1 micro-batch",
        f"- command: `python benchmarks/zero_plus_plus_link.py --rate {args.rate} --rounds {args.rounds}`",
        "",
        "## Cross-node bytes per optimizer step (unlimited link)",
        "",
        "Measured: the veth interface's received + sent bytes on node 0's end over the timed steps (the kernel's",
        "count, headers included). Model: `comm_model` for our collectives on gloo (each rank sends its part to",
        "each peer directly), both directions, all four ranks.",
        "",
        "| configuration | measured bytes per step | ratio to plain | model | measured / model | step s |",
        "|---|---|---|---|---|---|",
    ]
    plain_bytes = unlimited["plain"]["link_bytes_per_step"]
    for name, record in unlimited.items():
        options = tuple(v for v in ("qwZ", "hpZ", "qgZ") if name in (v, "all"))
        ops = step_collectives("zero3", total, world_size=4, zero_plus_plus=options, block=256)
        _, inter = link_bytes(ops, world_size=4, per_node=2, algorithm="direct")
        model = 4 * inter
        measured = record["link_bytes_per_step"]
        lines.append(
            f"| {name} | {measured:,.0f} | {measured / plain_bytes:.3f} | {model:,.0f} | {measured / model:.3f}"
            f" | {record['step_s']:.3f} |"
        )
    rate_bytes = _rate_bytes(args.rate)
    steps = {name: [r["step_s"] for r in runs] for name, runs in limited.items()}
    gains = [p / a for p, a in zip(steps["plain"], steps["all"])]
    compute = statistics.median(steps["one node"])
    predicted_plain, predicted_all = _predicted_gain(psi, rate_bytes, compute, args.batch * 64, 256)
    lines += [
        "",
        f"## Step time with the link limited to {args.rate} (tc token bucket on both ends)",
        "",
        f"Median step of each run, then the median (min-max) over {args.rounds} interleaved rounds.",
        "",
        "| configuration | step s | gain over plain zero3 |",
        "|---|---|---|",
        f"| plain zero3, 2 nodes | {_spread(steps['plain'])} | 1 |",
        f"| qwZ + hpZ + qgZ, 2 nodes | {_spread(steps['all'])} | {_spread(gains)} |",
        f"| plain zero3, the 4 ranks on one node (no link: compute and loopback) | {_spread(steps['one node'])} | |",
        "",
        f"Time model (`planning/time_model.py`, compute taken from the one-node step, {rate_bytes / 2 / 1e6:.2f} MB/s"
        f" per rank across nodes): plain {predicted_plain:.3f} s, all three {predicted_all:.3f} s, predicted gain"
        f" {predicted_plain / predicted_all:.2f}x against the measured {statistics.median(gains):.2f}x"
        f" ({predicted_plain / predicted_all / statistics.median(gains):.2f} of it).",
        "",
        "Final losses (rank 0, last step): "
        + ", ".join(f"{name} {record['losses'][-1]:.4f}" for name, record in unlimited.items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

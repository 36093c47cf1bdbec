"""The longest sequence each configuration trains within a fixed per-rank byte budget, 4 ranks at ZeRO stage 3.

The budget is what plain stage 3 (4 data-parallel ranks, a sample each, no checkpointing) holds at its peak at
``--base`` tokens. Each configuration's longest sequence is found by measuring steps (forward, backward and the
optimizer's step) at growing lengths, doubling until a step's peak passes the budget and then bisecting to
``--grain`` tokens. A step's peak is the most any rank holds at once: the live bytes of torch's ``MemTracker``
(every tensor the step allocates: activations, temporaries, gradients, gathered parameters) plus the engine's
persistent device bytes made before it (``memory_bytes()``: parameter shards, optimizer state), without the host
pool of offloaded checkpoints (host memory on a GPU; on this CPU the same memory, so an offloading configuration
runs each length once untracked first, making the pool before the measured step). Configurations: sequence
parallelism over the 4 ranks (one sample's slices), with activation checkpointing (``units``), with the
checkpoints offloaded, with the MLP and the loss in tiles, and the last without sequence parallelism.

    python benchmarks/sequence_length.py [--base 1024] [--grain 256] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit  # noqa: E402
from lightning_zero import ZeroConfig, ZeroFabricStrategy  # noqa: E402
from lightning_zero.launch_local import spawn_local_ranks  # noqa: E402
from lightning_zero.models.gpt import GPT, GPTConfig  # noqa: E402

WORLD = 4


class StepTracker(MemTracker):
    """torch's MemTracker without its walk over each module's parameters at the module's call: that walk reads
    stage 3's sharded parameters before their unit is gathered (which ZeRO refuses outside its own gathers). Every
    storage the step allocates is still counted, by the tracker's dispatch mode."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True) -> tuple[int, int]:
        return 0, 0


# (name, sequence_parallel_size, activation_checkpointing, offload_activations, tiles)
CONFIGS = [
    ("stage 3", 1, "none", "none", 1),
    ("stage 3 + SP=4", 4, "none", "none", 1),
    ("stage 3 + SP=4 + checkpointing", 4, "units", "none", 1),
    ("stage 3 + SP=4 + checkpointing + offload", 4, "units", "cpu", 1),
    ("stage 3 + SP=4 + checkpointing + offload + tiled loss/MLP", 4, "units", "cpu", 16),
    ("stage 3 + checkpointing + offload + tiled loss/MLP (no SP)", 1, "units", "cpu", 16),
]


def model_config(args, tiles: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, block_size=args.longest, n_layer=args.layers, n_head=4, n_embd=args.embd,
        mlp_tiles=tiles, loss_tiles=tiles,
    )  # fmt: skip


class Run:
    """One configuration set up on every rank: ``peak(length)`` measures a step at that length."""

    def __init__(self, args, size: int, mode: str, offload: str, tiles: int) -> None:
        config = ZeroConfig(
            stage=3, sequence_parallel_size=size, activation_checkpointing=mode, offload_activations=offload,
            param_persistence_threshold=0, timeout=600,
        )  # fmt: skip
        self.fabric = Fabric(strategy=ZeroFabricStrategy(config), accelerator="cpu", devices=WORLD)
        self.fabric.launch()
        self.sequence = self.fabric.strategy.sequence_parallel
        torch.manual_seed(0)
        model = GPT(model_config(args, tiles), sequence=self.sequence)
        self.model, self.optimizer = self.fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        self.vocab, self.grain, self.offload = args.vocab, args.grain, offload != "none"
        self.step(args.grain)  # (the optimizer's state made before any measured step)

    def step(self, length: int) -> None:
        replica = self.sequence.data_rank if self.sequence is not None else dist.get_rank()
        tokens = torch.randint(self.vocab, (1, length + 1), generator=torch.Generator().manual_seed(replica))
        x, y = tokens[:, :-1], tokens[:, 1:]
        if self.sequence is not None:
            x, y = self.sequence.split(x), self.sequence.split(y)
        self.fabric.backward(self.model(x, y))
        self.optimizer.step()
        self.optimizer.zero_grad()

    def peak(self, length: int) -> int:
        """The most bytes any rank holds during a step at ``length`` tokens (see the module's docstring)."""
        if self.offload:  # (the host pool made, or grown to this length, before the tracked step: not counted)
            self.step(length)
        tracker = StepTracker()
        with tracker:
            self.step(length)
        held = sum(next(iter(tracker.get_tracker_snapshot("peak").values())).values())
        states = self.fabric.strategy.engine.memory_bytes()  # (made before the step: what the tracker cannot see)
        held += sum(v for k, v in states.items() if not k.startswith("host_"))
        most = torch.tensor([held], dtype=torch.long)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def longest(self, budget: int, start: int, limit: int) -> tuple[int, int]:
        """The longest multiple of the grain (at most ``limit``) whose step fits ``budget``, and its peak."""
        fits: dict[int, int] = {}

        def fit(length: int) -> bool:
            fits[length] = self.peak(length)
            return fits[length] <= budget

        low, high = 0, None
        length = start
        while length <= limit and fit(length):
            low, length = length, 2 * length
        high = min(length, limit + self.grain)
        if low == 0:
            low, high = 0, start
        while high - low > self.grain:
            middle = (low + high) // 2 // self.grain * self.grain
            low, high = (middle, high) if fit(middle) else (low, middle)
        return low, fits.get(low, 0)


def worker(rank: int, world: int, args, out_file: str) -> None:
    results = []
    budget = None
    for name, size, mode, offload, tiles in CONFIGS:
        started = time.perf_counter()
        run = Run(args, size, mode, offload, tiles)
        if budget is None:
            budget = run.peak(args.base)
        longest, peak = run.longest(budget, args.base, args.longest)
        results.append((name, longest, peak, time.perf_counter() - started))
    if rank == 0:
        torch.save({"budget": budget, "results": results}, out_file)


def report(args, budget: int, results: list) -> str:
    base = results[0][1]
    lines = [
        f"# The longest sequence within a per-rank byte budget ({date.today()}, {platform.processor() or 'cpu'})",
        "",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo; {WORLD} ranks at ZeRO stage 3.",
        f"Model: the GPT, {args.layers} layers, n_embd {args.embd}, 4 heads, vocab {args.vocab} (fp32, AdamW),"
        f" block_size {args.longest}; one sample per data-parallel replica.",
        f"Budget: {budget / 2**20:.2f} MiB per rank, what plain stage 3 holds at its peak at {args.base} tokens"
        " (MemTracker's live bytes: model states, activations and temporaries; the host pool of offloaded"
        " checkpoints taken out). Longest: to "
        f"{args.grain} tokens, by doubling then bisecting.",
        "",
        f"Command: `python benchmarks/sequence_length.py --base {args.base} --grain {args.grain}`",
        "",
        "| configuration | longest sequence (tokens) | x plain stage 3 | its step's peak (MiB) | search (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, longest, peak, seconds in results:
        lines.append(f"| {name} | {longest} | {longest / base:.2f} | {peak / 2**20:.2f} | {seconds:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=1024)
    parser.add_argument("--grain", type=int, default=256)
    parser.add_argument("--longest", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "results.pt")
        spawn_local_ranks(worker, WORLD, args, out_file, timeout_s=900, deadline_s=7200)
        saved = torch.load(out_file, weights_only=True)
    emit(report(args, saved["budget"], saved["results"]), args.out)


if __name__ == "__main__":
    main()

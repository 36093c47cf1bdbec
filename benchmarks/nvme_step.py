"""The optimizer step with its state on NVMe (``offload_optimizer="nvme"``, issue 43): does the I/O overlap the host
step? "The step <= 1.3x the time of its slowest part alone".

One process (the plain-script door, world size 1) trains a stack of ``--layers`` square Linear layers of ``--width``
with ZeRO-2 and AdamW, its master and moments in swap files under ``--dir``, streamed in chunks of ``--chunk``
elements through ``nvme_buffer_count`` buffers. Each round, interleaved: one backward, then (1) the optimizer step as
training takes it (``ZeroOptimizer.step``: read ahead, host AdamW, write behind, parameters written); (2) its I/O
alone: the same records streamed through the same ring with no work; (3) its work alone: the host AdamW kernel over
chunks of the same sizes already in memory, and the parameters' copy. Medians and spread over the rounds.

    python benchmarks/nvme_step.py [--dir /tmp] [--width 2048] [--layers 12] [--chunk 4194304] [--rounds 5] [--out F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lightning_zero  # noqa: E402
from benchmarks.common import emit  # noqa: E402
from lightning_zero.kernels import host  # noqa: E402
from lightning_zero.kernels.adamw import AdamWRun  # noqa: E402
from lightning_zero.nvme.optimizer_swap import split  # noqa: E402
from lightning_zero.nvme.swap_file import aligned_buffer, stream  # noqa: E402


def io_alone(units, ring) -> float:
    """Seconds to stream the units' records through ``ring`` (read ahead, write behind) with no work."""
    regions = [region for unit in units for region in unit.training.swap.regions()]
    start = time.perf_counter()
    for _ in stream(regions, ring):
        pass
    return time.perf_counter() - start


def work_alone(units, records) -> float:
    """Seconds of the step's work on records already in memory: the host AdamW over each chunk, then the
    parameters' copy."""
    start = time.perf_counter()
    k = 0
    for unit in units:
        for lo, hi in unit.training.swap.chunks:
            master, exp_avg, exp_avg_sq = split(records[k], hi - lo)
            grad = unit.training.step_grad[lo:hi]
            run = AdamWRun(master, grad, exp_avg, exp_avg_sq, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.01, step=1)  # fmt: skip
            host.adamw_step([run])
            unit.flat_param[lo:hi].copy_(master)  # (world size 1: the partition is the flat buffer)
            k += 1
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=1 << 22, help="elements per chunk (zero.nvme_buffer_numel)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    psi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        config = lightning_zero.ZeroConfig(
            stage=2, offload_optimizer="nvme", nvme_path=scratch, nvme_buffer_numel=args.chunk, reduce_bucket_size=psi
        )
        engine = lightning_zero.initialize(model, optimizer, config)
        zero = getattr(engine.optimizer, "optimizer", engine.optimizer)  # (Fabric wraps the ZeroOptimizer)
        units = zero.units
        x = torch.randn(8, args.width)
        rows = []
        records = None
        for _ in range(args.rounds + 1):  # (the first round warms up: the ring and the kernel are made)
            engine.backward(engine(x).square().mean())
            zero.prepare_grads()
            start = time.perf_counter()
            zero.step()
            stepped = time.perf_counter() - start
            zero.zero_grad()
            engine.backward(engine(x).square().mean())
            zero.prepare_grads()  # (the work alone reads the gradient too)
            io = io_alone(units, zero.nvme.ring)
            if records is None:
                records = [aligned_buffer(r[2]) for u in units for r in u.training.swap.regions()]
            work = work_alone(units, records)
            zero.zero_grad()
            rows.append((stepped, io, work))
        engine.close()
    rows = rows[1:]
    ratios = [s / max(i, w) for s, i, w in rows]
    state_mib = 12 * psi / 2**20
    lines = [
        f"# The optimizer step with its state on NVMe ({date.today()})",
        "",
        f"Machine: {os.cpu_count()} CPU cores, {torch.get_num_threads()} threads; directory {args.dir}; {psi:,}"
        f" parameters ({args.layers} x Linear({args.width}, {args.width})), {state_mib:.0f} MiB of master and moments,"
        f" chunks of {args.chunk:,} elements, {config.nvme_buffer_count} buffers; ZeRO-2, world size 1;"
        f" {args.rounds} interleaved rounds after a warm-up; host AdamW kernel: {host.available()}.",
        "",
        f"Command: `python benchmarks/nvme_step.py --dir {args.dir} --width {args.width} --layers {args.layers}"
        f" --chunk {args.chunk} --rounds {args.rounds}`",
        "",
        "| round | step s | I/O alone s | work alone s | step / slowest alone |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, ((stepped, io, work), ratio) in enumerate(zip(rows, ratios)):
        lines.append(f"| {k + 1} | {stepped:.3f} | {io:.3f} | {work:.3f} | {ratio:.2f} |")
    lines.append(f"| median | | | | {statistics.median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f}) |")
    moved = 2 * 12 * psi / 1e9
    lines += ["", f"The step moves {moved:.2f} GB (every record read and written once): "
              f"{moved / statistics.median(r[0] for r in rows):.2f} GB/s at the median step."]  # fmt: skip
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

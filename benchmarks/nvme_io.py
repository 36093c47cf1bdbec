"""Swap-file bandwidth (nvme/swap_file.py) against a plain direct-I/O copy of the same size by ``dd`` (issue 43:
"swap reads and writes >= 70% of that bandwidth").

Each round, interleaved: ``dd`` writes ``--mib`` MiB with ``oflag=direct`` and reads them back with
``iflag=direct`` (1 MiB blocks, one request at a time); then a ``SwapFile`` writes and reads the same bytes from
an aligned buffer in ``--block`` pieces, ``--depth`` in flight. Medians and spread over the rounds. Then the
overlap of a streamed host step (``stream_chunks``) with its I/O: "the step <= 1.3x its slowest part alone".

    python benchmarks/nvme_io.py [--dir /tmp] [--mib 512] [--rounds 5] [--depth 8] [--block 1] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit  # noqa: E402
from lightning_zero.nvme.swap_file import SwapFile, aligned_buffer, check_nvme_path, stream_chunks  # noqa: E402


def dd_round(directory: Path, mib: int) -> tuple[float, float]:
    """GB/s of dd's direct write, then its direct read, of ``mib`` MiB."""
    path = directory / "dd_probe.bin"
    try:
        start = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct"],
                       check=True, capture_output=True)  # fmt: skip
        write = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True, capture_output=True)
        read = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return mib * 2**20 / write / 1e9, mib * 2**20 / read / 1e9


def swap_round(directory: Path, buffer, depth: int, block: int) -> tuple[float, float]:
    """GB/s of a SwapFile's write, then its read, of ``buffer``."""
    swap = SwapFile(directory, "bench", buffer.numel(), queue_depth=depth, block_size=block)
    try:
        start = time.perf_counter()
        swap.write(0, buffer).wait()
        os.fsync(swap.fd)  # (as dd's direct writes: on the disk)
        write = time.perf_counter() - start
        start = time.perf_counter()
        swap.read(0, buffer).wait()
        read = time.perf_counter() - start
    finally:
        swap.close()
    return buffer.numel() / write / 1e9, buffer.numel() / read / 1e9


def work(chunk) -> None:
    """A host optimizer's step on a chunk, as its stand-in: a few passes of fp32 arithmetic over it."""
    values = chunk.view(torch.float32)
    for _ in range(4):
        values.mul_(0.999).add_(1e-3)


def overlap_round(directory: Path, mib: int, chunk_mib: int) -> tuple[float, float, float]:
    """Seconds of: the stream alone (read ahead, write behind), the work alone on the same chunks in memory, and
    the stream with the work (nvme/swap_file.py's stream_chunks, 3 buffers)."""
    nbytes, chunk = mib * 2**20, chunk_mib * 2**20
    swap = SwapFile(directory, "overlap", nbytes, queue_depth=8, block_size=2**20)
    try:
        swap.write(0, aligned_buffer(nbytes).fill_(0)).wait()
        start = time.perf_counter()
        for _ in stream_chunks(swap, 0, nbytes, chunk):
            pass
        io = time.perf_counter() - start
        memory = [aligned_buffer(chunk).fill_(0) for _ in range(nbytes // chunk)]
        start = time.perf_counter()
        for piece in memory:
            work(piece)
        compute = time.perf_counter() - start
        del memory
        start = time.perf_counter()
        for piece in stream_chunks(swap, 0, nbytes, chunk):
            work(piece)
        both = time.perf_counter() - start
    finally:
        swap.close()
    return io, compute, both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--block", type=int, default=1, help="MiB per request")
    parser.add_argument("--chunk", type=int, default=32, help="MiB per streamed chunk")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    directory = check_nvme_path(args.dir)
    buffer = aligned_buffer(args.mib * 2**20)
    buffer.fill_(7)
    runs: dict[str, list[float]] = {"dd write": [], "dd read": [], "swap write": [], "swap read": []}
    for _ in range(args.rounds):
        for kind, (write, read) in (
            ("dd", dd_round(directory, args.mib)),
            ("swap", swap_round(directory, buffer, args.depth, args.block * 2**20)),
        ):
            runs[f"{kind} write"].append(write)
            runs[f"{kind} read"].append(read)
    lines = [
        f"# Swap-file direct I/O against dd ({date.today()})",
        "",
        f"Machine: {os.cpu_count()} CPU cores; directory {args.dir} ({_filesystem(args.dir)}); {args.mib} MiB a"
        f" transfer; {args.rounds} interleaved rounds; swap: {args.depth} requests of {args.block} MiB in flight.",
        "",
        f"Command: `python benchmarks/nvme_io.py --dir {args.dir} --mib {args.mib} --rounds {args.rounds}"
        f" --depth {args.depth} --block {args.block} --chunk {args.chunk}`",
        "",
        "| transfer | median GB/s | min - max | swap / dd |",
        "|---|---:|---:|---:|",
    ]
    for name, values in runs.items():
        ratio = ""
        if name.startswith("swap"):
            ratio = f"{statistics.median(values) / statistics.median(runs['dd' + name[4:]]):.2f}"
        lines.append(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} - {max(values):.2f} | {ratio} |")
    lines += [
        "",
        f"Overlap: a host step's stand-in (4 fp32 passes over each chunk) streamed through {args.mib} MiB in"
        f" {args.chunk} MiB chunks (read ahead, write behind, 3 buffers), against the stream alone and the work alone"
        " on the same chunks in memory:",
        "",
        "| round | stream alone s | work alone s | both s | both / slowest alone |",
        "|---|---:|---:|---:|---:|",
    ]
    ratios = []
    for round_ in range(args.rounds):
        io, compute, both = overlap_round(directory, args.mib, args.chunk)
        ratios.append(both / max(io, compute))
        lines.append(f"| {round_ + 1} | {io:.3f} | {compute:.3f} | {both:.3f} | {ratios[-1]:.2f} |")
    lines.append(f"| median | | | | {statistics.median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f}) |")
    emit("\n".join(lines) + "\n", args.out)


def _filesystem(path: Path) -> str:
    found = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()
    return found[-1].split()[1] if len(found) > 1 else "unknown"


if __name__ == "__main__":
    main()

"""Swap-file bandwidth (nvme/swap_file.py) against a plain direct-I/O copy of the same size by ``dd`` (issue 43:
"swap reads and writes >= 70% of that bandwidth").

Each round, interleaved: ``dd`` writes ``--mib`` MiB with ``oflag=direct`` and reads them back with
``iflag=direct`` (1 MiB blocks, one request at a time); then a ``SwapFile`` writes and reads the same bytes from
an aligned buffer in ``--block`` pieces, ``--depth`` in flight. Medians and spread over the rounds.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit  # noqa: E402
from lightning_zero.nvme.swap_file import SwapFile, aligned_buffer, check_nvme_path  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--block", type=int, default=1, help="MiB per request")
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
        f" --depth {args.depth} --block {args.block}`",
        "",
        "| transfer | median GB/s | min - max | swap / dd |",
        "|---|---:|---:|---:|",
    ]
    for name, values in runs.items():
        ratio = ""
        if name.startswith("swap"):
            ratio = f"{statistics.median(values) / statistics.median(runs['dd' + name[4:]]):.2f}"
        lines.append(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} - {max(values):.2f} | {ratio} |")
    emit("\n".join(lines) + "\n", args.out)


def _filesystem(path: Path) -> str:
    found = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()
    return found[-1].split()[1] if len(found) > 1 else "unknown"


if __name__ == "__main__":
    main()

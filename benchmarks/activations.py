"""Activation memory and step time of the engine's activation checkpointing (activations/), one process.

A GPT at a long sequence, each mode (none, units, selective, and the last two with host offload):

- peak activation bytes, measured with torch's ``MemTracker`` (what it holds at the peak besides parameters and
  their gradients, the host pool's one buffer taken out), against ``estimate``'s prediction (planning/activations.py);
- the longest sequence that fits a fixed byte budget: the budget is what plain training (no checkpointing; under
  any stage, whose model states are the same with or without checkpointing) holds at a base length, and each mode's
  longest is measured by doubling the sequence until its peak passes the budget, then bisecting;
- the step time (forward and backward), in interleaved rounds (median and spread), offload against checkpointing
  without it. On the CPU there is no side stream: the copies run inline, so this is their whole cost; on a GPU
  (``--device cuda``) they run on a side stream, and ``--trace`` writes a profiler trace showing them next to the
  compute.

    python benchmarks/activations.py [--layers 16] [--embd 64] [--seq 1024] [--rounds 7] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from datetime import date

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_zero.activations.checkpointing import UnitCheckpoints
from lightning_zero.activations.host_offload import HostActivations
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.planning.activations import MODES, mode_name, profile_activations


def build(args, seq: int, mode: str, offload: bool) -> tuple[GPT, HostActivations | None]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    model = GPT(config).to(args.device)
    pool = HostActivations(torch.device(args.device)) if offload else None
    if mode != "none":
        UnitCheckpoints(list(model.blocks), selective=mode == "selective", offload=pool)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, pool


def step(model: GPT, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), tokens.view(-1)).backward()


def peak_bytes(args, seq: int, mode: str, offload: bool) -> int:
    """The second step's peak activation bytes (the first makes the pool), outside the host pool."""
    model, pool = build(args, seq, mode, offload)
    tokens = torch.randint(64, (1, seq), device=args.device)
    step(model, tokens)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step(model, tokens)
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = next(value for device, value in snapshot.items() if device.type == args.device)
    held = sum(v for k, v in peak.items() if str(k).endswith(("ACT", "TEMP")))
    return held - (pool.pool.capacity if pool is not None and args.device == "cpu" else 0)


def predicted(args, seq: int):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=seq, n_layer=args.layers, n_head=4, n_embd=args.embd))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=args.device)
        tokens = torch.zeros(1, seq, dtype=torch.long, device=args.device)
        return profile_activations(model, list(model.blocks), lambda: model(tokens))


def longest(args, budget: int, mode: str, offload: bool, start: int) -> int:
    """The longest sequence (a multiple of 64) whose measured peak fits ``budget``."""
    low, high = start, None
    while high is None:
        if peak_bytes(args, 2 * low, mode, offload) <= budget:
            low *= 2
        else:
            high = 2 * low
    while high - low > 64:
        middle = (low + high) // 128 * 64
        low, high = (middle, high) if peak_bytes(args, middle, mode, offload) <= budget else (low, middle)
    return low


def step_times(args) -> dict[str, list[float]]:
    runs = {"units": ("units", False), "units+offload": ("units", True)}
    models = {name: build(args, args.seq, *run)[0] for name, run in runs.items()}
    tokens = torch.randint(64, (1, args.seq), device=args.device)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for model in models.values():  # (warm-up: the pool and the allocator)
        step(model, tokens)
    for _ in range(args.rounds):  # interleaved, so drift affects both alike
        for name, model in models.items():
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, tokens)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    if args.trace:
        with torch.profiler.profile() as profiler:
            step(models["units+offload"], tokens)
        profiler.export_chrome_trace(args.trace)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024, help="the long sequence the memory and times are taken at")
    parser.add_argument("--base", type=int, default=256, help="the budget: plain training's peak at this length")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--trace", help="a Chrome trace of one offloaded step (the side stream's copies)")
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = [
        f"# Activation checkpointing, {args.device}, {date.today()}",
        "",
        f"GPT, {args.layers} blocks, n_embd {args.embd}, 4 heads, vocab 64, one sample; torch {torch.__version__}.",
        "",
        f"## Peak activation bytes at {args.seq} tokens (MemTracker; outside the host pool)",
        "",
        "| mode | measured | / none | estimate | estimate error | host pool |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    profile = predicted(args, args.seq)
    plain = peak_bytes(args, args.seq, "none", False)
    for mode, offload in MODES:
        measured = plain if mode == "none" else peak_bytes(args, args.seq, mode, offload)
        estimate, host = profile.held(mode, offload=offload)
        lines.append(
            f"| {mode_name(mode, offload)} | {measured:,} | {measured / plain:.3f} | {estimate:,} |"
            f" {estimate / measured - 1:+.1%} | {host:,} |"
        )
    budget = peak_bytes(args, args.base, "none", False)
    lines += [
        "",
        f"## The longest sequence within {budget:,} bytes (plain training's peak at {args.base} tokens)",
        "",
        "| mode | longest (tokens, multiple of 64) | / plain |",
        "|---|---:|---:|",
    ]
    plain_longest = longest(args, budget, "none", False, args.base // 2)
    for mode, offload in MODES:
        found = plain_longest if mode == "none" else longest(args, budget, mode, offload, args.base)
        lines.append(f"| {mode_name(mode, offload)} | {found:,} | {found / plain_longest:.2f} |")
    times = step_times(args)
    base = statistics.median(times["units"])
    lines += [
        "",
        f"## Step time at {args.seq} tokens, {args.rounds} interleaved rounds",
        "",
        "| mode | median s | min s | max s | / units |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.4f} | {min(values):.4f} | {max(values):.4f} | {median / base:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

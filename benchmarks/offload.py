"""ZeRO-Offload side by side: the host optimizer step, and training with and without offload.

1. The host AdamW step over P fp32 parameters (10M and 100M) with 1 and 2 threads, in parameters per
   second (median of every repetition of every round, min-max): torch's AdamW as it runs on CPU tensors by
   default (a per-parameter loop), with ``foreach=True`` and with ``fused=True``; lightning_zero's host
   AdamW (``kernels/host.py``, what offloaded units step with); DeepSpeed's ``DeepSpeedCPUAdam``
   (JIT-built C++/AVX) when ``deepspeed`` is installed. Each over a GPT-like list of pieces and over one
   flat tensor. Then the mixed-precision case: the step *and* the 16-bit (fp16) copy of the updated
   weights that goes back to the device, which lightning_zero writes in the same pass and the others
   with a cast after the step (DeepSpeed 0.19's engine does the same). Every measurement runs in a fresh
   process with OMP_NUM_THREADS and torch's thread count set; the implementations take turns, round
   after round, so drift on a shared machine reaches them all alike.
2. Training the GPT on N CPU ranks with zero2 / zero3 and with their offloaded versions, interleaved:
   median step time, its ratio to the same stage without offload, and per-rank device and host bytes.

    python benchmarks/offload.py --out benchmarks/results/offload_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import QUIET, emit

IMPLEMENTATIONS = (
    "torch AdamW (default: for-loop)",
    "torch AdamW foreach",
    "torch AdamW fused",
    "lightning_zero host AdamW",
    "DeepSpeedCPUAdam",
)
WITH_COPY = ("torch AdamW fused", "lightning_zero host AdamW", "DeepSpeedCPUAdam")  # the 16-bit copy table
TRAINING = ("zero2", "zero2+offload", "zero3", "zero3+offload")


def _piece_sizes(total: int, d: int = 512) -> list[int]:
    """Parameter sizes of GPT blocks of width ``d`` (qkv, proj, MLP, norms, biases) until ``total`` elements."""
    pattern = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    sizes, filled, k = [], 0, 0
    while filled < total:
        size = min(pattern[k % len(pattern)], total - filled)
        sizes.append(size)
        filled += size
        k += 1
    return sizes


class _HostAdamW:
    """lightning_zero's host AdamW over plain tensors: one call per step for all of them (ZeroOptimizer
    makes one such call for every offloaded unit's runs, see sharding/fused_step.py)."""

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: float, lowp: list | None) -> None:
        from lightning_zero.kernels import host
        from lightning_zero.kernels.adamw import AdamWRun

        self.host, self.run, self.params, self.lowp, self.step_count = host, AdamWRun, params, lowp, 0
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        self.hyper = {"lr": lr, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": weight_decay}

    def step(self) -> None:
        self.step_count += 1
        lowp = self.lowp or [None] * len(self.params)
        runs = [
            self.run(p.detach(), p.grad, m, v, step=self.step_count, lowp_out=out, **self.hyper)
            for p, (m, v), out in zip(self.params, self.moments, lowp)
        ]
        self.host.adamw_step(runs)


def _make_step(name: str, params: list[torch.Tensor], copy: bool):
    """One optimizer step (and with ``copy``, the fp16 copy of the updated weights) as a callable."""
    kwargs = {"lr": 1e-4, "weight_decay": 0.1}
    lowp = [torch.empty_like(p, dtype=torch.float16) for p in params] if copy else None
    if name == "lightning_zero host AdamW":
        return _HostAdamW(params, lowp=lowp, **kwargs).step
    if name == "DeepSpeedCPUAdam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    else:
        extra = {"foreach": True} if "foreach" in name else {"fused": True} if "fused" in name else {"foreach": False}
        optimizer = torch.optim.AdamW(params, **kwargs, **extra)
    if not copy:
        return optimizer.step

    def step_and_copy() -> None:
        optimizer.step()
        for p, out in zip(params, lowp):
            out.copy_(p.detach())

    return step_and_copy


def _step_rate(name: str, numel: int, layout: str, repeats: int, copy: bool) -> list[float]:
    """Parameters per second of each of ``repeats`` steps (after one warm-up step)."""
    sizes = [numel] if layout == "flat" else _piece_sizes(numel)
    params = [torch.randn(n).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    step = _make_step(name, params, copy)
    step()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        rates.append(numel / (time.perf_counter() - start))
    return rates


def _available(name: str) -> bool:
    try:
        _make_step(name, [torch.zeros(8, requires_grad=True)], copy=False)
    except Exception:  # not installed, or its C/C++ extension does not build here
        return False
    return True


def _deepspeed_version() -> str:
    try:
        import deepspeed
    except ImportError:
        return "not installed"
    return deepspeed.__version__


def _measure(name: str, numel: int, layout: str, threads: int, args, copy: bool) -> list[float] | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--one", name, str(numel), layout, str(threads), str(int(copy))]
    out = subprocess.run([*command, "--repeats", str(args.repeats)], env=env, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


def _cell(rates: list[float] | None) -> str:
    if not rates:
        return "n/a"
    return f"{statistics.median(rates) / 1e6:.0f} ({min(rates) / 1e6:.0f}-{max(rates) / 1e6:.0f})"


def _host_step_table(args) -> list[str]:
    tables = []
    for copy, names, layouts in ((False, IMPLEMENTATIONS, ("pieces", "flat")), (True, WITH_COPY, ("flat",))):
        rows = []
        for numel in args.sizes:
            for threads in args.threads:
                for layout in layouts:
                    rates: dict[str, list[float] | None] = {name: [] for name in names}
                    for _ in range(args.rounds):  # the implementations take turns
                        for name in names:
                            got = _measure(name, numel, layout, threads, args, copy)
                            rates[name] = None if got is None or rates[name] is None else rates[name] + got
                    ours, theirs = rates["lightning_zero host AdamW"], rates["DeepSpeedCPUAdam"]
                    ratio = f"{statistics.median(ours) / statistics.median(theirs):.3f}" if ours and theirs else "n/a"
                    pieces = len(_piece_sizes(numel)) if layout == "pieces" else 1
                    cells = " | ".join(_cell(rates[name]) for name in names)
                    rows.append(f"| {numel / 1e6:.0f}M | {threads} | {layout} ({pieces}) | {cells} | {ratio} |")
        tables.append((copy, names, rows))
    lines = []
    for copy, names, rows in tables:
        title = (
            "## 1b. Step and fp16 copy of the updated weights (mixed precision), millions of parameters per second"
            if copy
            else "## 1. Host AdamW step (fp32), millions of parameters per second"
        )
        lines += [
            f"{title}: median (min-max) of {args.rounds} rounds x {args.repeats} steps",
            "",
            "| parameters | threads | tensors | " + " | ".join(names) + " | ours / DeepSpeed |",
            "|---" * (4 + len(names)) + "|",
            *rows,
            "",
        ]
    lines.append(
        "lightning_zero steps offloaded units with `lightning_zero host AdamW` (one call per step for every"
        " unit's runs; `torch AdamW fused` where no C compiler is found). In 1b it writes the fp16 copy in the"
        " same pass; the others cast after the step. n/a: not installed or not buildable here."
    )
    return lines


def _train_worker(rank: int, world: int, args, out_file: str) -> None:
    import lightning.pytorch as pl
    from step_timer import BatchTimer

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    class Timer(BatchTimer):
        def on_train_end(self, trainer, pl_module):
            self.memory = trainer.strategy.memory_bytes()

    results = {name: {"times": []} for name in TRAINING}
    for _ in range(args.rounds):
        for name in TRAINING:
            pl.seed_everything(0)
            config = GPTConfig(vocab_size=32, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
            model = GPTModule(config, max_steps=args.steps)
            data = SyntheticTextDataModule(block_size=64, batch_size=16, num_train=2048, seed=0)
            offload = {"offload_optimizer": "cpu"} if name.endswith("offload") else {}
            zero = ZeroConfig(stage=int(name[4]), reduce_bucket_size=1_000_000, **offload)
            timer = Timer()
            trainer = pl.Trainer(
                strategy=ZeroStrategy(zero),
                accelerator="cpu",
                devices=world,
                max_steps=args.steps,
                callbacks=[timer],
                **QUIET,
            )
            trainer.fit(model, data)
            results[name]["times"] += timer.times[args.warmup :]
            results[name]["memory"] = timer.memory
            results[name]["psi"] = sum(p.numel() for p in model.parameters())
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))


def _training_table(args) -> list[str]:
    from lightning_zero.launch_local import spawn_local_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "results.json")
        spawn_local_ranks(_train_worker, args.world_size, args, out_file)
        results = json.loads(Path(out_file).read_text())
    mib = 2**20
    rows = []
    for name in TRAINING:
        r = results[name]
        median = statistics.median(r["times"])
        base = statistics.median(results[name.removesuffix("+offload")]["times"])
        mem = r["memory"]
        device = sum(v for k, v in mem.items() if not k.startswith("host_"))
        host = sum(v for k, v in mem.items() if k.startswith("host_"))
        q1, _, q3 = statistics.quantiles(r["times"], n=4)
        rows.append(
            f"| {name} | {median * 1e3:.0f} | {q1 * 1e3:.0f}-{q3 * 1e3:.0f} | {median / base:.2f} |"
            f" {device / mib:.1f} | {host / mib:.1f} |"
        )
    psi = results["zero2"]["psi"]
    return [
        f"## 2. Training on {args.world_size} CPU ranks: GPT {args.n_layer} x {args.n_embd} ({psi / 1e6:.1f} M"
        f" parameters), fp32 AdamW, {args.steps} steps x {args.rounds} interleaved rounds, first {args.warmup} dropped",
        "",
        "| strategy | median step ms | IQR ms | x same stage, no offload | device MiB per rank | host MiB per rank |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "On this machine the device is the CPU as well, so offload moves no bytes over a bus: the ratio shows what"
        " the extra host copies (master, fp32 gradient partition) and the fused host step cost, and the byte"
        " columns show what would leave a GPU (`ZeroStrategy.memory_bytes()`).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (both parts)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)  # internal: one host-step measurement
    args = parser.parse_args()
    if args.one:
        name, numel, layout, threads, copy = args.one
        torch.set_num_threads(int(threads))
        rates = _step_rate(name, int(numel), layout, args.repeats, bool(int(copy))) if _available(name) else None
        print(json.dumps(rates))
        return
    lines = [
        "# ZeRO-Offload on the CPU",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores; torch {torch.__version__};"
        f" deepspeed {_deepspeed_version()}",
        f"- command: `python benchmarks/offload.py {' '.join(sys.argv[1:])}`",
        "",
        *_host_step_table(args),
    ]
    if not args.skip_training:
        lines += ["", *_training_table(args)]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

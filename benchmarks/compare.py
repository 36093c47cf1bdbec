"""The same GPT, data, seed and optimizer trained side by side under DDP, FSDP2, DeepSpeed and lightning_zero.

Every system trains once per round, in interleaved rounds (so each sees the machine as the others do):
``torch-ddp`` (``DistributedDataParallel``, plain loop), ``lightning-ddp`` (Lightning's ``DDPStrategy``),
``fsdp2-reshard`` / ``fsdp2-noreshard`` (``fully_shard`` per block then the root, plain loop),
``deepspeed-z1/z2/z3`` (``deepspeed.initialize``, fp32, CPU accelerator; only where ``import deepspeed``
works) and ``zero1/2/3`` (``lightning_zero.ZeroStrategy``). The plain loops reuse ``GPTModule``'s loss,
AdamW param groups and LR schedule, the data module's training set behind the ``DistributedSampler``
Lightning would make, and clip the gradient norm at 1.0 like ``Trainer(gradient_clip_val=1.0)``.
Reported: median step time (warm-up steps dropped) and spread, ratios to lightning-ddp and torch-ddp,
per-rank bytes of parameters / gradients / optimizer state, elements sent per step over Psi, last loss.

Each run (one system, one round) gets N CPU ranks (gloo) of its own, forked from this process, which only
supervises: a run that raises, is killed by a signal or runs past its deadline is a "failed" entry in the
report (the other systems and rounds go on), and with ``--out`` the report is rewritten as each round ends.

    python benchmarks/compare.py --n-layer 2 --n-embd 64 --steps 6 --warmup 2 --rounds 1   # a smoke test
    python benchmarks/compare.py --out benchmarks/results/compare_cpu.md  # every system, GPT 8 x 384, 2 ranks

DeepSpeed rows need ``pip install -e .[bench]`` (or a venv with deepspeed and ``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from common import QUIET, emit, failure_reason
from compare_measure import count_collectives, deepspeed_bytes, torch_bytes
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.launch_local import spawn_local_ranks
from lightning_zero.models.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPT, GPTConfig, GPTModule

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator when imported
try:
    import deepspeed
except ImportError:
    deepspeed = None

SYSTEMS = ("torch-ddp", "lightning-ddp", "fsdp2-reshard", "fsdp2-noreshard")
SYSTEMS += ("deepspeed-z1", "deepspeed-z2", "deepspeed-z3", "zero1", "zero2", "zero3")
LIGHTNING = ("lightning-ddp", "zero1", "zero2", "zero3")
# Elements per step over Psi in the ZeRO paper's accounting: an all-reduce is a reduce-scatter plus an all-gather.
FORMULA = {"torch-ddp": 2, "lightning-ddp": 2, "fsdp2-reshard": 3, "fsdp2-noreshard": 2}
FORMULA.update({"deepspeed-z1": 2, "deepspeed-z2": 2, "deepspeed-z3": 3, "zero1": 2, "zero2": 2, "zero3": 3})
# Each run's ranks (see _run): a collective waits at most 600 s, a run still going after 1800 s is killed.
RANKS = {"timeout_s": 600, "deadline_s": 1800, "start_method": "fork"}


def _gpt_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=32, block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)


def _data(args) -> SyntheticTextDataModule:
    return SyntheticTextDataModule(block_size=args.block_size, batch_size=args.batch_size, num_train=2048, seed=0)


def _deepspeed_engine(module: GPTModule, optimizer, scheduler, stage: int, args):
    deepspeed.init_distributed(dist_backend="gloo")  # a no-op: the process group spawn_local_ranks made is reused
    zero = {"stage": stage, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket}
    if stage == 3:
        zero.update(stage3_max_live_parameters=2 * args.bucket, stage3_prefetch_bucket_size=args.bucket)
    config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_clipping": 1.0, "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=module.gpt, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def plain_run(name: str, rank: int, world: int, args) -> dict:
    """One plain-loop training run; ``module.gpt`` is replaced by its wrapper, so GPTModule's loss runs it."""
    pl.seed_everything(0, verbose=False)
    module = GPTModule(_gpt_config(args), max_steps=args.steps)
    module.configure_model()
    train_set = _data(args).train_set
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)  # as Lightning's
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    if name == "torch-ddp":
        module.gpt = DistributedDataParallel(module.gpt)
    elif name.startswith("fsdp2"):
        for block in module.gpt.blocks:
            fully_shard(block, reshard_after_forward=name == "fsdp2-reshard")
        fully_shard(module.gpt, reshard_after_forward=name == "fsdp2-reshard")
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    if name.startswith("deepspeed"):
        module.gpt = engine = _deepspeed_engine(module, optimizer, scheduler, int(name[-1]), args)
        backward, update, held = engine.backward, engine.step, lambda: deepspeed_bytes(engine)
    else:

        def backward(loss):
            loss.backward()

        def update():
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

        def held():
            return torch_bytes(module, optimizer)

    times, sent = [], [0]
    with count_collectives(sent):
        for step, batch in zip(range(args.steps), loader):
            start = time.perf_counter()
            loss = module._loss(batch)
            backward(loss)
            if step == args.steps - 1:  # between backward and update, where every system holds its gradients
                memory = held()
            update()
            times.append(time.perf_counter() - start)
    per_step = None if name == "torch-ddp" else sent[0] / args.steps  # DDP's reducer runs in C++, unseen
    return {"times": times, "bytes": memory, "elements_per_step": per_step, "loss": loss.item()}


class Probe(pl.Callback):
    """Times each training step; keeps the last loss and, for DDP, the bytes held at the last step."""

    def __init__(self, steps: int) -> None:
        self.steps, self.times, self.bytes = steps, [], {}

    def on_train_start(self, trainer, pl_module):
        self.traffic = trainer.strategy.traffic.copy() if isinstance(trainer.strategy, ZeroStrategy) else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.steps - 1 and not isinstance(trainer.strategy, ZeroStrategy):
            self.bytes = torch_bytes(pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.start)
        self.loss = outputs["loss"]


def lightning_run(name: str, rank: int, world: int, args) -> dict:
    pl.seed_everything(0, verbose=False)
    if name == "lightning-ddp":
        strategy = DDPStrategy()
    else:
        config = ZeroConfig(stage=int(name[-1]), reduce_bucket_size=args.bucket, max_live_parameters=2 * args.bucket)
        strategy = ZeroStrategy(config)
    probe = Probe(args.steps)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        callbacks=[probe],
        **QUIET,
    )
    trainer.fit(GPTModule(_gpt_config(args), max_steps=args.steps), _data(args))
    run = {"times": probe.times, "bytes": probe.bytes, "elements_per_step": None, "loss": probe.loss.item()}
    if isinstance(strategy, ZeroStrategy):
        run["bytes"] = strategy.memory_bytes()
        run["bytes"]["optimizer_state"] += run["bytes"].pop("master")
        moved = sum(strategy.traffic.since(probe.traffic).elements[k] for k in ("reduce_scatter", "all_gather"))
        run["elements_per_step"] = moved / trainer.global_step
    return run


def _worker(rank: int, world: int, args, name: str, out_file: str) -> None:
    """One run of ``name``; rank 0 writes its measurement whole, then renames it into place (never half a file)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed calls deprecated collectives
    if deepspeed is not None:
        deepspeed.utils.logger.setLevel(logging.WARNING)
    run = (lightning_run if name in LIGHTNING else plain_run)(name, rank, world, args)
    loss = torch.tensor(run.pop("loss"))
    dist.all_reduce(loss)
    if rank == 0:
        run.update(times=run["times"][args.warmup :], loss=loss.item() / world)
        partial = Path(f"{out_file}.partial")
        partial.write_text(json.dumps(run))
        partial.replace(out_file)


def _run(name: str, args, out_file: Path) -> tuple[dict | None, str | None]:
    """One run of ``name`` in ranks of its own: rank 0's measurement (None without one) and why a rank failed
    (None if none did). Forked ranks end with ``os._exit``, so the interpreter's finalization never runs in them:
    there, gloo threads of a group that outlived ``destroy_process_group`` (FSDP2 and DeepSpeed keep the world's)
    can abort the rank. Forking also saves each run the ranks' imports (~5 s)."""
    out_file.unlink(missing_ok=True)
    failure = None
    try:
        spawn_local_ranks(_worker, args.world_size, args, name, str(out_file), **RANKS)
    except (ProcessException, TimeoutError) as error:
        failure = failure_reason(error).replace("|", "\\|")  # (a Markdown table's cell)
    return (json.loads(out_file.read_text()) if out_file.exists() else None), failure


def _record(result: dict, round_: int, run: dict | None, failure: str | None) -> str:
    """Adds a run to ``result``; returns how it went, for the progress line."""
    if run is not None:
        result["times"] += run.pop("times")
        result.update(run)
    if failure is not None:  # a rank that fails after rank 0 wrote the measurement (in teardown) keeps the run
        failure += ", after its measurement (kept)" if run else ""
        result["failures"].append(f"round {round_}: {failure}")
        return f"failed: {failure}"
    return f"median {statistics.median(result['times']) * 1e3:.1f} ms so far"


def _cpu() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor()
    )


def _row(name: str, r: dict, medians: dict, psi: int) -> str:
    failed = "; ".join(r["failures"]) or "-"
    if not r["times"]:
        return f"| {name} | failed |" + " - |" * 10 + f" {failed} |"
    times = [t * 1e3 for t in r["times"]]
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    ratios = [
        f"{medians[name] / medians[ref]:.2f}x" if ref in medians else "-" for ref in ("lightning-ddp", "torch-ddp")
    ]
    mem = [r["bytes"][k] for k in ("parameters", "gradients", "optimizer_state")]
    sent = "not measured" if r["elements_per_step"] is None else f"{r['elements_per_step'] / psi:.2f}"
    cells = [f"{medians[name] * 1e3:.1f}", f"{q1:.1f}-{q3:.1f}", f"{min(times):.1f}-{max(times):.1f}", *ratios]
    cells += [f"{b / 2**20:.2f}" for b in (*mem, sum(mem))] + [f"{sent} ({FORMULA[name]})", f"{r['loss']:.4f}"]
    return f"| {name} | " + " | ".join([*cells, failed]) + " |"


def _table(results: dict, args, skipped: list[str], done: int) -> str:
    """The report after ``done`` of the rounds."""
    with torch.device("meta"):  # no kernel runs here: this process stays free of threads to fork from
        psi = GPT(_gpt_config(args)).num_params()
    medians = {name: statistics.median(r["times"]) for name, r in results.items() if r["times"]}
    versions = f"torch {torch.__version__}, lightning {pl.__version__}"
    versions += f", deepspeed {deepspeed.__version__}" if deepspeed is not None else ""
    command = shlex.join(["python", "benchmarks/compare.py", *sys.argv[1:]])
    rounds = f"{args.rounds} interleaved rounds" + (f" ({done} done so far)" if done < args.rounds else "")
    lines = [
        f"# DDP vs FSDP2 vs DeepSpeed vs lightning_zero on {args.world_size} CPU ranks (gloo)",
        "",
        f"- date: {datetime.date.today().isoformat()}; machine: {_cpu()}, {os.cpu_count()} cores; {versions}",
        f"- model: GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size}, Psi = {psi:,} parameters;"
        f" per-rank batch {args.batch_size}; fp32; {args.steps} steps x {rounds}, first"
        f" {args.warmup} steps of each run dropped; buckets {args.bucket:,} elements; each run in ranks of its own",
        f"- command: `{command}` (python: `{sys.executable}`)",
    ]
    lines += [f"- {name}: skipped, deepspeed is not installed" for name in skipped]
    lines += [
        "",
        "| system | median step (ms) | IQR (ms) | min-max (ms) | vs lightning-ddp | vs torch-ddp | params MiB"
        " | grads MiB | optimizer state MiB | total MiB | sent per step / Psi (formula) | last loss | failed runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(name, r, medians, psi) for name, r in results.items()]
    lines += [
        "",
        "Step time: from the batch in hand to the optimizer step done (forward, backward, clipping, step, LR step,",
        "zero_grad), rank 0. Last loss: the mean over ranks of the last step's loss; every system trains the same",
        "model from the same seed on the same batches, so these agree unless a run is broken.",
        "",
        "Memory: this rank's, at the last step, after backward. DDP: parameters, `.grad` and AdamW state. FSDP2:",
        "local shards (`to_local()`) of the same. DeepSpeed: stages 1/2 the flat model parameters (whole) and the",
        "gradients held (`.grad` and reduced partitions); stage 3 the parameter partitions plus what is gathered",
        "(small ones persist) and its gradient partition buffer; optimizer state is its fp32 master partition (kept",
        "even in fp32) plus Adam's state. zero*: `ZeroStrategy.memory_bytes()`, optimizer state = master partition",
        "+ Adam's state, at train end. Not counted anywhere: buckets in flight, units gathered for a moment.",
        "",
        "Sent per step: measured for zero* (`ZeroStrategy.traffic`: reduce-scatters and",
        "all-gathers) and for FSDP2 and DeepSpeed (every torch.distributed collective called from Python, an",
        "all-reduce counted twice its size, the loss scalars included); DDP's all-reduce runs in C++ and is not",
        "measured. The formula in parentheses is the ZeRO paper's: 2 Psi for DDP and stages 1/2, 3 Psi for stage 3",
        "and FSDP2 resharding after forward. DeepSpeed's stages 1/2 all-reduce gradient buckets (its default",
        "`use_multi_rank_bucket_allreduce`) before all-gathering the updated partitions: 3 Psi. Stage 3's units /",
        "parameters under the persistence threshold (1e5 elements, both defaults) are gathered once per step.",
    ]
    return "\n".join(lines) + "\n"


def _arguments() -> tuple[argparse.Namespace, list[str], list[str]]:
    """The arguments, the systems to run and those skipped (deepspeed not installed)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=1_000_000)
    parser.add_argument("--systems", default="", help=f"comma-separated subset of: {', '.join(SYSTEMS)}")
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    args = parser.parse_args()
    chosen = args.systems.split(",") if args.systems else list(SYSTEMS)
    if unknown := set(chosen) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.steps > 2048 // (args.world_size * args.batch_size) or args.warmup >= args.steps:
        parser.error("need warmup < steps <= one epoch (2048 sequences / (world size x batch size))")
    skipped = [name for name in chosen if name.startswith("deepspeed") and deepspeed is None]
    return args, [name for name in chosen if name not in skipped], skipped


def main() -> None:
    args, systems, skipped = _arguments()
    results = {name: {"times": [], "failures": []} for name in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            for name in systems:
                how = _record(results[name], round_, *_run(name, args, Path(tmp) / "run.json"))
                print(f"round {round_} of {args.rounds}, {name}: {how}", file=sys.stderr, flush=True)
            if args.out is not None and round_ < args.rounds:  # a crash here loses at most the round in flight
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(_table(results, args, skipped, done=round_))
    emit(_table(results, args, skipped, done=args.rounds), args.out)


if __name__ == "__main__":
    main()

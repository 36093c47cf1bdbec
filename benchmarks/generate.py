"""``generate()`` inside ``validation_step``: ddp, zero2 and zero3 side by side on N CPU ranks.

A stage-3 validation step keeps the units it gathered while they fit ``max_live_parameters``
(stage3_schedule.py), so generating T tokens costs one gather per unit instead of T. The row "zero3,
per token" sets ``max_live_parameters`` to the largest unit, so nothing is kept and every token gathers
every unit again (what every stage-3 validation step did before). The model is a Hugging Face GPT-2 that
is wide for its sequence, so that communication dominates: the case stage 3 pays most for.

One invocation spawns the ranks once and runs every configuration in them, in interleaved rounds; it
reports the median validation step (first of each run dropped) with its spread, the ratio to zero2, the
all-gathers per step, and whether every configuration generated the same tokens.

    python benchmarks/generate.py --out benchmarks/results/generate_cpu_<date>.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import QUIET, emit
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.launch_local import spawn_local_ranks
from lightning_zero.sharding import collectives

CONFIGS = ("ddp", "zero2", "zero3", "zero3, per token")


class Generation(pl.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        positions = args.prompt + args.new_tokens
        config = GPT2Config(
            vocab_size=args.vocab, n_embd=args.n_embd, n_layer=args.n_layer, n_head=8, n_positions=positions,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)
        self.args = args
        prompts = torch.randint(1, args.vocab, (args.batches * args.batch * args.world, args.prompt))
        self.data = TensorDataset(prompts)
        self.times: list[float] = []
        self.gathers: list[int] = []
        self.tokens: list[torch.Tensor] = []

    def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
        self.issued = contextlib.ExitStack()  # the whole step: the strategy gathers the root unit before it
        self.recorded = self.issued.enter_context(collectives.record())
        self.start = time.perf_counter()

    def validation_step(self, batch, batch_idx):
        out = self.model.generate(
            batch[0], max_new_tokens=self.args.new_tokens, min_new_tokens=self.args.new_tokens, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        self.tokens.append(out[:, batch[0].shape[1] :])

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.times.append(time.perf_counter() - self.start)
        self.issued.close()
        self.gathers.append(sum(op == "all_gather" for op, *_ in self.recorded))

    def val_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.data, batch_size=self.args.batch, sampler=sampler)


def _strategy(name: str, largest_unit: int):
    if name == "ddp":
        return DDPStrategy()
    if name == "zero2":
        return ZeroStrategy(ZeroConfig(stage=2))
    live = largest_unit if name.endswith("per token") else 1_000_000_000
    return ZeroStrategy(ZeroConfig(stage=3, param_persistence_threshold=0, max_live_parameters=live))


def _worker(rank: int, world: int, args, out_file: str) -> None:
    torch.manual_seed(0)
    largest = max(sum(p.numel() for p in block.parameters()) for block in Generation(args).model.transformer.h)
    results = {name: {"times": [], "gathers": [], "tokens": None} for name in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            torch.manual_seed(0)
            module = Generation(args)
            trainer = pl.Trainer(
                strategy=_strategy(name, largest),
                accelerator="cpu",
                devices=world,
                **{**QUIET, "limit_val_batches": None},
            )
            trainer.validate(module, verbose=False)
            results[name]["times"] += module.times[1:]
            results[name]["gathers"] = module.gathers
            tokens = torch.cat(module.tokens)
            if results[name]["tokens"] is None:
                results[name]["tokens"] = tokens
            assert torch.equal(results[name]["tokens"], tokens), f"{name}: other tokens in another round"
    same = all(torch.equal(results[name]["tokens"], results["ddp"]["tokens"]) for name in CONFIGS)
    every = collectives.all_gather_object(same)
    if rank == 0:
        summary = {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}
        Path(out_file).write_text(json.dumps({"results": summary, "same_tokens": all(every)}))


def _report(data: dict, world: int, args) -> str:
    results = data["results"]
    zero2 = statistics.median(results["zero2"]["times"])
    lines = [
        f"# generate() in validation_step on {world} CPU ranks (gloo)",
        "",
        f"- date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores; torch {torch.__version__},"
        f" lightning {pl.__version__}",
        f"- model: Hugging Face GPT-2, n_layer={args.n_layer}, n_embd={args.n_embd}, vocab={args.vocab}; per-rank"
        f" batch {args.batch}, prompt {args.prompt} tokens, {args.new_tokens} new tokens (greedy); {args.batches}"
        f" validation batches x {args.rounds} interleaved rounds, the first step of each run dropped",
        f"- command: `python benchmarks/generate.py {' '.join(sys.argv[1:])}`",
        f"- every configuration generated the same tokens as ddp: {data['same_tokens']}",
        "",
        "| configuration | median step (ms) | spread (min-max) | vs zero2 | all-gathers per step |",
        "|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        times = results[name]["times"]
        median = statistics.median(times)
        gathers = sorted(set(results[name]["gathers"]))
        lines.append(
            f"| {name} | {median * 1e3:.1f} | {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} |"
            f" {median / zero2:.2f}x | {', '.join(map(str, gathers))} |"
        )
    lines += [
        "",
        "zero3 runs with `param_persistence_threshold=0` (every block a unit gathered and freed); 'per token' with",
        "`max_live_parameters` equal to one block, so a validation step keeps nothing and each new token gathers",
        "every unit again. ddp and zero2 gather nothing (the all-gathers of zero2 are the post-step ones; there is",
        "no step here).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "results.json")
        spawn_local_ranks(_worker, args.world, args, out_file)
        emit(_report(json.loads(Path(out_file).read_text()), args.world, args), args.out)


if __name__ == "__main__":
    main()

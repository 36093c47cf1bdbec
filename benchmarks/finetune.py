"""A LoRA fine-tune of a Hugging Face Llama with 100M+ frozen parameters on N CPU ranks, side by side:
ddp, zero2, zero3 (frozen base sharded) in fp32, and zero3 under bf16-mixed with bf16 gathers and with
fp32 gathers. Per rank: persistent bytes (parameters / gradients / optimizer state), the bytes alive
between forward and backward (what autocast and the gathers keep for backward; profiled on the CPU
saved tensors), bytes sent per step, and the median step time (ratio to ddp). One spawn, configurations
interleaved per round, so the machine's state is shared.

    python benchmarks/finetune.py --out benchmarks/results/finetune_llama_cpu_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import QUIET, emit
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.launch_local import spawn_local_ranks
from lightning_zero.planning.memory import SavedBytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from finetune_hf import LoRA  # noqa: E402

CONFIGS = {  # name: (strategy factory, precision)
    "ddp": (lambda: DDPStrategy(), "32-true"),
    "zero2": (lambda: ZeroStrategy(ZeroConfig(stage=2)), "32-true"),
    "zero3": (lambda: ZeroStrategy(ZeroConfig(stage=3, param_persistence_threshold=0)), "32-true"),
    "zero3 bf16 gathers": (lambda: ZeroStrategy(ZeroConfig(stage=3, param_persistence_threshold=0)), "bf16-mixed"),
    "zero3 fp32 gathers": (
        lambda: ZeroStrategy(ZeroConfig(stage=3, param_persistence_threshold=0, gather_dtype="float32")),
        "bf16-mixed",
    ),
}


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=4,
        max_position_embeddings=args.seq, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


class Tune(pl.LightningModule):
    def __init__(self, config, seq: int, batch: int, steps: int) -> None:
        super().__init__()
        self.config, self.batch = config, batch
        self.model = None
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(config.vocab_size, (batch * steps * 8, seq + 1), generator=g)
        self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def configure_model(self):
        if self.model is None:
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM(self.config)
            self.model.requires_grad_(False)
            for module in list(self.model.modules()):
                for name, child in list(module.named_children()):
                    if name in ("q_proj", "v_proj"):
                        setattr(module, name, LoRA(child))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(self.data, batch_size=self.batch, sampler=DistributedSampler(self.data, world, rank, False))


class Probe(pl.Callback):
    """Step times; on the profiled step, bytes autograd keeps from forward to backward; bytes sent per step; memory."""

    def __init__(self, profiled_step: int) -> None:
        self.profiled_step = profiled_step
        self.times: list[float] = []
        self.alive = 0
        self._saved = SavedBytes()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self._traffic = trainer.strategy.traffic.copy() if isinstance(trainer.strategy, ZeroStrategy) else None
        if batch_idx == self.profiled_step:
            self._saved.start()
        self._start = time.perf_counter()

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == self.profiled_step:
            self.alive = self._saved.stop()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != self.profiled_step:
            self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer, pl_module):
        steps = trainer.global_step - 1
        strategy = trainer.strategy
        if isinstance(strategy, ZeroStrategy):
            sent = strategy.traffic.since(self._traffic).bytes
            self.sent = sum(sent[k] for k in ("all_gather", "reduce_scatter", "all_reduce")) / max(steps, 1)
            mem = strategy.memory_bytes()
            self.memory = {"parameters": mem["parameters"], "gradients": mem["gradients"]}
            self.memory["optimizer_state"] = mem["master"] + mem["optimizer_state"]
        else:
            (optimizer,) = trainer.optimizers
            self.memory = {
                "parameters": sum(p.nbytes for p in pl_module.parameters()),
                "gradients": sum(p.nbytes for p in pl_module.parameters() if p.requires_grad),
                "optimizer_state": sum(
                    v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
                ),
            }
            # DDP's gradient all-reduce is not ours to count: the trainable gradients, once each way
            self.sent = 2 * self.memory["gradients"]


def _worker(rank: int, world: int, args, out_file: str) -> None:
    results = {name: {"times": []} for name in CONFIGS}
    config = llama_config(args)
    for _ in range(args.rounds):
        for name, (make_strategy, precision) in CONFIGS.items():
            pl.seed_everything(0)
            module = Tune(config, args.seq, args.batch, args.steps)
            probe = Probe(profiled_step=args.steps - 1)
            trainer = pl.Trainer(
                strategy=make_strategy(),
                accelerator="cpu",
                devices=world,
                precision=precision,
                max_steps=args.steps,
                callbacks=[probe],
                **QUIET,
            )
            trainer.fit(module)
            results[name]["times"] += probe.times[1:]  # the first step warms up
            results[name].update(memory=probe.memory, alive=probe.alive, sent=probe.sent)
            frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
            trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
            results[name].update(frozen=frozen, trainable=trainable)
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "results.json")
        spawn_local_ranks(_worker, args.world_size, args, out_file, timeout_s=600, deadline_s=7200)
        results = json.loads(Path(out_file).read_text())
    mib = 2**20
    ddp = statistics.median(results["ddp"]["times"])
    first = next(iter(results.values()))
    lines = [
        f"# LoRA fine-tune of a Hugging Face Llama on {args.world_size} CPU ranks (gloo)",
        "",
        f"- date: {datetime.date.today()}; machine: {platform.processor() or platform.machine()},"
        f" {torch.get_num_threads() * args.world_size} threads; torch {torch.__version__}, lightning {pl.__version__}",
        f"- model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, untied head;"
        f" {first['frozen']:,} frozen parameters, {first['trainable']:,} trainable (LoRA r=8 on q_proj and"
        f" v_proj); per-rank batch {args.batch} x {args.seq} tokens; {args.steps} steps x {args.rounds} rounds",
        f"- command: `python benchmarks/finetune.py {' '.join(sys.argv[1:])}`",
        "",
        "| configuration | step (s), median [min-max] | vs ddp | parameters MiB | gradients MiB |"
        " optimizer state MiB | alive fwd->bwd MiB | sent per step MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        t = r["times"]
        m = r["memory"]
        lines.append(
            f"| {name} | {statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}] | {statistics.median(t) / ddp:.2f}x |"
            f" {m['parameters'] / mib:.1f} | {m['gradients'] / mib:.2f} | {m['optimizer_state'] / mib:.2f} |"
            f" {r['alive'] / mib:.1f} | {r['sent'] / mib:.1f} |"
        )
    frozen, trainable = first["frozen"], first["trainable"]
    formula = (4 * frozen + 16 * trainable) / args.world_size / mib
    lines += [
        "",
        f"Formula for zero3 (frozen bytes + 16 x trainable) / N = {formula:.1f}"
        " MiB per rank in fp32; with bf16 gathers the shards are bf16 (2 bytes) and the fp32 master covers the"
        " trainable parameters only. 'alive fwd->bwd' is what autograd keeps from forward to backward (saved"
        " tensors' storages at the end of forward: activations, autocast's weight copies, gathered weights)."
        " 'sent' counts what each rank's collectives move (ddp: its gradient all-reduce, 2 x the trainable gradients).",
        "ddp's and zero2's 'alive' includes the whole weights, which backward reads (they are resident anyway);",
        "zero3 frees every unit after forward and gathers it again for backward. On CPUs without native bf16",
        "matmuls the bf16-mixed rows measure bytes, not speed.",
    ]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

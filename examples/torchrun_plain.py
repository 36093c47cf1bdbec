"""A plain PyTorch training loop with ZeRO, launched by torchrun (no Trainer, no Fabric in sight).

    torchrun --nproc-per-node=2 examples/torchrun_plain.py --stage 3

A small GPT learns to continue a repeating token pattern; each rank takes its share of every global batch.
It checkpoints at the end, then loads the checkpoint into a fresh engine and checks the weights came back.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F

import lightning_zero
from lightning_zero import ZeroConfig
from lightning_zero.models.gpt import GPT, GPTConfig


def batches(steps: int, global_batch: int, rank: int, world: int, cfg: GPTConfig):
    """Sequences of a pattern of period 7 at random offsets; rank r takes rows r, r + world, ..."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.arange(cfg.vocab_size)[torch.randperm(cfg.vocab_size, generator=g)][:7]
    for _ in range(steps):
        offsets = torch.randint(0, 7, (global_batch,), generator=g)
        positions = offsets[:, None] + torch.arange(cfg.block_size + 1)
        tokens = pattern[positions % 7][rank::world]
        yield tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed", "16-mixed"))
    args = parser.parse_args()

    cfg = GPTConfig(n_layer=2, n_embd=64, block_size=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = lightning_zero.initialize(model, optimizer, ZeroConfig(stage=args.stage), precision=args.precision)

    losses = []
    for step, (x, y) in enumerate(batches(args.steps, 16, engine.rank, engine.world_size, cfg)):
        logits = engine(x.to(engine.device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(engine.device).flatten())
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(loss.item())
        if engine.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    saved = engine.state_dict()
    directory = engine.fabric.broadcast(tempfile.mkdtemp() if engine.rank == 0 else None)
    engine.save(f"{directory}/ckpt", step=args.steps)
    torch.manual_seed(1)  # another model and optimizer, the checkpoint loaded into them
    other = GPT(cfg)
    fresh = lightning_zero.initialize(other, torch.optim.AdamW(other.parameters(), lr=3e-3), ZeroConfig(stage=3))
    extra = fresh.load(f"{directory}/ckpt")
    loaded = fresh.state_dict()
    same = all(torch.equal(loaded[k].float(), v.float()) for k, v in saved.items())
    if engine.rank == 0:
        print(f"world {engine.world_size}, zero{args.stage}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"checkpoint of step {extra['step']} loaded into zero3: weights {'equal' if same else 'DIFFER'}")
    fresh.close()
    if not same or not losses[-1] < losses[0]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""Convergence with ZeRO++: the main job's GPT (configs/gpt.yaml: 4 x 128, lr 3e-3, warmup 30, clipping 1.0,
global batch 32 x 64 tokens) trained at zero3 on 4 CPU ranks as 2 "nodes" of 2 (``node_size=2``), plain and
with quantized weights, a secondary partition and quantized gradients together (int8 gradients, and int4);
the mean loss over the ranks at every step, the final loss (mean of the last 50 steps) side by side, and the
curves in one SVG.

    python benchmarks/zero_plus_plus_convergence.py --out benchmarks/results/zero_plus_plus_convergence_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

from common import QUIET, emit

RUNS = {
    "plain zero3": {},
    "zero3 + qwZ + hpZ + qgZ": {"quantized_weights": True, "secondary_partition": True, "quantized_gradients": True},
    "zero3 + qwZ + hpZ + qgZ with int4 gradients": {
        "quantized_weights": True,
        "secondary_partition": True,
        "quantized_gradients": True,
        "quantized_gradient_bits": 4,
    },
}
TAIL = 50


def _worker(rank: int, world: int, steps: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from lightning_zero import ZeroConfig, ZeroStrategy
    from lightning_zero.models.data import SyntheticTextDataModule
    from lightning_zero.models.gpt import GPTConfig, GPTModule

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    curves = {}
    for name, options in RUNS.items():
        pl.seed_everything(1234)
        config = GPTConfig(vocab_size=32, block_size=64, n_layer=4, n_head=4, n_embd=128)
        model = GPTModule(config, lr=3e-3, warmup_steps=30, max_steps=steps)
        data = SyntheticTextDataModule(vocab_size=32, block_size=64, batch_size=32 // world)
        zero = ZeroConfig(stage=3, node_size=2, reduce_bucket_size=200_000, **options)
        losses = Losses()
        trainer = pl.Trainer(
            strategy=ZeroStrategy(zero),
            accelerator="cpu",
            devices=world,
            max_steps=steps,
            gradient_clip_val=1.0,
            callbacks=[losses],
            **QUIET,
        )
        trainer.fit(model, data)
        mean = torch.tensor(losses.losses)
        dist.all_reduce(mean)
        curves[name] = (mean / world).tolist()
    if rank == 0:
        Path(out_dir, "curves.json").write_text(json.dumps(curves))


def svg(curves: dict[str, list[float]], width: int = 640, height: int = 320) -> str:
    """The loss curves as one SVG line chart (log-free, shared axes)."""
    top = max(max(c) for c in curves.values())
    bottom = min(min(c) for c in curves.values())
    steps = max(len(c) for c in curves.values())
    colors = ("#1f77b4", "#d62728", "#2ca02c")

    def point(i: int, value: float) -> str:
        return f"{40 + i * (width - 60) / (steps - 1):.1f},{20 + (top - value) * (height - 50) / (top - bottom):.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="12">']
    parts.append(f'<rect width="{width}" height="{height}" fill="white"/>')
    for k, (name, curve) in enumerate(curves.items()):
        points = " ".join(point(i, v) for i, v in enumerate(curve))
        parts.append(f'<polyline fill="none" stroke="{colors[k]}" stroke-width="1" points="{points}"/>')
        parts.append(f'<text x="{width - 250}" y="{20 + 16 * k}" fill="{colors[k]}">{name}</text>')
    parts.append(f'<text x="40" y="{height - 8}">step 0 .. {steps - 1}; loss {bottom:.2f} .. {top:.2f}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from lightning_zero.launch_local import spawn_local_ranks

    with tempfile.TemporaryDirectory() as tmp:
        spawn_local_ranks(_worker, 4, args.steps, tmp, deadline_s=3600.0)
        curves = json.loads(Path(tmp, "curves.json").read_text())
    finals = {name: sum(c[-TAIL:]) / TAIL for name, c in curves.items()}
    plain = finals["plain zero3"]
    picture = None
    if args.out is not None:
        picture = args.out.with_suffix(".svg")
        picture.parent.mkdir(parents=True, exist_ok=True)
        picture.write_text(svg(curves))
        picture.with_suffix(".json").write_text(json.dumps(curves))
    lines = [
        "# Convergence with ZeRO++ (the main job's GPT, 4 CPU ranks as 2 nodes of 2)",
        "",
        f"- date: {datetime.date.today()}; command: `python benchmarks/zero_plus_plus_convergence.py"
        f" --steps {args.steps}`",
        "",
        f"| run | first loss | final loss (mean of the last {TAIL} steps) |",
        "|---|---|---|",
        *(f"| {name} | {curves[name][0]:.5f} | {finals[name]:.5f} |" for name in curves),
        "",
        *(
            f"{name} against plain: {100 * (final - plain) / plain:+.3f}% of the final loss; largest difference at"
            f" any step {max(abs(a - b) for a, b in zip(curves[name], curves['plain zero3'])):.4f}."
            for name, final in finals.items()
            if name != "plain zero3"
        ),
    ]
    if picture is not None:
        lines += ["", f"Curves: `{picture.name}` (beside this file; the values in `{picture.stem}.json`)."]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

"""One "node" of a multi-node run on loopback (test_multinode.py starts one of these per node, the way a
user starts one per machine): trains BlocksNet with zero1, zero2, zero3 and zero2 sharded per node
(hybrid) in turn on
``--nodes`` x ``--devices`` ranks, saving a sharded checkpoint at the end of the first epoch, or resuming
from one; rank 0 writes the final weights of each stage to ``--out``.

Launched by Lightning (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set; Lightning starts the node's
other local ranks by running this script again) or by ``torchrun --nnodes ... --node-rank ...``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.support.helpers import EquivalenceModule, zero_strategy

HALF = 3  # optimizer steps per epoch; the run takes two epochs
# (name, stage, ZeroConfig options): with "node" each node's ranks shard together and the nodes replicate
RUNS = [("z1", 1, {}), ("z2", 2, {}), ("z3", 3, {}), ("z2-node", 2, {"shard_group_size": "node"})]


def main(argv: list[str] | None = None) -> None:
    """One rank of a node (``argv`` None: the command line; the test's one-node resume calls it on the shared
    ranks)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save", type=Path, help="write a checkpoint per stage under this directory")
    parser.add_argument("--resume", type=Path, help="resume each stage from the checkpoint under this directory")
    args = parser.parse_args(argv)
    results = {}
    for name, stage, extra in RUNS:
        pl.seed_everything(0)
        module = EquivalenceModule("blocks", steps=HALF)
        callbacks = [ModelCheckpoint(args.save / name, every_n_train_steps=HALF, save_top_k=-1)] if args.save else []
        trainer = pl.Trainer(
            strategy=zero_strategy(stage, reduce_bucket_size=200, param_persistence_threshold=0, **extra),
            accelerator="cpu",
            devices=args.devices,
            num_nodes=args.nodes,
            max_steps=2 * HALF,
            accumulate_grad_batches=2,
            gradient_clip_val=0.05,
            use_distributed_sampler=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(args.save),
            logger=False,
            callbacks=callbacks,
        )
        ckpt = str(args.resume / name / f"epoch=0-step={HALF}.ckpt") if args.resume else None
        trainer.fit(module, ckpt_path=ckpt)
        assert trainer.world_size == args.nodes * args.devices, trainer.world_size
        assert trainer.global_step == 2 * HALF
        state = {k: v.clone() for k, v in trainer.strategy.gather_module().state_dict().items()}
        results[name] = state
    where = {"global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "local_rank": trainer.local_rank}
    (args.out.parent / f"{args.out.name}.rank{trainer.global_rank}").write_text(json.dumps(where))
    if trainer.global_rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()

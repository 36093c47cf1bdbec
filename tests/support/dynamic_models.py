"""Models whose control flow depends on the data, so ranks run different parts of them in one step.

Every branch acts per sample (a unit runs on the samples that need it, and not at all on a rank with
none), so a sharded run over the ranks' slices of a batch computes exactly what one process computes
on the whole batch: the tests can demand equality with a single-process run, while the ranks run
different units and parameters get gradients on some ranks only.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as activation_checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DIM, VOCAB, SEQ = 8, 11, 4
trace: list[str] = []  # which data-dependent parts ran in this process (tests check that ranks differed)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(self.norm(h)))


class BranchBlock(Block):
    """A data-dependent branch inside a unit: ``extra`` runs on a few samples, on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = super().forward(h)
        picked = h[:, 0] - h[:, 1] > 1.0  # about one sample in eight
        if picked.any():
            trace.append("extra")
            h = h.clone()
            h[picked] = h[picked] + torch.tanh(self.extra(h[picked]))
        return h


class MoE(nn.Module):
    """Top-1 mixture of experts routed by the data; an expert no sample chose does not run."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM)) for _ in range(experts)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(h), dim=-1)  # (B, experts)
        choice = weights.argmax(-1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(-1)
            if rows.numel():
                trace.append(f"expert{i}")
                out = out.index_add(0, rows, expert(h[rows]) * weights[rows, i, None])
        return h + out


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = MoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(self.norm(h))


@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    gate: torch.Tensor


class ContainerBlock(Block):
    """Returns a dataclass, not a tensor (as Hugging Face layers return ModelOutput containers)."""

    def forward(self, h: torch.Tensor) -> BlockOutput:  # type: ignore[override]
        hidden = super().forward(h)
        return BlockOutput(hidden=hidden, gate=torch.sigmoid(hidden.mean(-1, keepdim=True)))


class DynamicNet(nn.Module):
    """Embedding and head (the root unit) around units chosen by ``kind``:

    - ``branch``: a branch inside a unit runs on some ranks only;
    - ``moe``: blocks with a mixture of experts inside (the experts belong to their block's unit);
    - ``experts``: a top-level mixture whose experts are units themselves, skipped where no sample chose them;
    - ``skip``: a unit applied to some samples only, so skipped on ranks that have none of them;
    - ``twice``: a unit called twice in a row, and one called again after a later one;
    - ``checkpoint`` / ``reentrant``: every block under non-reentrant / reentrant activation checkpointing,
      blocks 0 and 1 in one checkpointed function (a recomputation that enters two units, as
      ``checkpoint_sequential`` does; non-reentrant with early stop), block 2 alone (non-reentrant without);
    - ``container``: units that return a dataclass.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, DIM)
        if kind == "branch":
            blocks = [Block(), BranchBlock(), Block()]
        elif kind == "moe":
            blocks = [Block(), MoEBlock(), MoEBlock()]
        elif kind == "container":
            blocks = [ContainerBlock() for _ in range(3)]
        else:
            blocks = [Block() for _ in range(4 if kind == "skip" else 3)]
        self.blocks = nn.ModuleList(blocks)
        self.moe = MoE(experts=5) if kind == "experts" else None
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)  # (B, DIM)
        if self.kind == "skip":
            h = self.blocks[1](self.blocks[0](h))
            rare = x[:, 0] < 3  # about 3 samples in 11: often none on a rank
            if rare.any():
                trace.append("block2")
                h = h.clone()
                h[rare] = self.blocks[2](h[rare])
            h = self.blocks[3](h)
        elif self.kind == "twice":
            h = self.blocks[1](self.blocks[1](self.blocks[0](h)))
            h = self.blocks[2](self.blocks[0](h))  # block 0 again, after block 1 (out of order, on every rank)
        elif self.kind in ("checkpoint", "reentrant"):
            reentrant = self.kind == "reentrant"
            h = activation_checkpoint.checkpoint(self._first_two, h, use_reentrant=reentrant)
            with activation_checkpoint.set_checkpoint_early_stop(False):
                h = activation_checkpoint.checkpoint(self.blocks[2], h, use_reentrant=reentrant)
        elif self.kind == "container":
            for block in self.blocks:
                out = block(h)
                h = out.hidden * out.gate
        else:
            for block in self.blocks:
                h = block(h)
            if self.moe is not None:
                h = self.moe(h)
        return self.head(h)  # (B, VOCAB)

    def _first_two(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](h))


class DynamicModule(pl.LightningModule):
    """Trains a DynamicNet on fixed data that rank r of W reads as samples r, r + W, ... (as EquivalenceModule)."""

    def __init__(self, kind: str, *, steps: int = 6, accumulate: int = 2, global_batch: int = 8, lr: float = 1e-2):
        super().__init__()
        self.kind, self.global_batch, self.lr = kind, global_batch, lr
        self.net = DynamicNet(kind)
        n = steps * accumulate * global_batch
        g = torch.Generator().manual_seed(11)
        self.data = TensorDataset(torch.randint(VOCAB, (n, SEQ), generator=g), torch.randint(VOCAB, (n,), generator=g))
        self.evaluated: list[tuple[int, float]] = []  # (sample index, loss) seen by validation/test steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def _evaluate(self, batch):
        index, x, y = batch
        losses = F.cross_entropy(self.net(x), y, reduction="none")
        self.evaluated += list(zip(index.tolist(), losses.tolist()))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch)

    def predict_step(self, batch, batch_idx):
        index, x, _ = batch
        return index, self.net(x)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.data, batch_size=self.global_batch // world, sampler=sampler)


class Indexed(torch.utils.data.Dataset):
    """``(index, x, y)`` for the first ``n`` samples: evaluation results can be matched by sample."""

    def __init__(self, data: TensorDataset, n: int) -> None:
        self.data, self.n = data, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return i, x, y

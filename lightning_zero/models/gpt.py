"""A small, readable GPT (nanoGPT-style) and the LightningModule the main job trains.

Pre-LayerNorm blocks, causal self-attention through ``scaled_dot_product_attention``, a GELU MLP,
and the token embedding tied to the output head (a shared parameter, which the ZeRO strategies must
handle). ``flops_per_token`` follows nanoGPT's estimate (6N + 12 L H Q T) for throughput and MFU.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_zero.models.blocks import Block, CausalSelfAttention, GPTConfig, Head
from lightning_zero.models.fused_block import FusedBlock
from lightning_zero.sequence.parallel import SequenceParallel
from lightning_zero.sequence.ulysses import check_heads

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "GPTModule"]  # (the parts: models/blocks.py)


class GPT(nn.Module):
    """The GPT: token and position embeddings, ``n_layer`` pre-LayerNorm blocks, a final LayerNorm and an output
    head tied to the token embedding.

    Built on a real device it is initialized at once (``init_weights``, from a generator seeded with
    ``torch.initial_seed()``); built on the meta device, the ZeRO-3 strategy initializes it shard by shard
    through ``init_module``.

    Args:
        cfg: the model's shape and options.
        sequence: each rank of a sequence-parallel group runs its slice of the sequence, with global positions
            and attention across the group (sequence/parallel.py); its input is that slice. None: the whole
            sequence.

    Raises:
        ValueError: ``sequence`` with ``cfg.fused`` (the fused blocks take no sequence parallelism), or a
            sequence-parallel size that does not divide ``cfg.n_head``.
    """

    def __init__(self, cfg: GPTConfig, sequence: SequenceParallel | None = None) -> None:
        super().__init__()
        if sequence is not None and cfg.fused:
            raise ValueError("model.fused blocks do not take sequence parallelism: set model.fused: false")
        if sequence is not None:
            check_heads(cfg.n_head, cfg.n_head, sequence.size)
        self.cfg, self.sequence = cfg, sequence
        self.sliced_checked = False  # (sequence-parallel: whether the first input was found to be a slice)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(FusedBlock(cfg) if cfg.fused else Block(cfg, sequence) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = Head(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        if not self.wte.weight.is_meta:  # on the meta device the ZeRO-3 strategy initializes, shard by shard
            self.init_weights(torch.Generator(self.wte.weight.device).manual_seed(torch.initial_seed()))

    def init_weights(self, generator: torch.Generator) -> None:
        """The whole initialization: ``init_module`` on every module in ``Module.apply`` order.

        A pure function of the generator's seed, so a model built on the meta device and initialized
        shard by shard (ZeRO-3) gets the same values.
        """
        self.apply(lambda module: self.init_module(module, generator))

    def init_module(self, module: nn.Module, generator: torch.Generator) -> None:
        """Initializes ``module``'s own parameters (never its children's): normal(0, 0.02) weights,
        zero biases, residual projections scaled down by sqrt(2 n_layer) as in GPT-2."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """The logits ``[B, T, vocab]``; given ``targets`` ``[B, T]``, the mean cross-entropy over them instead (over
        ``model.loss_tiles`` sequence tiles, the targets not -100; sequence-parallel, this rank's part of its group's
        mean, which is collective over the group)."""
        B, T = idx.shape
        if self.sequence is not None:  # (this rank's slice of a sequence-parallel group's sequence)
            K = self.sequence.size
            if T * K > self.cfg.block_size:  # (every rank alike, before any all-to-all)
                raise ValueError(
                    f"a slice of {T} tokens on each of {K} sequence-parallel ranks is a sequence of {T * K},"
                    f" longer than model.block_size {self.cfg.block_size} (is each rank given its slice?)"
                )
            if not self.sliced_checked:  # (once: the whole sequence on every rank would train on it K times over)
                self.sequence.check_sliced(idx)
                self.sliced_checked = True
            pos = self.sequence.positions(T, idx.device)
        else:
            pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)  # (B, T, vocab)
        if self.cfg.loss_tiles == 1 and self.sequence is None:
            logits = self.lm_head(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        total, count = self.lm_head(x, targets, self.cfg.loss_tiles), (targets != -100).sum()
        # a slice's real tokens are not its group's: the mean over the group's (sequence/parallel.py)
        return total / count if self.sequence is None else self.sequence.slice_mean(total, count)

    def num_params(self) -> int:
        """The number of parameters (the tied embedding and head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), nanoGPT's estimate."""
        cfg = self.cfg
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


class GPTModule(pl.LightningModule):
    """Next-token prediction with AdamW (decay on matrices only) and warmup + cosine LR.

    The GPT is built in ``configure_model``, so that ZeRO-3 can build it on the meta device and initialize it
    sharded. Batches are ``(x, y)``: token ids ``[B, T]`` and the next tokens; ``train_loss`` and ``val_loss``
    are logged. The learning rate rises linearly over ``warmup_steps`` optimizer steps, then falls along a
    cosine to a tenth of ``lr`` at ``max_steps``, and stays there.

    Args:
        model: the GPT's config; None: ``GPTConfig()``.
        lr: the peak learning rate.
        weight_decay: AdamW's weight decay, applied to the parameters of two or more dimensions only.
        betas: AdamW's betas.
        warmup_steps: the optimizer steps of the linear warmup.
        max_steps: the optimizer step at which the cosine decay ends.
    """

    def __init__(
        self,
        model: GPTConfig | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = model if model is not None else GPTConfig()
        self.gpt: GPT | None = None
        self.sequence: SequenceParallel | None = None  # (read here, not from ``self.gpt``, which a loop may wrap)

    def configure_model(self) -> None:
        """Builds the GPT here, so that ZeRO-3 can build it on the meta device and initialize it sharded; with
        ``ZeroConfig(sequence_parallel_size=K)`` each rank runs its slice of every sample's sequence."""
        if self.gpt is None:
            strategy = self._trainer.strategy if self._trainer is not None else None
            self.sequence = getattr(strategy, "sequence_parallel", None)
            self.gpt = GPT(self.cfg, sequence=self.sequence)

    def init_module(self, module: nn.Module, generator: torch.Generator) -> None:
        """Initializes ``module``'s own parameters as ``GPT.init_module`` does (ZeRO-3 calls it, shard by shard)."""
        self.gpt.init_module(module, generator)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        return self.gpt(idx, targets)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        if self.sequence is not None:  # this rank's slice of the samples' tokens (its loss: see GPT.forward)
            x, y = (self.sequence.split(t) for t in (x, y))
        return self(x, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        share = self.sequence.size if self.sequence is not None else 1  # (a slice of each sample here)
        self.flops_per_batch = batch[0].numel() // share * self.gpt.flops_per_token()  # read by ThroughputMonitor
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=share > 1)  # (the mean over the slices)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=self.hparams.betas,
        )
        warmup, total = self.hparams.warmup_steps, max(self.hparams.max_steps, self.hparams.warmup_steps + 1)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / (total - warmup)
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

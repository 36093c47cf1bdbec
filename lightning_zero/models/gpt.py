"""A small, readable GPT (nanoGPT-style) and the LightningModule the main job trains.

Pre-LayerNorm blocks, causal self-attention through ``scaled_dot_product_attention``, a GELU MLP,
and the token embedding tied to the output head (a shared parameter, which the ZeRO strategies must
handle). ``flops_per_token`` follows nanoGPT's estimate (6N + 12 L H Q T) for throughput and MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2; False is a bit faster and better
    fused: bool = False  # blocks computed with lightning_zero's fused kernels (models/fused_block.py)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{key} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_projection = True  # initialized smaller: see GPT.init_module
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )
        self.mlp[2].residual_projection = True

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        block = Block
        if cfg.fused:
            from lightning_zero.models.fused_block import FusedBlock as block  # it imports this module
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
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

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), nanoGPT's estimate."""
        cfg = self.cfg
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


class GPTModule(pl.LightningModule):
    """Next-token prediction with AdamW (decay on matrices only) and warmup + cosine LR."""

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

    def configure_model(self) -> None:
        """Builds the GPT here, so that ZeRO-3 can build it on the meta device and initialize it sharded."""
        if self.gpt is None:
            self.gpt = GPT(self.cfg)

    def init_module(self, module: nn.Module, generator: torch.Generator) -> None:
        self.gpt.init_module(module, generator)

    def forward(self, idx: Tensor) -> Tensor:
        return self.gpt(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.flops_per_batch = batch[0].numel() * self.gpt.flops_per_token()  # read by ThroughputMonitor (MFU)
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
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

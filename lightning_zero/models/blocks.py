"""The GPT's parts: its config, causal self-attention and the pre-LayerNorm block (models/gpt.py assembles
them; models/fused_block.py computes the same block with fused ops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_zero.activations.tiled import tiled_cross_entropy, tiled_mlp

if TYPE_CHECKING:  # (annotations only: the plain model imports no distributed machinery)
    from lightning_zero.sequence.parallel import SequenceParallel


@dataclass(kw_only=True)
class GPTConfig:
    """The GPT's shape and options, checked when the config is made.

    Attributes:
        vocab_size: the tokens of the vocabulary (the rows of the token embedding and of the output head).
        block_size: the longest sequence, in tokens (the rows of the learned position embedding).
        n_layer: the transformer blocks.
        n_head: the attention heads; they must divide ``n_embd``.
        n_embd: the width of the residual stream (the MLP's hidden layer is four times it).
        dropout: the dropout probability, in [0, 1), of the embeddings, the attention and the MLP's output.
        bias: biases in the Linear and LayerNorm layers, as GPT-2; False is a bit faster and better.
        fused: the blocks computed with lightning_zero's fused kernels (models/fused_block.py); not with
            ``mlp_tiles`` > 1, nor with sequence parallelism.
        mlp_tiles: each block's MLP run over this many sequence tiles, so that its hidden activations are never
            whole (activations/tiled.py; for long sequences).
        loss_tiles: the loss likewise, over this many tiles: the [batch, seq, vocab] logits are never whole.

    Raises:
        ValueError: a size or a tile count that is not an integer >= 1, ``n_embd`` not divisible by ``n_head``,
            ``dropout`` outside [0, 1), or ``fused`` with ``mlp_tiles`` > 1.
    """

    vocab_size: int = 64
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2; False is a bit faster and better
    fused: bool = False  # blocks computed with lightning_zero's fused kernels (models/fused_block.py)
    mlp_tiles: int = 1  # the MLP run over this many sequence tiles (activations/tiled.py; for long sequences)
    loss_tiles: int = 1  # the loss likewise: the [batch, seq, vocab] logits never whole

    def __post_init__(self) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_tiles", "loss_tiles"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{key} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        if self.fused and self.mlp_tiles > 1:
            raise ValueError("model.mlp_tiles needs model.fused: false (the fused block computes its MLP whole)")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``, dropout on its probabilities."""

    def __init__(self, cfg: GPTConfig, sequence: SequenceParallel | None = None) -> None:
        """``sequence``: attention across a sequence-parallel group, each rank holding a slice (sequence/)."""
        super().__init__()
        self.sequence = sequence
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_projection = True  # initialized smaller: see GPT.init_module
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        dropout = self.dropout if self.training else 0.0
        if self.sequence is not None:
            y = self.sequence.attention(q, k, v, F.scaled_dot_product_attention, is_causal=True, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    """The pre-LayerNorm transformer block: x + attention(LN(x)), then x + MLP(LN(x)) (GELU, 4x wide)."""

    def __init__(self, cfg: GPTConfig, sequence: SequenceParallel | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, sequence)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )
        self.mlp[2].residual_projection = True
        self.mlp_tiles = cfg.mlp_tiles

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + tiled_mlp(self.mlp, self.ln_2(x), self.mlp_tiles)


class Head(nn.Linear):
    """The output head: the logits, or given ``target`` the summed cross-entropy over ``tiles`` sequence tiles
    (activations/tiled.py). The loss is computed in this module's call, so that ZeRO-3 holds its weight whole."""

    def forward(self, x: Tensor, target: Tensor | None = None, tiles: int = 1) -> Tensor:
        if target is None:
            return super().forward(x)
        return tiled_cross_entropy(x, self.weight, target, tiles)

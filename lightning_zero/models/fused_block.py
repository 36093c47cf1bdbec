"""FusedBlock: the GPT block computed with lightning_zero's fused ops (matmuls stay in torch/cuBLAS).

It is a ``Block`` (same submodules, parameter names and state dict) whose forward runs LayerNorm, bias +
GeLU, bias + dropout + residual, and between the sublayers bias + residual + LayerNorm in one pass, as
fused CUDA kernels on GPUs and as their pure-torch references elsewhere; the attention core is
``scaled_dot_product_attention`` (flash attention on GPUs: no T x T scores in memory, where
``ops.softmax_dropout`` would keep three of them per layer). Select it with ``GPTConfig(fused=True)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zero.kernels import ops
from lightning_zero.models.blocks import Block


def _bias(module: nn.Module, size: int, like: Tensor) -> Tensor:
    """The module's bias, or zeros when it has none (GPTConfig(bias=False))."""
    return module.bias if module.bias is not None else torch.zeros(size, dtype=like.dtype, device=like.device)


class FusedBlock(Block):
    """A ``Block`` whose forward runs lightning_zero's fused ops (see the module's docstring): same parameters."""

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        attn, n_head = self.attn, self.attn.n_head
        p = self.attn.dropout if self.training else 0.0
        h = ops.layer_norm(x, self.ln_1.weight, _bias(self.ln_1, C, x))
        q, k, v = F.linear(h, attn.qkv.weight, attn.qkv.bias).split(C, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        # the attention core stays torch's flash / memory-efficient kernel: O(T) memory, no T x T scores
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        # the seam between the sublayers in one pass: x goes on as the residual stream, h into the MLP
        x, h = ops.bias_dropout_residual_layer_norm(
            F.linear(y, attn.proj.weight), _bias(attn.proj, C, x), x, self.ln_2.weight, _bias(self.ln_2, C, x)
        )
        fc, out = self.mlp[0], self.mlp[2]
        g = ops.bias_gelu(F.linear(h, fc.weight), _bias(fc, fc.out_features, h), approximate="none")
        p_mlp = self.mlp[3].p if self.training else 0.0
        return ops.bias_dropout_residual(F.linear(g, out.weight), _bias(out, C, x), x, p=p_mlp)

"""Tiled MLP and tiled loss (ALST's, arXiv 2506.13996): a per-token computation run over sequence tiles, so that
only one tile's intermediates exist at once.

[Note: tiling along the sequence]
An MLP and a language model's loss treat each token alone, so running them over tiles of the sequence gives the
same values as over the whole. Their intermediates are the largest activations of a long-sequence step: the MLP's
``[B, S, 4C]`` (held during a checkpointed block's recomputation) and the loss's ``[B, S, vocab]`` logits in fp32
(a gigabyte per 2K tokens at Llama-3's 128K vocabulary). ``_Tiled`` runs ``fn`` tile by tile without saving
anything but its input, and in backward recomputes each tile under autograd and takes its gradients at once, so
one tile's intermediates live at a time, forward and backward. The parameters ``fn`` reads are the Function's
inputs, so their gradients (summed over the tiles) reach them through autograd once per backward, as ZeRO's
reduction expects (the tiles run on detached aliases of them, so gradient hooks see the sum once, summed in fp32),
and under stage 3 they are whole while the unit that holds them is, forward and backward. The tile's recomputation
draws the same random numbers as its forward (the generators' states are restored) and runs under the forward's
autocast. Its cost: each tile's forward runs twice, as a checkpointed block's does; inside a checkpointed block three
times (the block's recomputation reruns the whole Function's forward before its backward tiles again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.func import functional_call


def _generator_states(device: torch.device) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


class _Tiled(torch.autograd.Function):
    """``fn(params, tile[, target tile])`` over the sequence tiles of ``x`` (and of ``target``), concatenated, or
    summed with ``summed`` (see [Note: tiling along the sequence])."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, tiles: int, summed: bool, x: Tensor, target: Tensor | None, *params: Tensor):
        device = x.device.type
        ctx.fn, ctx.tiles, ctx.summed, ctx.states = fn, tiles, summed, _generator_states(x.device)
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.params = params  # (the very objects: what saving them would unpack under hooks may be others)
        ctx.save_for_backward(x, target)
        parts = [fn(params, *args) for args in _tile_args(x.detach(), target, tiles)]  # (nothing differentiated)
        return torch.stack(parts).sum(0) if summed else torch.cat(parts, dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple:
        x, target = ctx.saved_tensors
        # detached aliases: the tiles' gradients are summed here, and reach the parameters (and their hooks) once
        aliases = tuple(p.detach().requires_grad_(p.requires_grad) for p in ctx.params)
        wanted = [a for a in aliases if a.requires_grad]
        sums: list[Tensor | None] = [None] * len(wanted)  # (in fp32: many tiles' bf16 gradients lose bits)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        grads = [grad] * ctx.tiles if ctx.summed else grad.chunk(ctx.tiles, dim=1)
        device, enabled, dtype = ctx.autocast
        cpu_state, cuda_state = ctx.states
        with torch.random.fork_rng(devices=[x.device] if cuda_state is not None else [], device_type=device):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, x.device)
            offset = 0
            for args, tile_grad in zip(_tile_args(x.detach(), target, ctx.tiles), grads):
                piece = args[0].requires_grad_(grad_x is not None)
                with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                    out = ctx.fn(aliases, piece, *args[1:])
                inputs = ([piece] if grad_x is not None else []) + wanted
                found = list(torch.autograd.grad(out, inputs, tile_grad, allow_unused=True))
                if grad_x is not None:
                    grad_x.narrow(1, offset, piece.shape[1]).copy_(found.pop(0))
                for i, g in enumerate(found):
                    if g is not None:
                        sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
                offset += piece.shape[1]
        per_param = iter(sums)
        param_grads = [_cast(next(per_param), p) if p.requires_grad else None for p in ctx.params]
        return (None, None, None, grad_x, None, *param_grads)


def _cast(total: Tensor | None, param: Tensor) -> Tensor | None:
    return None if total is None else total.to(param.dtype)


def _tile_args(x: Tensor, target: Tensor | None, tiles: int) -> list[tuple[Tensor, ...]]:
    pieces = x.chunk(tiles, dim=1)
    if target is None:
        return [(piece,) for piece in pieces]
    return list(zip(pieces, target.chunk(tiles, dim=1)))


def _check_tiles(tiles: Any) -> int:
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tiles must be an integer >= 1, got {tiles!r}")
    return tiles


def tiled_mlp(mlp: nn.Module, x: Tensor, tiles: int) -> Tensor:
    """``mlp(x)`` for ``x`` ``[B, S, C]``, run over ``tiles`` tiles of the sequence (dimension 1); ``mlp`` must treat
    each token alone, and sit inside a ZeRO-3 unit rather than be one (its hooks run per tile, under no-grad). Its
    intermediates exist one tile at a time (see [Note: tiling along the sequence])."""
    if _check_tiles(tiles) == 1:
        return mlp(x)
    if not torch.is_grad_enabled():
        return torch.cat([mlp(piece) for piece in x.chunk(tiles, dim=1)], dim=1)
    named = dict(mlp.named_parameters())

    def run(values: tuple[Tensor, ...], piece: Tensor) -> Tensor:
        return functional_call(mlp, dict(zip(named, values)), (piece,))

    return _Tiled.apply(run, tiles, False, x, None, *named.values())


def tiled_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, tiles: int, *, ignore_index: int = -100
) -> Tensor:
    """The sum over ``target``'s tokens (those not ``ignore_index``) of the cross-entropy of the logits
    ``hidden @ weight.T`` (in fp32), ``hidden`` ``[B, S, C]``, ``target`` ``[B, S]``, over ``tiles`` tiles of the
    sequence: the ``[B, S, vocab]`` logits never exist whole (see [Note: tiling along the sequence])."""

    def tile_loss(values: tuple[Tensor, ...], piece: Tensor, tile_target: Tensor) -> Tensor:
        logits = F.linear(piece, values[0]).float()
        return F.cross_entropy(logits.flatten(0, 1), tile_target.flatten(), ignore_index=ignore_index, reduction="sum")

    if _check_tiles(tiles) == 1 or not torch.is_grad_enabled():
        return sum(tile_loss((weight,), *args) for args in _tile_args(hidden, target, tiles))
    return _Tiled.apply(tile_loss, tiles, True, hidden, target, weight)

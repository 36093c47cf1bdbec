"""Ulysses sequence parallelism's attention (DeepSpeed-Ulysses, Jacobs et al. 2023).

[Note: Ulysses attention]
The K ranks of a sequence-parallel group hold different slices, S/K positions each in rank order, of the same
samples. Attention needs every position, so around it one all-to-all turns q, k and v from sequence-sharded
``[B, H, S/K, D]`` into head-sharded ``[B, H/K, S, D]`` (each rank: every position of H/K heads), attention runs
unchanged on them (any implementation, causal masks, fused kernels: it sees whole sequences), and a second
all-to-all turns its output back. An all-to-all's backward is the opposite all-to-all, so gradients are exact.
Dropout draws from each rank's generator, seeded alike across the group, so the ranks' head blocks (and, outside
attention, their slices) get the same masks: exact only with it off. Per layer each rank sends 4 tensors of
``B*H*S*D/K`` elements, (K-1)/K of them to other ranks: constant in K, unlike ring attention's. Grouped-query
attention (fewer key/value heads, H_kv) splits k and v likewise when K divides H_kv; when H_kv divides K, each
key/value head is repeated K/H_kv times first, so rank j receives the one its query heads read (query head h
reads key/value head ``h // (H / H_kv)``). Anything else is refused with one line, as is H not divisible by K.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.sharding import collectives


def _exchange(chunks: Tensor, group) -> Tensor:
    """``chunks[r]`` to rank r; returns what rank r sent here at index r."""
    received = torch.empty_like(chunks)
    return collectives.all_to_all(received, chunks, group=group)


def _sequence_to_heads(x: Tensor, k: int, group) -> Tensor:
    b, h, s, d = x.shape
    chunks = x.reshape(b, k, h // k, s, d).transpose(0, 1).contiguous()  # [K, B, H/K, s, D]: head block r for rank r
    received = _exchange(chunks, group)  # [K, B, H/K, s, D]: rank r's sequence slice of this rank's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // k, k * s, d)


def _heads_to_sequence(y: Tensor, k: int, group) -> Tensor:
    b, h, s, d = y.shape
    chunks = y.reshape(b, h, k, s // k, d).permute(2, 0, 1, 3, 4).contiguous()  # [K, B, H/K, S/K, D]: slice r
    received = _exchange(chunks, group)  # [K, B, H/K, S/K, D]: head block r of this rank's slice
    return received.transpose(0, 1).reshape(b, k * h, s // k, d)


class _AllToAll(torch.autograd.Function):
    """One layout's exchange (``to_heads``: sequence-sharded to head-sharded); its backward is the other one's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, k: int, group: Any, to_heads: bool) -> Tensor:
        ctx.k, ctx.group, ctx.to_heads = k, group, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, k, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        undo = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return undo(grad.contiguous(), ctx.k, ctx.group), None, None, None


def check_heads(heads: int, kv_heads: int, k: int, *, repeat: bool = True) -> None:
    """Refuses, in one line, head counts the sequence-parallel size cannot split (see [Note: Ulysses attention]);
    ``repeat=False``: an attention that repeats its key/value heads itself (Hugging Face's), which K must divide."""
    if heads % k:
        raise ValueError(f"sequence_parallel_size {k} must divide the attention heads, {heads}")
    if kv_heads % k and (k % kv_heads or not repeat):
        multiple = ", or be a multiple of them" if repeat else " (the attention repeats them itself)"
        raise ValueError(f"sequence_parallel_size {k} must divide the key/value heads, {kv_heads}{multiple}")


def declared_heads(model: Any) -> list[tuple[int, int, bool]]:
    """The (query heads, key/value heads, ``repeat``) that the configs inside ``model`` (a Module) declare, for
    ``check_heads``: a ``cfg`` with ``n_head`` (the GPT's, models/) or a Hugging Face ``config`` with
    ``num_attention_heads`` (and ``num_key_value_heads``; sequence/hf.py), so that a size that cannot split them is
    refused before any process starts."""
    found = []
    for module in model.modules():
        cfg, config = getattr(module, "cfg", None), getattr(module, "config", None)
        if isinstance(getattr(cfg, "n_head", None), int):
            found.append((cfg.n_head, cfg.n_head, True))
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int):
            found.append((heads, getattr(config, "num_key_value_heads", None) or heads, False))
    return found


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, attention: Callable[..., Tensor], *, group: Any = None, **kwargs: Any
) -> Tensor:
    """``attention(q, k, v, **kwargs)`` over the whole sequence, for q, k, v ``[B, heads, S/K, D]`` holding this rank's
    slice of the sequence, K the ranks of ``group`` (None: the world); returns this rank's slice of the output,
    ``[B, heads, S/K, D]`` (see [Note: Ulysses attention]). Every rank of the group calls it, with equal shapes."""
    size = dist.get_world_size(group)
    check_heads(q.shape[1], k.shape[1], size)
    if size == 1:
        return attention(q, k, v, **kwargs)
    if k.shape[1] < size:  # each rank gets one key/value head: the one its query heads read
        k, v = (t.repeat_interleave(size // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (_AllToAll.apply(t.contiguous(), size, group, True) for t in (q, k, v))
    return _AllToAll.apply(attention(q, k, v, **kwargs).contiguous(), size, group, False)

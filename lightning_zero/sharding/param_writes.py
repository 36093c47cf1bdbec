"""Writes to whole parameters inside ``gathered_parameters``: found on each rank, agreed over the ranks, kept.

[Note: writes inside gathered_parameters]
A user who cannot read a stage-3 parameter between steps is sent into ``gathered_parameters``; what they do
there is what a ddp user does to a parameter: an in-place edit (``p.data.fill_``, ``nn.init``, ``copy_``
under ``no_grad``) or a new tensor (``p.data = t``). Under ddp the edit is the weight from then on; here the
weights live in the shards and in the fp32 masters, so an edit to the gathered copy alone would be dropped
when the unit is freed (stage 3), or overwritten by the next step's masters (16-bit parameters) or by the
other ranks' chunks (stages 1 and 2). So an edit is found and kept:

- each rank fingerprints the parameters' values when the block is entered and again when it ends
  (``fingerprint``: every element's bits mixed with its position, summed; a version counter would miss
  edits through ``.data``, which has a counter of its own), after taking back into the flat buffer a tensor
  that replaced a parameter's ``.data`` (``FlatUnit.adopt``);
- one all-reduce agrees on the lowest rank whose parameters changed (``agreed_writer``): the same answer
  on every rank, so every rank takes the same branch;
- that rank's values are then every rank's, shards and masters included, as with ``modifier_rank`` (the
  DeepSpeed idiom "rank 0 edits, ``modifier_rank=0``" and the ddp idiom "every rank makes the same edit"
  both keep the edit). Nothing written: no further collective, nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.sharding import collectives

_CHUNK = 1 << 22  # elements mixed at a time: the int64 temporaries stay small
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (odd: a bijection mod 2^64)
_POSITION = 0x2545F491


def _mixed_sum(values: Tensor) -> Tensor:
    """Sum over elements of a bijective mix of (bits, position), mod 2^64: any change to one element changes it."""
    bits = values.detach().reshape(-1).view(_BITS[values.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        mixed = (chunk ^ (position * _POSITION)) * _MIX  # wraps mod 2^64, as every int64 product here
        total += (mixed ^ (mixed >> 31)).sum()
    return total


def fingerprint(tensors: Sequence[Tensor]) -> list[Tensor]:
    """One number per tensor that changes when any of its values does (see the module's Note); on their devices."""
    return [_mixed_sum(t) for t in tensors]


def changed(before: Sequence[Tensor], tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors``' values differ from those ``before`` fingerprinted."""
    return any(bool(a != b) for a, b in zip(before, fingerprint(tensors), strict=True))


def agreed_writer(written: bool, device: torch.device) -> int | None:
    """The lowest (global) rank with ``written`` set, or None: the same on every rank (one all-reduce over the
    world, on ``device``: the parameters' device, which the world's backend serves)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0 if written else None
    world = dist.get_world_size()
    flag = torch.tensor([dist.get_rank() if written else world], dtype=torch.int64, device=device)
    lowest = int(collectives.all_reduce(flag, dist.ReduceOp.MIN).item())
    return None if lowest == world else lowest

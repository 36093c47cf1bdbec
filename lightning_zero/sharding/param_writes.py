"""Writes to whole parameters inside ``gathered_parameters``: found on each rank, agreed over the ranks, kept.

[Note: writes inside gathered_parameters]
A user who cannot read a stage-3 parameter between steps is sent into ``gathered_parameters``; what they do
there is what a ddp user does to a parameter: an in-place edit (``p.data.fill_``, ``nn.init``, ``copy_``
under ``no_grad``) or a new tensor (``p.data = t``). Under ddp the edit is the weight from then on; here the
weights live in the shards and in the fp32 masters, so an edit to the gathered copy alone would be dropped
when the unit is freed (stage 3), or overwritten by the next step's masters (16-bit parameters) or by the
other ranks' chunks (stages 1 and 2). So an edit is found and kept (``keeping_writes``):

- each rank fingerprints the parameters (stage 3: every parameter of the units gathered) when the block is
  entered and again when it ends (``fingerprint``: every element's bits mixed with its position, summed; a
  version counter would miss edits through ``.data``, which has a counter of its own), after taking back
  into the flat buffer a tensor that replaced a parameter's ``.data`` (``FlatUnit.adopt``);
- one all-reduce (``agree``) gives, for each tensor, the lowest rank whose copy changed, and whether a rank
  could not take a write back (a new ``.data`` of another shape): the same answers on every rank, so every
  rank takes the same branch, and a problem is one error on every rank;
- each written tensor's writer then gives every rank its values, shards and masters included, as with
  ``modifier_rank`` (the DeepSpeed idiom "rank 0 edits, ``modifier_rank=0``" and the ddp idiom "every rank
  makes the same edit" both keep the edit; ranks that write different tensors each keep theirs).
  Nothing written: no further collective, nothing changes.
In a validation/test/predict step a write is refused (``forward_only``): stage 3 keeps writes made in a
training step or between steps only, since a rank that has run out of batches replays that step's
collectives without its broadcasts (stage3.py's [Note: uneven inputs]); stages 1 and 2, which have no such
replay, refuse it on the rank that wrote without a collective, so that validation with uneven batches issues
none there either.

[Note: a replaced .data]
A ddp user may also replace a parameter's tensor anywhere (``p.data = t`` in a callback or a step, outside any
context), and ddp keeps ``t``. Here ``t`` would be silently lost or frozen: stage 3's next gather points the
parameter back at its flat buffer, and at stages 1 and 2 the optimizer and the post-step gathers keep updating the
flat buffer, which ``p`` no longer views. So each rank keeps its own ``t`` (no collective: every rank runs the same
code, and a rank that alone replaces diverges as under ddp): ``FlatUnit.take_replaced`` copies it into the flat
buffer and this rank's pieces into the shard and master, finding it by a pointer check, when a whole unit is
settled or a training step begins (the engine) and when a gathered one is freed; a stage-3 parameter of the
sharded class is intercepted as it is assigned (``FlatUnit.replace``, through ``ShardedParameter``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.sharding import collectives

_CHUNK = 1 << 22  # elements mixed at a time: the int64 temporaries stay small
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # other sizes: as bytes
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (odd: a bijection mod 2^64)
_POSITION = 0x2545F491
_LOW_33 = (1 << 33) - 1  # a logical shift right by 31 of an int64 (torch's >> is arithmetic)
FORWARD_ONLY_WRITE = (
    "a parameter written inside gathered_parameters inside a validation/test/predict step: the ZeRO strategies"
    " keep writes made in a training step or between steps; make it there"
)

Agree = Callable[[Tensor, "str | None"], list[int | None]]


def _mixed_sum(values: Tensor) -> Tensor:
    """Sum over elements of a bijective mix of (bits, position), mod 2^64: any change to one element changes it."""
    flat = values.detach().reshape(-1)
    bits = flat.view(_BITS.get(flat.element_size(), torch.uint8))
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        mixed = (chunk ^ (position * _POSITION)) * _MIX  # wraps mod 2^64, as every int64 product here
        total += (mixed ^ ((mixed >> 31) & _LOW_33)).sum()  # (xorshift: a bijection too)
    return total


def fingerprint(tensors: Sequence[Tensor]) -> Tensor:
    """One number per tensor that changes when any of its values does (see the module's Note), on their device."""
    return torch.stack([_mixed_sum(t) for t in tensors])


def agree(changed: Tensor, problem: str | None, *, forward_only: bool = False) -> list[int | None]:
    """Per tensor, the lowest (global) rank where ``changed`` is set, or None (collective: one all-reduce on
    ``changed``'s device). A ``problem`` on any rank, or a write in a forward-only step, raises on every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    flags = torch.where(changed, rank, world).to(torch.int64)
    flags = torch.cat([flags, torch.tensor([rank if problem else world], device=flags.device)])
    if world > 1:
        collectives.all_reduce(flags, dist.ReduceOp.MIN)
    *writers, troubled = flags.tolist()
    if troubled != world:
        messages = collectives.all_gather_object(problem) if world > 1 else [problem]
        raise ValueError(messages[troubled])
    if forward_only and any(w != world for w in writers):
        raise RuntimeError(FORWARD_ONLY_WRITE)
    return [None if w == world else w for w in writers]


def agree_here(changed: Tensor, problem: str | None) -> list[int | None]:
    """``agree`` on this rank alone, in a forward-only step of stages 1 and 2 (see the module's Note)."""
    if problem:
        raise ValueError(problem)
    if bool(changed.any()):
        raise RuntimeError(FORWARD_ONLY_WRITE)
    return [None] * changed.numel()


@contextmanager
def keeping_writes(
    tensors: Sequence[Tensor],
    adopt: Callable[[], None],
    keep: Callable[[int, int], None],
    *,
    modifier_rank: int | None,
    agree: Agree = agree,
) -> Iterator[None]:
    """Watches ``tensors`` inside the block; when it ends, ``adopt()`` takes back replaced ``.data`` (a ValueError
    is a problem, raised on every rank), ``agree`` finds each tensor's writer (every rank's ``modifier_rank`` when
    given) and ``keep(index, writer)`` gives every rank the writer's values (see the module's Note)."""
    before = fingerprint(tensors) if tensors and modifier_rank is None else None
    yield
    problem = None
    try:
        adopt()
    except ValueError as error:
        problem = str(error)
    if not tensors:
        return
    changed = fingerprint(tensors) != before if before is not None else torch.zeros(len(tensors), dtype=torch.bool)
    writers = agree(changed.to(tensors[0].device), problem)
    for index, writer in enumerate(writers if modifier_rank is None else [modifier_rank] * len(tensors)):
        if writer is not None:
            keep(index, writer)

"""Every collective the ZeRO strategies issue, as stateless free functions.

Each function works on tensors the caller owns and returns the async work handle (or None when
``async_op`` is off). ``traffic`` counts the elements each kind of collective covered on this rank
(the full buffer a reduce-scatter reads or an all-gather writes), so tests and benchmarks can check
per-step communication against the ZeRO formulas without wrapping torch.distributed.

Timeouts are the process group's: the strategy creates it with ``ZeroConfig.timeout``, so a rank
whose peers never arrive fails with torch's timeout error instead of waiting forever.
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist
from torch import Tensor

traffic: Counter[str] = Counter()

# torch 2.13 deprecates the *_tensor spellings; older torch only has them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(output: Tensor, input: Tensor, *, async_op: bool, group=None) -> dist.Work | None:
    """Sums ``input`` (world_size equal chunks) over ranks; chunk r lands in rank r's ``output``.

    ``output`` may be rank r's own chunk of ``input`` (in place).
    """
    traffic["reduce_scatter"] += input.numel()
    return _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, *, async_op: bool, group=None) -> dist.Work | None:
    """Concatenates every rank's ``input`` into ``output``; ``input`` may be this rank's slot of it."""
    traffic["all_gather"] += output.numel()
    return _all_gather_single(output, input, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, op: dist.ReduceOp, *, group=None) -> Tensor:
    """In-place blocking all-reduce of a small tensor (flags, norms); returns it."""
    traffic["all_reduce"] += tensor.numel()
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_object(obj: object, *, group=None) -> list:
    """Every rank's ``obj``, in rank order (for set-up checks, never on the hot path)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()

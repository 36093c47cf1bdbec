"""Every collective the ZeRO strategies issue, as stateless free functions.

Each function works on tensors the caller owns and returns the async work handle (or None when
``async_op`` is off). ``traffic`` counts the elements each kind of collective covered on this rank
(the full buffer a reduce-scatter reads or an all-gather writes), so tests and benchmarks can check
per-step communication against the ZeRO formulas without wrapping torch.distributed.

[Note: recording the collective sequence]
Collectives are matched across ranks by the order in which they are issued; a rank that issues a
different sequence hangs (NCCL) or times out (gloo). ``record()`` keeps, while it is active, each
collective this module issues as ``(op, group, numel, dtype)``; ``first_divergence`` compares the
records of all ranks. Tests assert that dynamic models produce identical sequences on every rank,
and ``ZeroConfig(check_collectives=True)`` compares them after every optimizer step at run time.

Timeouts are the process group's: the strategy creates it with ``ZeroConfig.timeout``, so a rank
whose peers never arrive fails with torch's timeout error instead of waiting forever.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch import Tensor

traffic: Counter[str] = Counter()  # elements per kind of collective
traffic_bytes: Counter[str] = Counter()  # the same in bytes (what the dtype costs on the wire)
_records: list[list[tuple]] = []  # the active recordings (innermost last)

# torch 2.13 deprecates the *_tensor spellings; older torch only has them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _note(op: str, tensor: Tensor, numel: int, group) -> None:
    traffic[op] += numel
    traffic_bytes[op] += numel * tensor.element_size()
    if _records:
        entry = (op, "world" if group is None else str(dist.get_process_group_ranks(group)), numel, str(tensor.dtype))
        for record in _records:
            record.append(entry)


@contextmanager
def record() -> Iterator[list[tuple]]:
    """Collects ``(op, group, numel, dtype)`` for every collective issued inside the block, in order."""
    log: list[tuple] = []
    _records.append(log)
    try:
        yield log
    finally:
        _records.remove(log)


def first_divergence(sequences: list[list[tuple]]) -> str | None:
    """None when every rank's sequence is the same, else a line naming the first difference."""
    for i in range(max(len(s) for s in sequences)):
        ops = [s[i] if i < len(s) else None for s in sequences]
        if any(op != ops[0] for op in ops):
            shown = ", ".join(f"rank {r}: {op}" for r, op in enumerate(ops))
            return f"collective #{i} differs between ranks ({shown})"
    return None


def reduce_scatter(output: Tensor, input: Tensor, *, async_op: bool, group=None) -> dist.Work | None:
    """Sums ``input`` (world_size equal chunks) over ranks; chunk r lands in rank r's ``output``.

    ``output`` may be rank r's own chunk of ``input`` (in place).
    """
    _note("reduce_scatter", input, input.numel(), group)
    return _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, *, async_op: bool, group=None) -> dist.Work | None:
    """Concatenates every rank's ``input`` into ``output``; ``input`` may be this rank's slot of it."""
    _note("all_gather", output, output.numel(), group)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, op: dist.ReduceOp, *, group=None) -> Tensor:
    """In-place blocking all-reduce of a small tensor (flags, norms); returns it."""
    _note("all_reduce", tensor, tensor.numel(), group)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def broadcast(tensor: Tensor, *, src: int, group=None) -> Tensor:
    """In-place blocking broadcast of a small tensor from global rank ``src``; returns it."""
    _note("broadcast", tensor, tensor.numel(), group)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_gather_object(obj: object, *, group=None) -> list:
    """Every rank's ``obj``, in rank order (for set-up checks, never on the hot path)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()

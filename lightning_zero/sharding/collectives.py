"""Every collective the ZeRO strategies issue, as stateless free functions.

Each function works on tensors the caller owns and returns the async work handle (or None when
``async_op`` is off). Who wants to see what they did (bytes sent, their order) observes them.

[Note: observing collectives]
What the collectives did is seen by observers, and only while someone asked: ``observing(observer)``
calls ``observer(entry, nbytes)`` for each collective issued inside the block, where ``entry`` is
``(op, group role, numel, dtype)`` and ``nbytes`` what it covered in bytes. Nothing is kept between blocks
(as with torch's ``CommDebugMode``), so there is no counter or record for a process to carry from one
run into the next. Two observers:

- ``Traffic``: the elements and bytes each kind of collective covered, and the bytes per (group role,
  kind). The ZeRO strategy counts its own while it is set up (``ZeroStrategy.traffic``), so tests and
  benchmarks check per-step communication against the ZeRO formulas without wrapping torch.distributed.
- ``record()``: the sequence of entries. Collectives are matched across ranks by the order in which
  they are issued; a rank that issues a different sequence hangs (NCCL) or times out (gloo).
  ``first_divergence`` compares the records of all ranks. Tests assert that dynamic models produce
  identical sequences on every rank, and ``ZeroConfig(check_collectives=True)`` compares them after
  every optimizer step at run time.

A group's role ("shard", "replicate": see topology.py) is its ``group_desc``, given when it is made, so it
is the same on every rank although the ranks of shard groups differ; the default group is "world".

[Note: per-backend collectives]
``reduce_scatter`` and ``all_gather`` keep one meaning on every backend but not one implementation;
which one a process group gets follows from its backend alone (``_decomposed``), so every rank issues the
same underlying collectives in the same order. NCCL (and any backend but gloo) uses the native
reduce-scatter and all-gather. Gloo's are slow on the CPU: measured on 2 ranks of this project's
2-core machines (median ms, float32; reduce_scatter vs one reduce per chunk, all_gather vs one
broadcast per chunk):

    elements     reduce_scatter  reduce x N  all_reduce  |  all_gather  broadcast x N
    1,000,000         8.7            3.0          4.6     |      3.8         2.0
    4,000,000        32.0           17.5         15.7     |     16.3         7.2
    13,800,000      121.7           61.1         52.2     |     97.2        24.2
    (4 ranks) 4M     47.7           25.1         32.8     |     29.0        15.4

so on gloo a reduce-scatter is one asynchronous ``reduce`` of chunk r to rank r for every r, and an
all-gather one asynchronous ``broadcast`` of chunk r from rank r. Both read and write the caller's
buffers in place: a reduce-scatter's ``input`` is scratch afterwards on every backend (gloo's reduce
works in it), so callers that still need it pass a copy. The sums are the same as the native ones
at 2 ranks (a + b is exact in either order) and equal up to summation order beyond.

[Note: streams and lifetimes]
An asynchronous collective's buffers belong to it until its work is waited on: the gradient bucket
pool takes a buffer back only after its reduce-scatter was waited on (grad_reduce.py), and the
post-step gathers keep their works until the parameters are read (param_gather.py). On CUDA, NCCL
runs on its own stream; ``wait()`` makes the *current* stream wait for it without blocking the host,
and c10d records each tensor's use on that stream, so the caching allocator never hands out a
buffer a collective still reads. Gloo's works complete on its own threads; ``wait()`` blocks the
host. Waiting order never matters for matching: ranks match by issue order.

Timeouts are the process group's: the strategy creates it with ``ZeroConfig.timeout``, so a rank
whose peers never arrive fails with torch's timeout error instead of waiting forever.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.sharding.quantize import dequantize_int4_into, dequantize_into, quantize, quantize_int4

Entry = tuple[str, str, int, str]  # (op, group role, numel, dtype)
_observers: list[Callable[[Entry, int], None]] = []  # the active observers, innermost last: see observing

# torch 2.13 deprecates the *_tensor spellings; older torch only has them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


ROLES = ("shard", "replicate", "node", "cross", "sequence")  # the roles given to groups (their group_desc)


def group_role(group) -> str:
    """ "world" for the default group, a role topology.py gave (see [Note: observing collectives]), else its
    ranks."""
    if group is None:
        return "world"
    return group.group_desc if group.group_desc in ROLES else str(dist.get_process_group_ranks(group))


def _note(op: str, tensor: Tensor, numel: int, group) -> None:
    if _observers:
        entry = (op, group_role(group), numel, str(tensor.dtype))
        for observer in _observers:
            observer(entry, numel * tensor.element_size())


@contextmanager
def observing(observer: Callable[[Entry, int], None]) -> Iterator[None]:
    """Calls ``observer(entry, nbytes)`` for every collective issued inside the block."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


@dataclass
class Traffic:
    """What each kind of collective covered on this rank while observed: elements (the full buffer a
    reduce-scatter reads or an all-gather writes), the same in bytes (what the dtype costs on the wire),
    and bytes per (group role, kind)."""

    elements: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    bytes_by_group: Counter[tuple[str, str]] = field(default_factory=Counter)

    def __call__(self, entry: Entry, nbytes: int) -> None:
        op, role, numel, _ = entry
        self.elements[op] += numel
        self.bytes[op] += nbytes
        self.bytes_by_group[role, op] += nbytes

    def copy(self) -> Traffic:
        """A copy of the counts so far, to pass to ``since`` later."""
        return Traffic(self.elements.copy(), self.bytes.copy(), self.bytes_by_group.copy())

    def since(self, earlier: Traffic) -> Traffic:
        """What was counted after ``earlier`` (a copy taken then)."""
        return Traffic(
            self.elements - earlier.elements, self.bytes - earlier.bytes, self.bytes_by_group - earlier.bytes_by_group
        )


@contextmanager
def record() -> Iterator[list[Entry]]:
    """Collects ``(op, group role, numel, dtype)`` for every collective issued inside the block, in order."""
    log: list[Entry] = []
    with observing(lambda entry, nbytes: log.append(entry)):
        yield log


class SequenceCheck:
    """``ZeroConfig.check_collectives`` (a debug mode): records every collective while ``stack`` is open (None: off),
    and ``check`` compares every rank's since the last check."""

    def __init__(self, stack: ExitStack | None) -> None:
        self.log = stack.enter_context(record()) if stack is not None else None
        self._checked = 0  # how much of it every rank has agreed on

    def check(self, where: str) -> None:
        """Every rank raises one error naming the first difference and ``where`` if their sequences differ."""
        if self.log is None:
            return
        # (a sequence-parallel group's all-to-alls are matched inside it: other groups may run other lengths)
        sequence = [entry for entry in self.log[self._checked :] if entry[1] != "sequence"]
        self._checked = len(self.log)
        digest = hashlib.sha1(repr(sequence).encode()).hexdigest()  # not hash(): salted per process
        digests = all_gather_object((len(sequence), digest))
        if len(set(digests)) > 1:
            problem = first_divergence(all_gather_object(sequence))
            raise RuntimeError(f"the ranks issued different collectives {where}: {problem}")


def first_divergence(sequences: list[list[tuple]]) -> str | None:
    """None when every rank's sequence is the same, else a line naming the first difference."""
    for i in range(max(len(s) for s in sequences)):
        ops = [s[i] if i < len(s) else None for s in sequences]
        if any(op != ops[0] for op in ops):
            shown = ", ".join(f"rank {r}: {op}" for r, op in enumerate(ops))
            return f"collective #{i} differs between ranks ({shown})"
    return None


class Pending:
    """Several works waited on as one, then what finishes them (a decomposed collective's copy-out, a
    quantized gather's dequantization)."""

    def __init__(self, works: list, then: Callable[[], object] | None = None) -> None:
        self.works = works
        self.then = then  # called once every work is done

    def wait(self) -> None:
        """Waits on every work, then runs ``then``; waiting again does nothing."""
        for work in self.works:
            wait(work)
        self.works = []
        then, self.then = self.then, None
        if then is not None:
            then()


def _decomposed(group) -> bool:
    """Whether this group's reduce-scatter and all-gather are built from per-chunk collectives (gloo).

    Looked up per call (a dictionary lookup in torch): caching it would keep the process group object
    alive past ``destroy_process_group``, and its threads would then be torn down at interpreter exit."""
    return dist.get_backend(group) == "gloo"


def _peers(group) -> list[int]:
    """Global rank of each rank of ``group``, in group order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _finish(works: list, then: Callable[[], object] | None, async_op: bool) -> Pending | None:
    pending = Pending(works, then)
    if async_op:
        return pending
    pending.wait()
    return None


def reduce_scatter(output: Tensor, input: Tensor, *, async_op: bool, group=None) -> dist.Work | Pending | None:
    """Sums ``input`` (world_size equal chunks) over ranks; chunk r lands in rank r's ``output``.

    ``output`` may be rank r's own chunk of ``input`` (in place). ``input`` is scratch afterwards.
    """
    _note("reduce_scatter", input, input.numel(), group)
    if not _decomposed(group):
        return _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    peers = _peers(group)
    chunks = input.chunk(len(peers))
    works = [
        dist.reduce(chunk, dst=peer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        for chunk, peer in zip(chunks, peers)
    ]
    mine = chunks[dist.get_rank(group)]
    return _finish(works, None if output.data_ptr() == mine.data_ptr() else partial(output.copy_, mine), async_op)


def reduce_scatter_two_level(
    output: Tensor, input: Tensor, *, node_size: int, node_group, cross_group, block: int, bits: int = 8
) -> None:
    """``reduce_scatter`` over the world in two levels (ZeRO++'s qgZ; blocking). ``input``'s rows (row r to rank
    r = node m * ``node_size`` + node rank j) are summed inside each node at full precision, node rank j
    receiving every node's row j (one reduce-scatter over ``node_group``); then each of those M partial sums
    travels as block-wise int8 (``bits`` 8) or int4 (4, two to a byte; sharding/quantize.py) to its rank on
    node m (one all-to-all over ``cross_group``), which dequantizes the M parts it receives and adds them up
    in node order."""
    per_node = input.view(-1, node_size, output.numel())  # (M, K, C)
    by_node_rank = per_node.transpose(0, 1).contiguous()  # (K, M, C): row j is node rank j's
    mine = by_node_rank[dist.get_rank(node_group)]
    reduce_scatter(mine.view(-1), by_node_rank.view(-1), async_op=False, group=node_group)
    values, scales = (quantize if bits == 8 else quantize_int4)(mine, block)
    values = values.contiguous()
    received = (torch.empty_like(values), torch.empty_like(scales))
    for out, sent in zip(received, (values, scales)):
        _note("all_to_all", sent, sent.numel(), cross_group)
        dist.all_to_all_single(out, sent, group=cross_group)
    parts = torch.empty(mine.shape, dtype=torch.float32, device=mine.device)
    (dequantize_into if bits == 8 else dequantize_int4_into)(parts, *received, block)
    output.copy_(parts.sum(dim=0))


def all_gather(output: Tensor, input: Tensor, *, async_op: bool, group=None) -> dist.Work | Pending | None:
    """Concatenates every rank's ``input`` into ``output``; ``input`` may be this rank's slot of it."""
    _note("all_gather", output, output.numel(), group)
    if not _decomposed(group):
        return _all_gather_single(output, input, group=group, async_op=async_op)
    peers = _peers(group)
    chunks = output.chunk(len(peers))
    mine = chunks[dist.get_rank(group)]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input)
    works = [dist.broadcast(chunk, src=peer, group=group, async_op=True) for chunk, peer in zip(chunks, peers)]
    return _finish(works, None, async_op)


def all_to_all(output: Tensor, input: Tensor, *, group=None) -> Tensor:
    """Chunk r of ``input`` (split evenly along dim 0) goes to rank r of ``group``; chunk r of ``output`` comes
    from rank r (gloo has it too, on the CPU). Synchronous: its result is used at once (sequence/ulysses.py)."""
    _note("all_to_all", input, input.numel(), group)
    dist.all_to_all_single(output, input, group=group)
    return output


def all_reduce(tensor: Tensor, op: dist.ReduceOp, *, group=None) -> Tensor:
    """In-place blocking all-reduce of a small tensor (flags, norms); returns it."""
    _note("all_reduce", tensor, tensor.numel(), group)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_async(tensor: Tensor, op: dist.ReduceOp, *, group=None) -> dist.Work:
    """In-place all-reduce of ``tensor`` started now (hybrid sharding's replica sums: several in flight)."""
    _note("all_reduce", tensor, tensor.numel(), group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def broadcast(tensor: Tensor, *, src: int, group=None) -> Tensor:
    """In-place blocking broadcast of a small tensor from rank ``src`` of ``group``; returns it."""
    _note("broadcast", tensor, tensor.numel(), group)
    dist.broadcast(tensor, src=src if group is None else dist.get_global_rank(group, src), group=group)
    return tensor


def broadcast_coalesced(tensors: list[Tensor], *, src: int, bucket_bytes: int, group=None) -> None:
    """In-place blocking broadcast of ``tensors`` (any dtypes) from rank ``src`` of ``group``, packed into
    buckets of about ``bucket_bytes`` (as ddp broadcasts module states)."""
    for tensor in tensors:
        _note("broadcast", tensor, tensor.numel(), group)
    group = group or dist.group.WORLD
    dist._broadcast_coalesced(group, tensors, bucket_bytes, dist.get_global_rank(group, src))


def all_gather_object(obj: object, *, group=None) -> list:
    """Every rank's ``obj``, in rank order (for set-up checks, never on the hot path)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: object, *, dst: int = 0, group=None) -> list | None:
    """Every rank's ``obj``, in rank order, on global rank ``dst`` (None elsewhere); never on the hot path."""
    out: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def wait(work: dist.Work | Pending | None) -> None:
    """Waits on ``work``, what an asynchronous collective returned (None, a synchronous one's result: nothing)."""
    if work is not None:
        work.wait()

"""FlatUnit: one flat, padded buffer of parameters, sharded over the data-parallel ranks.

A unit is the partition layer every stage builds on: stages 1 and 2 make one unit per optimizer
param group, stage 3 one per module subtree. It owns
- ``flat_param``: every parameter of the unit, back to back in the bucket-major layout of
  ``layout.py``; the model's parameters are views into it, so the model reads what the all-gather
  writes. In stage 3 (``shard_params``) its storage exists only while the unit is gathered;
- ``param_shard`` (stage 3): this rank's partition in the parameters' dtype, the input of the
  all-gather (with fp32 parameters it is also the master weights); with ``offload.params`` a host buffer;
- ``state``: where the parameter values are (``UnitState``);
- ``training`` (unit_training.py, made by ``make_trainable``): the master weights, the gradients and the
  pieces the optimizer steps; None for frozen and evaluation-only units."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.config import HostOffload
from lightning_zero.nvme.param_swap import ParamSwap, read_or_zeros
from lightning_zero.sharding import collectives
from lightning_zero.sharding.layout import Bucket, FlatLayout
from lightning_zero.sharding.offload import copy_to, host_empty
from lightning_zero.sharding.quantize import dequantize_into, quantize
from lightning_zero.sharding.unit_training import UnitTraining


class UnitState(enum.Enum):
    """Where a unit's parameter values are.

    [Note: a unit's states]
    Stages 1 and 2 keep every unit ``WHOLE`` for its life. A stage-3 unit is ``SHARDED`` (only this rank's shard; its
    parameters are placeholders, sharded_param.py) until ``unshard`` starts the all-gather into its flat buffer
    (``GATHERING``: the buffer exists, its values are valid once the gather is waited on), ``wait_gathered`` makes it
    ``GATHERED``, and ``reshard`` frees the buffer (``SHARDED`` again). After an error a gather in flight is forgotten
    without waiting for peers that may never come: a unit the schedule keeps gathered for the whole run
    (``abandon_gather``) counts as ``GATHERED``, any other (``forget_values``) as ``SHARDED`` again, so that the next
    run's schedule gathers it on every rank alike; its buffer is left allocated (freeing it under a gather still in
    flight is unsafe) until that gather reuses it."""

    WHOLE = "whole"
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class FlatUnit:
    """One flat, padded buffer of parameters sharded over the data-parallel ranks, and what it owns (see above)."""

    def __init__(
        self,
        params: Sequence[Parameter],
        names: Sequence[str],
        layout: FlatLayout,
        rank: int,
        *,
        full_grad: bool = False,
        shard_params: bool = False,
        trainable: bool = True,
        device: torch.device | None = None,
        grad_dtype: torch.dtype | None = None,
        offload: HostOffload | None = None,
    ) -> None:
        """``full_grad``: stage 1's full gradient buffer, else a gradient partition (stages 2 and 3). ``shard_params``:
        stage 3; needs a one-bucket layout. ``trainable``: False when only evaluating (no master weights, gradients or
        pieces). Parameters on the meta device are replaced by new Parameter objects (``replaced`` maps old to new)
        whose values come later (``write_owned``); other parameters are re-pointed into the flat buffer in place."""
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1 or len({p.device for p in params}) > 1:
            raise ValueError(
                "the parameters of one flat unit must share dtype and device, got dtypes"
                f" {sorted(map(str, dtypes))} and devices {sorted({str(p.device) for p in params})} for {list(names)}"
            )
        if shard_params and len(layout.buckets) != 1:
            raise ValueError("a unit with sharded parameters needs a layout of exactly one bucket")
        self.names = list(names)
        self.layout = layout
        self.rank = rank
        self.param_dtype = params[0].dtype
        device = device if device is not None else params[0].device
        on_meta = params[0].is_meta

        self.flat_param = torch.zeros(layout.total_numel, dtype=self.param_dtype, device=device)
        self.replaced: dict[Parameter, Parameter] = {}
        self._views = [
            self.flat_param[offset : offset + numel].view(p.shape)
            for p, offset, numel in zip(params, layout.offsets, layout.numels)
        ]
        self._point_into_buffer(params, on_meta)
        self.params = [self.replaced.get(p, p) for p in params]
        self.shapes = [tuple(p.shape) for p in params]
        nan = torch.full((), float("nan"), dtype=self.param_dtype, device=device)
        self._placeholders = [nan.expand(shape) for shape in self.shapes]

        self.param_shard = None
        self.param_swap: ParamSwap | None = None  # stage 3 with offload_param="nvme": the shard is there
        self.offload = offload
        self.state = UnitState.WHOLE
        self._gather: dist.Work | collectives.Pending | None = None  # the all-gather in flight (GATHERING)
        self.quantized_values = False  # gathered from int8 shards (quantize.py): not the exact weights
        self.secondary: Tensor | None = None  # hpZ: this rank's part of the unit inside its node (stage3.py)
        self.training: UnitTraining | None = None  # made by make_trainable (unit_training.py)
        if shard_params:
            if offload is not None and offload.params:
                self.param_shard = host_empty(layout.partition_numel, self.param_dtype, device, offload)
            else:
                self.param_shard = torch.empty(layout.partition_numel, dtype=self.param_dtype, device=device)
            self.param_shard.copy_(self.param_chunk(layout.buckets[0]))
            self.reshard()
        if trainable:
            self.make_trainable(full_grad=full_grad, grad_dtype=grad_dtype, offload=offload)
        if shard_params and trainable and offload is not None and offload.nvme is not None and offload.nvme.params:
            pin = offload.pin_memory and device.type == "cuda"
            self.param_swap = ParamSwap(offload.nvme, layout.partition_numel, self.param_dtype, pin=pin)
            self.param_swap.write(0, self.param_shard)
            self.param_shard = torch.empty(layout.partition_numel, dtype=self.param_dtype, device="meta")

    @torch.no_grad()
    def _point_into_buffer(self, params: Sequence[Parameter], on_meta: bool) -> None:
        for p, view in zip(params, self._views):
            if on_meta:
                # .data: a Parameter sharing the buffer's version counter (bumped by every gather) would look modified
                self.replaced[p] = Parameter(view.data, requires_grad=p.requires_grad)
            else:
                view.copy_(p.detach())
                p.data = view

    def make_trainable(
        self, *, full_grad: bool = False, grad_dtype: torch.dtype | None = None, offload: HostOffload | None = None
    ) -> None:
        """Adds what training needs (unit_training.py): the fp32 master partition, gradient storage, the pieces."""
        if self.training is None:
            self.offload = offload  # (a frozen unit made trainable: the run's offload, that of its shard included)
            self.training = UnitTraining(self, full_grad=full_grad, grad_dtype=grad_dtype, offload=offload)

    @property
    def trainable(self) -> bool:
        """Whether the unit has master weights and gradients (frozen and evaluation-only units do not)."""
        return self.training is not None

    @property
    def requires_grad(self) -> bool:
        """Whether any of the unit's parameters requires a gradient."""
        return any(p.requires_grad for p in self.params)

    # --- views -------------------------------------------------------------------------------------
    def param_chunk(self, bucket: Bucket) -> Tensor:
        """This rank's chunk of ``bucket`` in the flat buffer (a view)."""
        lo, hi = bucket.chunk_range(self.rank)
        return self.flat_param[lo:hi]

    def partition_slice(self, bucket: Bucket) -> slice:
        """Where this rank's chunk of ``bucket`` sits in its partition."""
        return slice(bucket.partition_offset, bucket.partition_offset + bucket.chunk_numel)

    # --- stage 3: gathered only while in use (see [Note: a unit's states]) ---------------------------
    @property
    def gathered(self) -> bool:
        """The flat buffer exists (whole units, and stage-3 units gathered or being gathered)."""
        return self.state is not UnitState.SHARDED

    def unshard(self, *, async_op: bool, group=None, quantize_block: int | None = None) -> None:
        """Allocates the flat buffer, starts the all-gather of every rank's shard into it and points the
        parameters at it: ``GATHERING`` (``async_op``; the values are valid after ``wait_gathered``), else
        ``GATHERED``. With ``quantize_block`` the shards travel as int8 with a scale per block of that many
        elements (quantize.py's [Note: quantized weight gathers]). Collective."""
        self.wait_gathered()  # (never two gathers into one buffer at once)
        self._allocate()
        self.quantized_values = quantize_block is not None
        if self.param_swap is not None:  # on NVMe: read from now, gathered when waited on (in schedule order)
            self._gather = collectives.Pending(
                [], partial(self._gather_from, self.param_swap.start_read(), quantize_block, group)
            )
        else:
            self._gather = self._gather_from(lambda: self.param_shard, quantize_block, group, async_op=async_op)
        self.state = UnitState.GATHERING
        if not async_op:
            self.wait_gathered()

    def _gather_from(self, shard: Callable[[], Tensor], quantize_block: int | None, group, *, async_op: bool = False):
        """Starts the all-gather of ``shard()`` into the flat buffer (unreadable: zeros, its error raised after)."""
        shard, failed = read_or_zeros(shard, self.layout.partition_numel, self.param_dtype)
        if shard.device != self.flat_param.device:
            shard = shard.to(self.flat_param.device, non_blocking=shard.is_pinned())
        if quantize_block is None:
            gather = collectives.all_gather(self.flat_param, shard, async_op=async_op, group=group)
        else:
            gather = self._gather_quantized(shard, quantize_block, group=group)
            if not async_op:
                gather.wait()
        if failed is not None:
            raise failed
        return gather

    def keep_secondary(self, node_rank: int, node_size: int) -> None:
        """hpZ: keeps this rank's 1/``node_size`` of the gathered unit (the node's ranks together hold it whole)."""
        part = self.flat_param.numel() // node_size
        self.secondary = self.flat_param[node_rank * part : (node_rank + 1) * part].clone()

    def drop_secondary(self) -> None:
        """hpZ: forgets this rank's part of the unit kept by ``keep_secondary``."""
        self.secondary = None

    def unshard_within_node(self, *, group=None) -> None:
        """hpZ: gathers the unit from the secondary parts of the node's ranks (``GATHERING``); the values are
        those its last gather from the shards gave (quantized or not). Collective over the node."""
        self.wait_gathered()
        self._allocate()
        self._gather = collectives.all_gather(self.flat_param, self.secondary, async_op=True, group=group)
        self.state = UnitState.GATHERING

    def gathered_from(self, rows: Tensor) -> None:
        """Gathered by a collective of several units (``unshard_together``): row r of ``rows`` is rank r's shard."""
        self._allocate()
        self.flat_param.view(rows.shape[0], -1).copy_(rows)
        self.state = UnitState.GATHERED

    def _gather_quantized(self, shard: Tensor, block: int, *, group=None) -> collectives.Pending:
        values, scales = quantize(shard, block)
        world = self.layout.world_size
        all_values = values.new_empty(world * values.numel())
        all_scales = scales.new_empty(world * scales.numel())
        works = [
            collectives.all_gather(all_values, values, async_op=True, group=group),
            collectives.all_gather(all_scales, scales, async_op=True, group=group),
        ]
        rows = (self.flat_param.view(world, -1), all_values.view(world, -1), all_scales.view(world, -1))
        return collectives.Pending(works, partial(dequantize_into, *rows, block))

    def wait_gathered(self) -> None:
        """Waits on the gather in flight (``GATHERING`` becomes ``GATHERED``); in any other state does nothing."""
        if self.state is UnitState.GATHERING:
            work, self._gather = self._gather, None
            collectives.wait(work)
            self.state = UnitState.GATHERED

    def abandon_gather(self) -> None:
        """After an error: forgets the gather in flight without waiting on peers (see the Note); a deferred one (a shard
        on NVMe) never ran: that unit counts as sharded."""
        if self.state is UnitState.GATHERING and self.param_swap is not None:
            self.forget_values()
        elif self.state is UnitState.GATHERING:
            self._gather, self.state = None, UnitState.GATHERED

    def forget_values(self) -> None:
        """After an error: the unit counts as sharded again, its buffer left as it is (see the Note)."""
        if self.state is not UnitState.WHOLE:
            self._gather, self.state, self.secondary = None, UnitState.SHARDED, None

    def _allocate(self) -> None:
        storage = self.flat_param.untyped_storage()
        storage.resize_(self.flat_param.numel() * self.flat_param.element_size())
        for p, view in zip(self.params, self._views):
            p.data = view

    def reshard(self) -> None:
        """Frees the flat buffer; until the next unshard each parameter is a placeholder (see stage3.py). A ``.data``
        replaced while gathered is kept first (``take_replaced``)."""
        self.wait_gathered()
        self.take_replaced()
        for p, placeholder in zip(self.params, self._placeholders):
            p.data = placeholder
        self.flat_param.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    def _replaced(self, index: int) -> bool:
        view = self._views[index]
        return view.numel() > 0 and self.params[index].data_ptr() != view.data_ptr()

    def data_replaced(self) -> bool:
        """Whether user code replaced a parameter's ``.data`` while the unit is whole (pointer checks: cheap)."""
        whole = self.state in (UnitState.WHOLE, UnitState.GATHERED)
        return whole and any(self._replaced(k) for k in range(len(self.params)))

    def take_replaced(self) -> None:
        """Keeps each ``.data`` user code replaced while the unit is whole (``p.data = t``, as ddp keeps ``t``):
        ``t``'s values go into the flat buffer and this rank's pieces of them into the shard and the master (see
        param_writes.py's [Note: a replaced .data])."""
        if self.state in (UnitState.WHOLE, UnitState.GATHERED):
            for index in range(len(self.params)):
                if self._replaced(index):
                    self.adopt(index)
                    self.write_owned(index, self._views[index])

    def replace(self, index: int, value: Tensor) -> bool:
        """``params[index].data = value`` while the parameter has the sharded class: False for the flat buffer's own
        view (the unit re-pointing it); else user code's write, kept as above: a gathered copy takes ``value`` and
        this rank its pieces of it (no collective: every rank runs the same code, as under ddp)."""
        view = self._views[index]
        if value is view:
            return False
        if tuple(value.shape) != self.shapes[index]:
            raise ValueError(self._shape_error(index, value))
        if self.gathered:
            self.wait_gathered()
            view.copy_(value.detach())
        self.write_owned(index, value)
        return True

    def _shape_error(self, index: int, value: Tensor) -> str:
        return (
            f"{self.names[index]}: its data was replaced by a tensor of shape {tuple(value.shape)}; a sharded"
            f" parameter keeps its shape {self.shapes[index]}"
        )

    def adopt(self, index: int) -> None:
        """Parameter ``index`` is whole here and its ``.data`` was replaced (``p.data = t``): ``t``'s values go into
        the flat buffer, which the parameter views again (see param_writes.py)."""
        param, view = self.params[index], self._views[index]
        if not self._replaced(index):
            return
        if tuple(param.shape) != self.shapes[index]:
            raise ValueError(self._shape_error(index, param))
        view.copy_(param.data)
        param.data = view

    def write_owned(self, index: int, value: Tensor) -> None:
        """Stores this rank's part of parameter ``index`` from its full ``value``."""
        flat = value.detach().reshape(-1)
        self.write_owned_from(index, lambda lo, hi: flat[lo:hi])

    def write_owned_from(self, index: int, read: Callable[[int, int], Tensor]) -> None:
        """Stores this rank's part of parameter ``index``: elements [lo, hi) of it, as ``read(lo, hi)`` gives them."""
        self.secondary = None  # (it mirrors the shards)
        piece = next((pc for pc in self.layout.pieces(self.rank) if pc.param == index), None)
        if piece is None:
            return
        lo = piece.partition_offset
        own = read(piece.lo, piece.hi)
        if self.param_swap is not None:  # on NVMe: the blocks it falls in read, changed and written
            self.param_swap.update(lo, own)
        elif self.param_shard is not None:
            self.param_shard[lo : lo + piece.numel].copy_(own)
        if self.training is not None and (self.param_shard is None or self.training.master is not self.param_shard):
            self.training.write_master(lo, own)  # (stage 3's fp32 master may be the shard itself)

    # --- after a step -------------------------------------------------------------------------------
    def follow_master(self, *, group=None) -> None:
        """Makes the parameters follow the master, now (after a load, or a write of weight averaging's). Collective."""
        self.training.forget_params_written()  # the last step's copies are not the master now
        if self.param_shard is None:
            for work in [self.publish(bucket, group=group) for bucket in self.layout.buckets]:
                collectives.wait(work)
        else:
            self.refresh_shard()
            if self.gathered:
                self.unshard(async_op=False, group=group)

    def refresh_shard(self) -> None:
        """Stage 3 after a step: the shard follows the updated master (the next gather spreads it; a unit
        gathered now must be gathered again, see ``unshard_together``). Stages 1 and 2: see ``publish``."""
        self.secondary = None  # (it mirrors the shards)
        training = self.training
        if training.staged_params is not None:
            copy_to(self.param_shard, training.staged_params)
        elif self.param_shard is not training.master and not training.params_written:
            copy_to(self.param_shard, training.master)

    def publish(self, bucket: Bucket, *, group=None) -> dist.Work | collectives.Pending | None:
        """Stages 1 and 2 after a step: copies this rank's updated chunk of ``bucket`` into the flat buffer
        and starts the all-gather that gives every rank the whole bucket (see param_gather.py)."""
        own = self.param_chunk(bucket)
        training = self.training
        if training.staged_params is not None:
            copy_to(own, training.staged_params[self.partition_slice(bucket)])
        elif own.data_ptr() != training.master_chunk(bucket).data_ptr() and not training.params_written:
            copy_to(own, training.master_chunk(bucket))
        flat = self.flat_param[bucket.start : bucket.start + bucket.numel]
        return collectives.all_gather(flat, own, async_op=True, group=group)


def unshard_together(units: Sequence[FlatUnit], *, group=None) -> None:
    """Stage 3: gathers ``units`` with one all-gather per dtype: every rank's shards back to back, then each unit's rows
    copied into its flat buffer. For the persistent units, small by definition, so the copy costs less than a
    collective per unit. A shard on NVMe that cannot be read is sent as zeros and the error raised after."""
    by_dtype: dict[torch.dtype, list[FlatUnit]] = {}
    for unit in units:
        by_dtype.setdefault(unit.param_dtype, []).append(unit)
        unit.wait_gathered()
    for same in by_dtype.values():
        readers = [u.param_swap.read if u.param_swap is not None else partial(getattr, u, "param_shard") for u in same]
        reads = [read_or_zeros(read, u.layout.partition_numel, u.param_dtype) for read, u in zip(readers, same)]
        packed = torch.cat([shard for shard, _ in reads]).to(same[0].flat_param.device)  # this rank's shards
        world = same[0].layout.world_size
        rows = packed.new_empty(world * packed.numel())
        collectives.all_gather(rows, packed, async_op=False, group=group)
        rows = rows.view(world, -1)
        start = 0
        for unit in same:
            numel = unit.param_shard.numel()
            unit.gathered_from(rows[:, start : start + numel])
            start += numel
        if any(failed is not None for _, failed in reads):
            raise next(failed for _, failed in reads if failed is not None)

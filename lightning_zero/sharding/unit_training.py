"""UnitTraining: what a flat unit needs to be trained, beside its storage (flat_unit.py).

A trainable unit has
- ``master``: this rank's partition (its chunk of every bucket) in fp32: the weights the optimizer
  updates, copied (and cast) back into the parameters after each step. With fp32 parameters in stages
  1 and 2 there is no separate copy (``master is None``, ``master_in_place``): the optimizer steps this
  rank's chunks of the flat buffer itself, which the all-gather then sends; stage 3's fp32 shard *is* it;
- ``pieces``: per-parameter views into ``master``, one per parameter this rank owns part of. The user's
  optimizer steps these, so per-parameter semantics (a parameter without a gradient is skipped: no
  momentum, no weight decay) hold exactly as on the unsharded model;
- gradient storage (see [Note: gradient storage]) and ``used``: which parameters received a gradient
  since the last ``zero_grad``; and ``state``, where the step's gradients are (``GradState``).
With ``offload`` the master and the reduced gradient partition are host buffers of their own (offload.py); offloaded to
NVMe, the master (and the optimizer's moments) live in ``swap`` and ``master`` is a placeholder on the meta device
that holds no data, except while a save or a load makes it resident (swapped.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_zero.config import HostOffload
from lightning_zero.nvme.optimizer_swap import UnitSwap
from lightning_zero.nvme.swap_file import mapped_zeros, zero_mapped
from lightning_zero.sharding.layout import Bucket, Piece
from lightning_zero.sharding.offload import host_empty

if TYPE_CHECKING:
    from lightning_zero.sharding.flat_unit import FlatUnit


class GradState(enum.Enum):
    """Where a unit's gradients are in the step; changed only by ``UnitTraining``'s methods.

    [Note: a unit's gradient lifecycle]
    ``IDLE`` (nothing local waits for a reduction; stages 2 and 3 may hold earlier micro-batches' reduced sums)
    -> ``FILLING`` when a backward starts (gradient hooks add into the unit's storage) -> ``REDUCED`` once its
    reductions are done (the partition holds this rank's reduced gradients: at the backward's end, or for stage 1 at
    the step) or, for stage 1 at the end of a micro-batch before a step's last, ``ACCUMULATED`` (the full gradient
    waits for the step's reduction) -> ``ATTACHED`` once the
    step hands the fp32 gradients to the optimizer's pieces (a gradient arriving now is an error) ->
    ``PARAMS_WRITTEN`` when the fused step also wrote the parameters' 16-bit copy (the post-step copy is
    skipped) -> ``IDLE`` again when the step or ``zero_grad`` releases them. Every transition but ``FILLING``'s
    follows a collective event (a backward's end, a reduction, a step), so it is the same on every rank.
    """

    IDLE = "idle"
    FILLING = "filling"
    ACCUMULATED = "accumulated"
    REDUCED = "reduced"
    ATTACHED = "attached"
    PARAMS_WRITTEN = "params written"


class UnitTraining:
    """What a flat unit needs to be trained: its master partition, gradient storage and pieces (see above)."""

    def __init__(
        self,
        unit: FlatUnit,
        *,
        full_grad: bool = False,
        grad_dtype: torch.dtype | None = None,
        offload: HostOffload | None = None,
    ) -> None:
        """The fp32 master partition, gradient storage and the pieces of ``unit`` (whose storage it reads, never
        writes). ``full_grad``: stage 1's full gradient buffer, else a gradient partition (stages 2 and 3).

        [Note: gradient storage]
        Gradients are stored in ``grad_dtype`` (by default the parameters' dtype; see
        ``ZeroConfig.reduce_dtype``): the dtype buckets are reduced in and partitions accumulate in. Stage 1
        accumulates full gradients across micro-batches in ``flat_grad`` and reduce-scatters them once
        per step into a transient ``reduced`` partition. Stages 2 and 3 reduce-scatter every backward
        and accumulate only this rank's partition, which is ``reduced`` at all times. At the step the
        optimizer gets ``step_grad``: ``reduced`` itself when it is fp32, else an fp32 copy that lives
        until the step is done. The padding stays zero, since no gradient is ever written there, so
        it never reaches a norm. With ``offload`` the partition lives on the host in fp32 (the device's
        reduced chunks are added into it, see offload.py), and so does the master.
        """
        self.unit, self.layout, self.rank, self.offload = unit, unit.layout, unit.rank, offload
        self.device = unit.flat_param.device
        self.master: Tensor | None = None
        self.swap: UnitSwap | None = None  # offloaded to NVMe: the master and moments are there (see _make_master)
        self.master_in_place = False  # stages 1 and 2 with fp32 parameters: the master is the flat buffer's chunks
        self._make_master()
        self.grad_dtype = grad_dtype or unit.param_dtype
        total = self.layout.total_numel
        self.flat_grad = torch.zeros(total, dtype=self.grad_dtype, device=self.device) if full_grad else None
        # stage 1 offloaded: the step's partition, kept and reused
        self.grad_partition = self._new_partition() if not full_grad or offload is not None else None
        self.reduced: Tensor | None = None if full_grad else self.grad_partition
        self.step_grad: Tensor | None = None
        self.staged_params: Tensor | None = None  # offloaded: the step's 16-bit copy on the host, to be sent
        self.used = bytearray(len(unit.params))  # on the host: set by gradient hooks without touching the device
        self.used_anywhere: list[bool] | None = None  # per parameter, at the step: got a gradient on some rank
        self.state = GradState.IDLE
        self.pieces: list[Piece] = self.layout.pieces(self.rank)
        self.piece_tensors = [self.master_view(pc.partition_offset, pc.numel) for pc in self.pieces]
        self._piece_index = {pc.param: k for k, pc in enumerate(self.pieces)}

    def _make_master(self) -> None:
        unit, layout, fp32 = self.unit, self.layout, torch.float32
        shard = unit.param_shard
        if self.offload is not None:  # a host master of its own, unless the shard is fp32 and on the host already
            on_host = shard is not None and shard.device.type == "cpu" and self.offload.params
            if on_host and unit.param_dtype == fp32 and self.offload.nvme is None:
                self.master = shard
                return
            self.master = host_empty(layout.partition_numel, fp32, self.device, self.offload)
            for bucket in layout.buckets:
                own = shard if shard is not None else unit.param_chunk(bucket)
                self.master[unit.partition_slice(bucket)].copy_(own)
            if self.offload.nvme is not None:  # written to its swap file; a placeholder here that holds no data
                pin = self.offload.pin_memory and self.device.type == "cuda"
                self.swap = UnitSwap(self.offload.nvme, layout.partition_numel, pin=pin)
                self.swap.write_master(self.master)  # (the moments: zeros, as the new file reads)
                self.master = torch.empty(layout.partition_numel, device="meta")
        elif shard is not None:  # stage 3: fp32 shards are the master themselves
            self.master = shard if unit.param_dtype == fp32 else shard.to(fp32)
        elif unit.param_dtype == fp32:
            self.master_in_place = True
        else:
            self.master = torch.empty(layout.partition_numel, dtype=fp32, device=self.device)
            for bucket in layout.buckets:
                self.master_chunk(bucket).copy_(unit.param_chunk(bucket))

    def _new_partition(self) -> Tensor:
        """A zeroed reduced-gradient partition: on the device in ``grad_dtype``, or offloaded in fp32 (to NVMe: a
        shared mapping of a file under ``nvme_path``, whose pages the kernel writes out under memory pressure)."""
        if self.offload is None:
            return torch.zeros(self.layout.partition_numel, dtype=self.grad_dtype, device=self.device)
        if self.offload.nvme is not None:
            return mapped_zeros(self.offload.nvme.directory, self.layout.partition_numel)
        return host_empty(self.layout.partition_numel, torch.float32, self.device, self.offload).zero_()

    def _zeroed(self, partition: Tensor) -> Tensor:
        """``partition`` zeroed (a file's mapping, offloaded to NVMe: its pages given back, not written)."""
        if self.offload is not None and self.offload.nvme is not None:
            zero_mapped(partition)
        else:
            partition.zero_()
        return partition

    def reduced_partition(self) -> Tensor:
        """Where reductions add this rank's chunks: stage 2 and 3's partition, or stage 1's for this step (made on
        its first reduction: the persistent offloaded one zeroed, else a transient one)."""
        if self.reduced is None:
            self.reduced = self._new_partition() if self.grad_partition is None else self._zeroed(self.grad_partition)
        return self.reduced

    # --- views -------------------------------------------------------------------------------------
    def master_chunk(self, bucket: Bucket) -> Tensor:
        """This rank's chunk of ``bucket`` in the master partition (the flat buffer's chunk when it is the master)."""
        if self.master_in_place:
            return self.unit.param_chunk(bucket)
        return self.master[self.unit.partition_slice(bucket)]

    def master_view(self, offset: int, numel: int) -> Tensor:
        """Elements [offset, offset + numel) of the master partition, which lie within one bucket's chunk."""
        if not self.master_in_place:
            return self.master[offset : offset + numel]
        bucket = next(b for b in reversed(self.layout.buckets) if b.partition_offset <= offset)
        start = offset - bucket.partition_offset
        return self.master_chunk(bucket)[start : start + numel]

    def master_partition(self) -> Tensor:
        """The master partition as one tensor (a copy of the flat buffer's chunks when it lives there)."""
        if self.master_in_place:
            return torch.cat([self.unit.param_chunk(bucket) for bucket in self.layout.buckets])
        return self.master

    def write_master(self, lo: int, values: Tensor) -> None:
        """Stores ``values`` as master elements [lo, lo + len) (on NVMe: in the chunks they fall in)."""
        if self.swap is None:
            self.master_view(lo, values.numel()).copy_(values.reshape(-1))
        else:
            self.swap.update_master(lo, values.reshape(-1))

    def piece_of(self, index: int) -> tuple[Piece | None, Tensor | None]:
        """This rank's piece of parameter ``index`` and its view into the master, or (None, None)."""
        k = self._piece_index.get(index)
        return (None, None) if k is None else (self.pieces[k], self.piece_tensors[k])

    # --- the gradient lifecycle (see [Note: a unit's gradient lifecycle]) ------------------------------
    @property
    def taken_by_step(self) -> bool:
        """The step has handed this step's gradients to the optimizer."""
        return self.state in (GradState.ATTACHED, GradState.PARAMS_WRITTEN)

    @property
    def params_written(self) -> bool:
        """The step wrote the parameters' copy already (sharding/fused_step.py); always, with the master on NVMe
        (its step and every write of the master write the parameters: sharding/swapped.py)."""
        return self.state is GradState.PARAMS_WRITTEN or self.swap is not None

    def mark_used(self, index: int) -> None:
        """Parameter ``index`` received a gradient (on this rank, since the last ``zero_grad``)."""
        self.used[index] = 1

    def begin_backward(self) -> None:
        """A backward starts: ``FILLING``, unless the step has taken the gradients already."""
        if not self.taken_by_step:  # (a gradient arriving then raises in the hook)
            self.state = GradState.FILLING

    def end_accumulating_backward(self) -> None:
        """Stage 1, a micro-batch before the step's last: its gradients wait in the full gradient."""
        if self.state is GradState.FILLING:
            self.state = GradState.ACCUMULATED

    def reductions_done(self) -> None:
        """Every bucket was reduced and (stage 1) its region of the full gradient zeroed."""
        if not self.taken_by_step:
            self.state = GradState.REDUCED

    def needs_reduction(self) -> bool:
        """Stage 1 at the step: no reduction gave this step's partition yet (micro-batches accumulated, or no
        backward ran). The same on every rank: set by backwards' ends and reductions only."""
        return self.flat_grad is not None and (self.reduced is None or self.state is GradState.ACCUMULATED)

    def attach_grads(self, used: Sequence[int]) -> None:
        """Points each piece's ``.grad`` at its fp32 reduced gradient, or None where no rank produced one.

        ``used`` is on the host (one flag per parameter): indexing a device tensor here would sync per piece.
        """
        self.used_anywhere = [bool(flag) for flag in used]
        self.step_grad = self.reduced if self.reduced.dtype == torch.float32 else self.reduced.to(torch.float32)
        for piece, tensor in zip(self.pieces, self.piece_tensors if self.swap is None else ()):  # (NVMe: none)
            lo = piece.partition_offset
            tensor.grad = self.step_grad[lo : lo + piece.numel] if used[piece.param] else None
        self.state = GradState.ATTACHED

    def mark_params_written(self) -> None:
        """The fused step wrote the parameters' copy (the post-step copy is skipped)."""
        self.state = GradState.PARAMS_WRITTEN

    def forget_params_written(self) -> None:
        """The parameters follow the master now (a load, a write): the step's copy is not current any more."""
        self.staged_params = None
        if self.state is GradState.PARAMS_WRITTEN:
            self.state = GradState.ATTACHED

    def nonfinite(self) -> Tensor:
        """1 if this rank's reduced gradient holds an inf or nan, else 0 (a device tensor: no sync)."""
        return (~torch.isfinite(self.reduced)).any().to(torch.uint8).reshape(1)

    def stage_params(self, written: Sequence[tuple[int, int]]) -> None:
        """A host buffer for this step's 16-bit parameter partition (see fused_step.py), pinned on CUDA;
        the step writes the ranges ``written`` (ascending), the rest (padding) is zeroed here."""
        staged = host_empty(self.layout.partition_numel, self.unit.param_dtype, self.device, self.offload)
        end = 0
        for lo, hi in (*written, (staged.numel(), staged.numel())):
            staged[end:lo].zero_()
            end = hi
        self.staged_params = staged

    def release_grads(self) -> None:
        """The step is done with the gradients: drops the pieces' ``.grad``, the fp32 copy and the staged parameters
        (stage 1 its step's partition too); back to ``IDLE``. Stages 2 and 3 keep their partition's values."""
        self.staged_params = None
        for tensor in self.piece_tensors:
            tensor.grad = None
        self.step_grad = None
        self.used_anywhere = None
        if self.flat_grad is not None:
            self.reduced = None
        self.state = GradState.IDLE

    def zero_grad(self) -> None:
        """Zeroes what accumulated (stage 1's full gradient, stages 2 and 3's partition), forgets which parameters
        were used, and releases the step's gradients (``release_grads``)."""
        if self.flat_grad is not None and self.state in (GradState.FILLING, GradState.ACCUMULATED):
            self.flat_grad.zero_()  # else every bucket's region was zeroed as its reduction consumed it
        if self.grad_partition is not None and self.flat_grad is None:  # (stage 1's is zeroed when next used)
            self._zeroed(self.grad_partition)
        self.used[:] = bytes(len(self.used))
        self.release_grads()

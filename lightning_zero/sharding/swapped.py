"""Units whose optimizer state is on NVMe (``offload_optimizer="nvme"``; the files: nvme/optimizer_swap.py): their
step, streamed through a few host buffers, and the moments when a save or a load makes one unit's state resident.

[Note: the streamed step]
The step reads each stepped unit's chunks in turn (master, exp_avg and exp_avg_sq of up to ``nvme_buffer_numel``
elements, one record) into a ring of ``nvme_buffer_count`` aligned buffers, the next chunk read ahead and the
previous one written behind while the host AdamW kernel (kernels/host.py; its pure-torch reference without a C
compiler) steps the current one (swap_file.stream). The kernel is the one host offload uses, fed the same
gradient (``step_grad``, the reduced fp32 partition in host memory), factor and hyper-parameters, and AdamW is
elementwise, so the result is bitwise that of ``offload_optimizer="cpu"`` wherever host offload steps a unit with that
kernel (every piece got a gradient, one step count: the usual case). Where host offload falls back to torch's fused
CPU AdamW (a piece without a gradient, counts that differ, ``fused_step="never"``) this step still takes the host
kernel: the same AdamW, rounded otherwise (torch's CPU kernel gives other bits for a tensor stepped in two slices, so
no chunked step could match it). Each chunk's updated master goes into
the parameters at once (their dtype; a device's through a pinned staging copy), so the post-step copy has nothing
left to do (``UnitTraining.params_written``), and only the pieces that got a gradient on some rank are stepped,
each with its own count, as torch's AdamW does. Step counts stay in the optimizer's per-piece state on the host. The
pieces of units on NVMe are placeholders and carry no ``.grad`` in the step: their gradients are the partitions, which
``grad_norm``, ``grad_norms_by_param`` and clipping read. A failed read or write (a disk error) is agreed over every
rank after the step, and raises the first rank's on all of them.

[Note: resident state]
Outside the step a unit's master is a meta placeholder and the optimizer's per-piece state holds only ``step``.
``resident`` reads the whole partition (master and, given the optimizer's state, the moments; one unit: what a
checkpoint's per-unit payload holds anyway) and puts it where the code that saves, loads or reads state dicts looks:
``training.master``, and ``exp_avg`` / ``exp_avg_sq`` views in the state of every piece that has been stepped. Leaving
it with ``write_back`` stores what is there then (what a load wrote, the moments a load put in the state) and writes the
parameters from the master; without, it only drops them. Reading a placeholder fails loudly (meta tensors hold no data),
so code that forgets to make a unit resident cannot read or write stale values silently.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.kernels import host
from lightning_zero.kernels.adamw import AdamWRun, plan_multi_adamw
from lightning_zero.nvme import swap_file
from lightning_zero.nvme.optimizer_swap import split
from lightning_zero.nvme.swap_file import aligned_buffer, stream
from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.fused_step import supports

MOMENTS = ("exp_avg", "exp_avg_sq")


def on_nvme(unit: FlatUnit) -> bool:
    """Whether ``unit`` trains with its optimizer state on NVMe (``offload_optimizer="nvme"``)."""
    return unit.training is not None and unit.training.swap is not None


def write_params(unit: FlatUnit, lo: int, values: Tensor) -> None:
    """Partition elements [lo, lo + len(values)) of ``unit``'s parameters (this rank's part) from fp32 ``values``."""
    hi = lo + values.numel()
    if unit.param_swap is not None:  # stage 3 with the shard on NVMe (written behind: nvme/param_swap.py)
        unit.param_swap.write(lo, values)
        return
    if unit.param_shard is not None:  # stage 3: the shard is the partition
        _copy(unit.param_shard[lo:hi], values)
        return
    for bucket in unit.layout.buckets:  # stages 1 and 2: each bucket's chunk of the flat buffer
        part = unit.partition_slice(bucket)
        start, stop = max(lo, part.start), min(hi, part.stop)
        if start < stop:
            _copy(unit.param_chunk(bucket)[start - part.start : stop - part.start], values[start - lo : stop - lo])


def _copy(target: Tensor, values: Tensor) -> None:
    if target.device.type == "cpu":
        target.copy_(values)
        return
    # through a pinned copy of its own (the caching host allocator keeps it until the copy is done): ``values``
    # lies in a ring buffer that the stream reuses
    staging = torch.empty(values.shape, dtype=target.dtype, pin_memory=True)
    staging.copy_(values)
    target.copy_(staging, non_blocking=True)


@contextmanager
def resident(unit: FlatUnit, state: Mapping[Tensor, dict] | None = None, *, write_back: bool = False) -> Iterator[None]:
    """Within: ``unit``'s master (and, given the optimizer's ``state``, its stepped pieces' moments) are real
    tensors; see [Note: resident state]. Nothing happens for a unit that is not on NVMe."""
    if not on_nvme(unit):
        yield
        return
    training = unit.training
    placeholder = training.master
    master, *moments = training.swap.read() if state is not None else (training.swap.read_master(),)
    _hold_moments(training, state, moments)
    training.master = master
    try:
        yield
        if write_back and state is not None:  # what the pieces' state holds now (a load may have put new tensors there)
            for piece, tensor in zip(training.pieces, training.piece_tensors):
                piece_state, lo = state.get(tensor) or {}, piece.partition_offset
                for key, flat in zip(MOMENTS, moments):
                    view, value = flat[lo : lo + piece.numel], piece_state.get(key)
                    view.copy_(value.reshape(-1)) if value is not None else view.zero_()
            training.swap.write(master, *moments)
        elif write_back:
            training.swap.write_master(master)
        if write_back:
            write_params(unit, 0, master)
    finally:
        training.master = placeholder
        for _, piece_state in _piece_states(training, state):
            for key in MOMENTS:
                piece_state.pop(key, None)


def _piece_states(training, state: Mapping[Tensor, dict] | None) -> list[tuple[tuple[int, int], dict]]:
    """((lo, hi) in the partition, per-piece state) of the pieces that have one."""
    if state is None:
        return []
    out = []
    for piece, tensor in zip(training.pieces, training.piece_tensors):
        piece_state = state.get(tensor)
        if piece_state:
            out.append(((piece.partition_offset, piece.partition_offset + piece.numel), piece_state))
    return out


def _hold_moments(training, state: Mapping[Tensor, dict] | None, moments: list[Tensor]) -> None:
    """Puts views of the resident moments into the state of every piece that has been stepped."""
    for (lo, hi), piece_state in _piece_states(training, state):
        if "step" in piece_state:
            for key, flat in zip(MOMENTS, moments):
                piece_state.setdefault(key, flat[lo:hi])  # (state held before set-up stays, to be written back)


def check_nvme_path(config: ZeroConfig, group) -> None:
    """With ``offload_optimizer="nvme"``: every rank checks its ``nvme_path`` (swap_file.check_nvme_path) and all raise
    the first rank's problem, in one line, before anything is built (collective over ``group``, a CPU group)."""
    if config.offload_optimizer != "nvme":
        return
    problem = None
    try:
        swap_file.check_nvme_path(config.nvme_path)
    except ValueError as error:
        problem = f"rank {dist.get_rank() if dist.is_initialized() else 0}: {error}"
    problems = [p for p in collectives.all_gather_object(problem, group=group) if p is not None]
    if problems:
        raise ValueError(problems[0])


def nvme_step_for(optimizer: Optimizer, units: Sequence[FlatUnit], group) -> NvmeStep | None:
    """The streamed step of ``optimizer``'s units on NVMe (None without any); one line if it cannot step them. State
    the optimizer held before (``optimizer_check.shard_held_state`` put it on the host) goes to the swap files.
    ``group``: a CPU group of every rank, over which a failed step is agreed."""
    if not any(on_nvme(unit) for unit in units):
        return None
    if not supports(optimizer):
        raise ValueError(
            f"offload_optimizer nvme steps with the host AdamW kernel: the optimizer must be torch.optim.AdamW (or"
            f" lightning_zero's FusedAdamW) without amsgrad, maximize, capturable, differentiable, fused or a"
            f" tensor lr, got {optimizer!r}".replace("\n", " ")
        )
    for unit in units:
        held = on_nvme(unit) and any(
            key in optimizer.state.get(t, ()) for t in unit.training.piece_tensors for key in MOMENTS
        )
        if held:
            with resident(unit, optimizer.state, write_back=True):
                pass
    return NvmeStep(optimizer, group)


class NvmeStep:
    """The streamed AdamW step of the units on NVMe (see [Note: the streamed step]); its ring of buffers is made on
    the first step (pinned for a CUDA device) and kept."""

    def __init__(self, optimizer: Optimizer, group) -> None:
        self.optimizer, self.group = optimizer, group
        self.ring: list[Tensor] = []

    def step(self, units: Sequence[FlatUnit], multiplier: float | Tensor, found_inf: Tensor | None) -> set[int]:
        """Steps those of ``units`` on NVMe that have gradients with the pending factor ``multiplier``, unless the
        fp16 overflow flag ``found_inf`` (left on the device) is set; returns the ids of all of those on NVMe."""
        units = [unit for unit in units if on_nvme(unit)]
        if found_inf is not None and bool(found_inf.item()):
            return {id(unit) for unit in units}
        problem = None
        try:
            self._make_ring(units)
            self._step([unit for unit in units if unit.training.step_grad is not None], float(multiplier))
            for unit in units:  # (the shards' writes end inside the agreement: a failed one is agreed too)
                if unit.param_swap is not None:
                    unit.param_swap.flush()
        except OSError as error:  # (a disk's: agreed below, so that no rank goes on to collectives alone)
            problem = f"rank {dist.get_rank()}: the optimizer step on NVMe failed: {error}"
        failed = torch.tensor([problem is not None], dtype=torch.uint8)
        if collectives.all_reduce(failed, dist.ReduceOp.MAX, group=self.group).item():
            raise OSError(next(p for p in collectives.all_gather_object(problem, group=self.group) if p is not None))
        return {id(unit) for unit in units}

    def _step(self, units: Sequence[FlatUnit], multiplier: float) -> None:
        group_of = {id(t): g for g in self.optimizer.param_groups for t in g["params"]}
        plans = [(unit, self._pieces(unit, group_of)) for unit in units]
        plans = [(unit, pieces) for unit, pieces in plans if pieces]
        chunks = [(unit, pieces, lo, hi) for unit, pieces in plans for lo, hi in unit.training.swap.chunks]
        regions = [region for unit, _ in plans for region in unit.training.swap.regions()]
        for k, record in enumerate(stream(regions, self.ring)):  # (the stream drives: its last write follows its end)
            unit, pieces, lo, hi = chunks[k]
            master, exp_avg, exp_avg_sq = split(record, hi - lo)
            runs = []
            for start, stop, group, count, _ in pieces:
                a, b = max(start, lo), min(stop, hi)
                if a < b:
                    beta1, beta2 = group["betas"]
                    window = slice(a - lo, b - lo)
                    runs.append(
                        AdamWRun(
                            master[window], unit.training.step_grad[a:b], exp_avg[window], exp_avg_sq[window],
                            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"], step=count, grad_mul=multiplier,
                        )
                    )  # fmt: skip
            if host.available():
                host.adamw_step(runs)
            else:
                plan_multi_adamw(runs)()
            write_params(unit, lo, master)
        for _, pieces in plans:
            for *_, count, piece_state in pieces:
                piece_state["step"] = torch.tensor(float(count))

    def _pieces(self, unit: FlatUnit, group_of: dict) -> list[tuple[int, int, dict, int, dict]]:
        """(lo, hi, param group, this step's count, state) of each of the unit's pieces that got a gradient."""
        training = unit.training
        out = []
        for piece, tensor in zip(training.pieces, training.piece_tensors):
            if training.used_anywhere[piece.param]:
                piece_state = self.optimizer.state[tensor]
                count = int(float(piece_state["step"])) + 1 if "step" in piece_state else 1
                lo = piece.partition_offset
                out.append((lo, lo + piece.numel, group_of[id(tensor)], count, piece_state))
        return out

    def _make_ring(self, units: Sequence[FlatUnit]) -> None:
        if not units:
            return
        settings = units[0].offload.nvme
        size = max(unit.training.swap.buffer_bytes for unit in units)
        if len(self.ring) < settings.buffer_count or self.ring[0].numel() < size:
            pin = any(unit.training.swap.pin for unit in units)
            self.ring = [aligned_buffer(size, pin=pin) for _ in range(settings.buffer_count)]

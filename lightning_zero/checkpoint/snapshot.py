"""What a save writes, taken from training: each unit's payload for this rank's file (its fp32 master
partition, the optimizer state of its pieces assembled partition-sized, scalars per piece) and copies of
Lightning's state; with the switch of torch.save's own per-record checksum that a synchronous save turns off."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.nvme.swap_file import mapped_zeros
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


def is_elementwise(value: Any, numel: int) -> bool:
    """Whether an optimizer state entry holds one value per element (exp_avg, momentum_buffer, ...)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def unit_payload(
    unit: FlatUnit,
    optimizer: ZeroOptimizer | None,
    weights_only: bool,
    averaged: torch.Tensor | None,
    keep: Callable[[torch.Tensor], torch.Tensor],
    empty: Callable[[int, torch.dtype, bool], torch.Tensor],
) -> dict[str, Any]:
    """``keep(tensor)``: the host tensor written for ``tensor`` (a copy when the save finishes in the background);
    ``empty(numel, dtype, pinned)``: a host buffer (reused from save to save in the background; pinned for a
    device's state), of which whatever no piece fills is zeroed (padding, pieces without state): each byte is
    written once. A unit on NVMe: ``swapped_payload``."""
    if unit.training is not None and unit.training.swap is not None:
        return swapped_payload(unit, None if weights_only else optimizer)
    # A frozen stage-3 unit has no master: its shard is saved, in fp32 like every master.
    master = unit.training.master_partition() if unit.trainable else unit.param_shard
    if master is None:
        raise CheckpointError("sharded checkpoints are written while fitting (the model has no master weights here)")
    payload: dict[str, Any] = {"master": keep(master.float())}
    if averaged is not None:  # see [Note: averaged weights in a checkpoint] in format.py
        payload["averaged"] = averaged  # (a copy already, taken when the save was called)
    if weights_only or optimizer is None:
        return payload
    payload.update(_state_payload(unit, optimizer, keep, empty))
    return payload


def swapped_payload(unit: FlatUnit, optimizer: ZeroOptimizer | None) -> dict[str, Any]:
    """The payload of a unit whose state is on NVMe (sharding/swapped.py), in the same format: its master and moments
    read from the swap file into shared mappings of new files under ``nvme_path`` (swap_file.mapped_zeros), which the
    save then reads page by page; the kernel writes them out under memory pressure, so no unit, and no rank's shard
    file, need be whole in host memory. They are copies training does not touch, so a background save keeps them."""
    swap, directory = unit.training.swap, unit.offload.nvme.directory
    allocate = functools.partial(mapped_zeros, directory)
    if optimizer is None:
        return {"master": swap.read_master(allocate)}
    state = optimizer.optimizer.state
    pieces = zip(unit.training.pieces, unit.training.piece_tensors)
    scalars = {piece.param: {k: v.clone() for k, v in state[t].items()} for piece, t in pieces if state.get(t)}
    master, exp_avg, exp_avg_sq = swap.read(allocate)
    moments = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq} if scalars else {}  # (zeros where no piece has state)
    return {"master": master, "state": moments, "scalars": scalars}


def _state_payload(unit: FlatUnit, optimizer: ZeroOptimizer, keep: Callable, empty: Callable) -> dict[str, Any]:
    """The optimizer state of ``unit``'s pieces: elementwise entries assembled partition-sized, scalars per piece."""
    state: dict[str, torch.Tensor] = {}
    filled: dict[str, list[tuple[int, int]]] = {}  # state key -> (offset, numel) of the pieces written into it
    scalars: dict[int, dict[str, Any]] = {}
    for piece, tensor in zip(unit.training.pieces, unit.training.piece_tensors):
        if not optimizer.optimizer.state.get(tensor):  # (never stepped: an empty entry, which a read may have made)
            continue
        scalars[piece.param] = {}
        for key, value in optimizer.optimizer.state[tensor].items():
            if is_elementwise(value, piece.numel):
                if key not in state:  # assembled on the CPU: no partition-sized spike on the device
                    state[key] = empty(unit.layout.partition_numel, value.dtype, value.is_cuda)
                into = state[key][piece.partition_offset : piece.partition_offset + piece.numel]
                into.copy_(value.reshape(-1), non_blocking=into.is_pinned())  # (a device's: awaited by the writer)
                filled.setdefault(key, []).append((piece.partition_offset, piece.numel))
            else:
                scalars[piece.param][key] = keep(value) if torch.is_tensor(value) else value
    for key, buffer in state.items():
        end = 0
        for offset, numel in sorted(filled[key]):
            buffer[end:offset].zero_()
            end = max(end, offset + numel)
        buffer[end:].zero_()
    return {"state": state, "scalars": scalars}


def copy_tensors(value: Any, keep: Callable[[torch.Tensor], torch.Tensor], memo: dict | None = None) -> Any:
    """``value`` with every tensor in it (dicts of any kind, lists, tuples) replaced by ``keep(tensor)``, a tensor
    held in several places (tied entries) copied once."""
    memo = {} if memo is None else memo
    if torch.is_tensor(value):
        if id(value) not in memo:
            memo[id(value)] = keep(value)
        return memo[id(value)]
    if isinstance(value, dict):
        out = copy.copy(value)  # (its own kind: OrderedDict, defaultdict, ...)
        for key, item in value.items():
            out[key] = copy_tensors(item, keep, memo)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(copy_tensors(v, keep, memo) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tensors(v, keep, memo) for v in value)
    return value


@contextmanager
def zip_crc32(enabled: bool) -> Generator[None, None, None]:
    """torch.save's CRC-32 of every record on or off. It costs a synchronous save about a third of its time (miniz,
    about 1.6 GB/s on one core) and checks nothing ours does not: our checksum covers every byte of every file, and
    torch.load reads no CRC. torch's switch is process-wide, so only a synchronous save turns it off, while the
    training thread waits in it; a background save's writer, beside the training thread, leaves it as it is."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(enabled)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)

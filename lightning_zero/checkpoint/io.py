"""Loading a sharded checkpoint back into units of any world size and stage (saving is save.py).

``open_checkpoint`` checks a directory on every rank and agrees on the verdict, so a bad file
raises the same one-line error everywhere instead of leaving a rank waiting in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_zero.checkpoint.dcp import DcpReader, read_dcp
from lightning_zero.checkpoint.dcp_files import is_dcp
from lightning_zero.checkpoint.format import (
    AVERAGED,
    AVERAGED_IN_SHARDS,
    CheckpointError,
    Metadata,
    averaged_exported,
    check_files,
    load_lightning_state,
    read_metadata,
)
from lightning_zero.checkpoint.plain import PlainReader, read_plain
from lightning_zero.checkpoint.shards import ShardReader
from lightning_zero.sharding import collectives
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.swapped import resident
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer

IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")  # not restored from a checkpoint
# param-group keys a checkpoint of the same kind of optimizer may lack: added by newer torch versions, or left out by
# other implementations of it (DeepSpeed's FusedAdam has no "amsgrad")
OPTIONAL_KEYS = {*IMPLEMENTATION_KEYS, "maximize", "decoupled_weight_decay", "amsgrad"}


def lacking_keys(saved_groups: list[dict[str, Any]], defaults: dict[str, Any]) -> list[str]:
    """The hyper-parameters this optimizer has (``defaults``) that a saved param group lacks, beyond
    ``OPTIONAL_KEYS``: a different kind of optimizer's state (an SGD checkpoint under Adam, say)."""
    return sorted({k for g in saved_groups for k in defaults if k not in g} - OPTIONAL_KEYS)


@dataclass
class LoadedCheckpoint:
    """An opened checkpoint (``open_checkpoint``'s): its path, its metadata, Lightning's state and a reader of
    its tensors."""

    path: Path
    meta: Metadata
    lightning: dict[str, Any]
    reader: ShardReader | PlainReader | DcpReader

    @property
    def average(self) -> dict[str, Any] | None:
        """How the checkpoint holds a weight average, if it does: {"in_shards": bool, "exported": bool} (see
        [Note: averaged weights in a checkpoint] in format.py)."""
        if AVERAGED not in self.lightning:
            return None
        if AVERAGED_IN_SHARDS not in self.lightning:
            return {"in_shards": False, "exported": True}
        return {"in_shards": True, "exported": averaged_exported(self.lightning, self.path)}


def open_checkpoint(
    path: str | os.PathLike,
    *,
    rank: int,
    world_size: int,
    optimizer_names: list[list[list[str]]],
    model_names: list[str] | None = None,
    weights_only: bool = True,
) -> LoadedCheckpoint:
    """Checks a sharded checkpoint directory on every rank (sizes everywhere, each file's checksum on one
    rank), or reads a plain Lightning checkpoint file (``plain.py``) or a torch.distributed.checkpoint
    directory (``dcp.py``), and raises the first problem any rank found, on all of them. Pickled state is
    loaded with ``weights_only`` (True: no code can run; False only for a file you trust).
    ``optimizer_names`` matches a plain file's or DCP's optimizer state, ``model_names`` (the module's
    state-dict keys) a DCP's model."""
    path = Path(path)
    problem, loaded = None, None
    try:
        if path.is_file():
            loaded = LoadedCheckpoint(
                path, *read_plain(path, optimizer_names=optimizer_names, weights_only=weights_only)
            )
        elif is_dcp(path):
            loaded = LoadedCheckpoint(
                path, *read_dcp(path, model_names=model_names or [], optimizer_names=optimizer_names)
            )
        else:
            meta = read_metadata(path)
            check_files(path, meta, checksum=True, share=(rank, world_size))
            lightning = load_lightning_state(path, weights_only=weights_only)
            loaded = LoadedCheckpoint(path, meta, lightning, ShardReader(path, meta))
    except CheckpointError as error:
        problem = f"rank {rank}: {error}"
    except OSError as error:
        problem = f"rank {rank}: {path}: {error.strerror or error}"
    except Exception as error:  # noqa: BLE001 - whatever one rank meets, every rank raises (never one alone)
        problem = f"rank {rank}: {path}: cannot read it: {type(error).__name__}: {error}".splitlines()[0]
    problems = [p for p in collectives.all_gather_object(problem) if p is not None]
    if problems:
        raise CheckpointError(problems[0])
    return loaded


def load_model(
    loaded: LoadedCheckpoint, model: Module, units: Sequence[FlatUnit], *, group=None, averaged: bool = False
) -> None:
    """Loads every parameter and buffer of ``model``, whichever of them the checkpoint sharded and this
    run shards: this rank's pieces of sharded parameters (``units``), whole values of the others; with
    ``averaged`` the checkpoint's weight average instead of its weights (``loaded.average`` says it has one).

    Raises one CheckpointError listing every name and shape that differs before anything is written."""
    entries = model.state_dict(keep_vars=True)
    keys_of: dict[int, list[str]] = {}
    for key, value in entries.items():
        keys_of.setdefault(id(value), []).append(key)
    replicated = loaded.lightning["state_dict"]
    if averaged:
        replicated = {**replicated, **loaded.lightning[AVERAGED]}
    in_shards = averaged and loaded.average["in_shards"]
    saved = {p.name: tuple(p.shape) for u in loaded.meta.units for p in u.params}
    if isinstance(loaded.reader, DcpReader):  # every tensor is read from its files by range
        saved.update(loaded.reader.shapes)
    saved.update({k: tuple(v.shape) for k, v in replicated.items()})
    params = dict(model.named_parameters())
    param_ids = {id(p) for p in params.values()}
    buffers = {k: v for k, v in entries.items() if id(v) not in param_ids}
    wanted = {n: tuple(p.shape) for n, p in {**params, **buffers}.items()}
    found = {n: next((k for k in [n, *keys_of.get(id(params[n]), [])] if k in saved), None) for n in params}
    found.update({k: k if k in saved else None for k in buffers})
    missing = sorted(n for n, k in found.items() if k is None)
    used = {k for k in found.values() if k is not None}
    tied = {k for n in params for k in keys_of.get(id(params[n]), [])}
    unexpected = sorted(k for k in saved if k not in used and k not in tied)
    shapes = [
        f"{n}: saved {saved[k]}, model {wanted[n]}" for n, k in sorted(found.items()) if k and saved[k] != wanted[n]
    ]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{loaded.path}: checkpoint of a different model; not in the checkpoint: {missing}; not in the model:"
            f" {unexpected}; shapes differ: {shapes}"
        )

    def read(name: str, lo: int, hi: int, out: Tensor) -> None:
        key = found[name]
        if key in replicated:
            out.copy_(replicated[key].reshape(-1)[lo:hi])
        else:
            loaded.reader.read(key, lo, hi, out, averaged=in_shards)

    # Every rank reads its pieces first and the ranks agree that all of them could (a file this rank
    # cannot map, a tensor of the wrong size) before any collective: one rank failing between the
    # all-gathers below would leave the others waiting in them.
    problem = None
    try:
        with torch.no_grad():
            _read_pieces(units, params, buffers, replicated, read)
    except Exception as error:  # noqa: BLE001 - agreed below: no rank leaves the others waiting
        problem = f"rank {_rank()}: {loaded.path}: cannot read this rank's part: {error!s}".splitlines()[0]
    problems = [p for p in collectives.all_gather_object(problem) if p is not None]
    if problems:
        raise CheckpointError(problems[0])
    with torch.no_grad():
        for unit in units:
            if unit.trainable:
                unit.follow_master(group=group)  # the parameters follow the loaded master (``group``: the shard group)
            elif unit.gathered:  # a frozen unit kept whole: gather the loaded shards
                unit.unshard(async_op=False, group=group)


def load_average(loaded: LoadedCheckpoint, average: WeightAverage) -> None:
    """Sets ``average`` from the checkpoint's weight average (after ``load_model`` checked the names and
    shapes), this rank's pieces of it; the ranks agree that all could read theirs, as in ``load_model``."""
    whole = loaded.lightning[AVERAGED]
    in_shards = loaded.average["in_shards"]

    def read(name: str, lo: int, hi: int, out: Tensor) -> None:
        if name in whole:
            out.copy_(whole[name].reshape(-1)[lo:hi])
        else:
            buffer = out if out.dtype == torch.float32 and out.device.type == "cpu" else torch.empty(hi - lo)
            loaded.reader.read(name, lo, hi, buffer, averaged=in_shards)
            out.copy_(buffer)

    problem = None
    try:
        average.load(read, whole)
    except Exception as error:  # noqa: BLE001 - agreed below: no rank leaves the others waiting
        problem = f"rank {_rank()}: {loaded.path}: cannot read this rank's weight average: {error!s}".splitlines()[0]
    problems = [p for p in collectives.all_gather_object(problem) if p is not None]
    if problems:
        raise CheckpointError(problems[0])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _read_pieces(units, params, buffers, replicated, read) -> None:
    """This rank's pieces of sharded parameters into their masters (or frozen shards), whole values of
    the others and the buffers; no collective."""
    sharded = set()
    for unit in units:
        with resident(unit, write_back=True):
            _read_unit_pieces(unit, read)
        sharded.update(id(p) for p in unit.params)
    for name, p in params.items():
        if id(p) not in sharded:
            value = torch.empty(p.numel())
            read(name, 0, p.numel(), value)
            p.copy_(value.view(p.shape))
    for key, value in buffers.items():
        if key in replicated:
            value.copy_(replicated[key])
        else:  # (a DCP checkpoint's)
            whole = torch.empty(value.numel(), dtype=value.dtype)
            read(key, 0, value.numel(), whole)
            value.copy_(whole.view(value.shape))


def _read_unit_pieces(unit, read) -> None:
    """This rank's pieces of ``unit`` into its master (or its frozen shard)."""
    for piece in unit.layout.pieces(unit.rank):
        if unit.trainable:
            view = unit.training.master_view(piece.partition_offset, piece.numel)
        else:
            view = unit.param_shard[piece.partition_offset : piece.partition_offset + piece.numel]
        exact = view.dtype == torch.float32 and view.device.type == "cpu"
        buffer = view if exact else torch.empty(piece.numel)
        read(unit.names[piece.param], piece.lo, piece.hi, buffer)
        if buffer is not view:
            view.copy_(buffer)


def load_optimizer(loaded: LoadedCheckpoint, index: int, optimizer: ZeroOptimizer) -> None:
    """Restores the param groups' hyper-parameters and every piece's state of optimizer ``index``."""
    saved_names = loaded.meta.optimizers[index] if index < len(loaded.meta.optimizers) else None
    if saved_names != optimizer.param_names():
        raise CheckpointError(
            f"{loaded.path}: optimizer {index} differs from the checkpoint's: param groups (by parameter name)"
            f" {optimizer.param_names()} here, {saved_names} saved"
        )
    saved_groups = loaded.lightning["optimizer_groups"][index]
    lacking = lacking_keys(saved_groups, optimizer.optimizer.defaults)
    if lacking:  # never loaded as this one's
        raise CheckpointError(
            f"{loaded.path}: optimizer {index} is a {type(optimizer.optimizer).__name__}, whose param groups have"
            f" {lacking}; the checkpoint's do not (it saved another kind of optimizer)"
        )
    for group, saved in zip(optimizer.param_groups, saved_groups):
        # hyper-parameters come back; how this run's optimizer computes (fused, foreach, ...) stays its own
        group.update({k: v for k, v in saved.items() if k not in IMPLEMENTATION_KEYS})
    problem = None
    try:
        _read_optimizer_state(loaded, optimizer)
    except Exception as error:  # noqa: BLE001 - agreed below: no rank leaves the others waiting
        problem = f"rank {_rank()}: {loaded.path}: optimizer {index}: cannot read its state: {error!s}".splitlines()[0]
    problems = [p for p in collectives.all_gather_object(problem) if p is not None]
    if problems:  # agreed, so no rank goes on to train while another has failed
        raise CheckpointError(problems[0])


def _read_optimizer_state(loaded: LoadedCheckpoint, optimizer: ZeroOptimizer) -> None:
    group_of = {id(t): g for g in optimizer.optimizer.param_groups for t in g["params"]}
    for unit in optimizer.units:
        with resident(unit, optimizer.optimizer.state, write_back=True):
            _read_unit_state(loaded, unit, optimizer, group_of)


def _read_unit_state(loaded: LoadedCheckpoint, unit, optimizer: ZeroOptimizer, group_of: dict) -> None:
    for piece, tensor in zip(unit.training.pieces, unit.training.piece_tensors):
        name = unit.names[piece.param]
        found = loaded.reader.state_of(name)
        if found is None:
            optimizer.optimizer.state.pop(tensor, None)
            continue
        scalars, elementwise = found
        # Like torch's own load_state_dict: "step" stays on the CPU unless the group is fused or capturable (and
        # NVMe's state is put on the host, its pieces being placeholders: sharding/swapped.py).
        device = torch.device("cpu") if unit.training.swap is not None else tensor.device
        on_device = group_of[id(tensor)].get("fused") or group_of[id(tensor)].get("capturable")
        state = {
            k: (v.to(device) if on_device or k != "step" else v.clone()) if torch.is_tensor(v) else v
            for k, v in scalars.items()
        }
        for key in elementwise:
            buffer = torch.empty(piece.numel)
            loaded.reader.read(name, piece.lo, piece.hi, buffer, key=key)
            state[key] = buffer.to(device)
        optimizer.optimizer.state[tensor] = state

"""A sharded checkpoint exported as a torch.distributed.checkpoint (DCP) directory that FSDP2 loads at any
world size, with the optimizer's state (``lightning-zero consolidate CKPT OUT_DIR --dcp``, or ``export_dcp``).

The layout is the DCP recipe's, what ``get_state_dict(model, optimizer)`` returns: ``{"model": model_sd,
"optim": optim_sd}``, the optimizer state keyed by parameter name (``state.<fqn>.exp_avg``, ``.step``;
``param_groups`` with ``params`` by name). An FSDP2 job loads it as it loads its own::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=OUT_DIR)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

Names are the LightningModule's; ``strip_prefix`` removes the attribute that holds the model there
(``"model."`` for ``self.model``), so they are the plain module's. One process writes every tensor whole,
as one chunk of the DCP (FSDP2 reshards chunks on load), streamed: each tensor is assembled from the
ranks' shards only when DCP's writer asks for it, so memory stays near the largest tensor. The directory is
written hidden and renamed into place once complete (publish.py).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from lightning_zero.checkpoint.consolidate import _sources
from lightning_zero.checkpoint.dcp_files import dcp_failure, one_line
from lightning_zero.checkpoint.format import CheckpointError, check_files, load_lightning_state, read_metadata
from lightning_zero.checkpoint.publish import check_new_directory, write_new_directory
from lightning_zero.checkpoint.shards import ShardReader

IMPLEMENTATION_DEFAULTS = {"fused": None, "foreach": None, "capturable": False, "differentiable": False}


class _LazySavePlanner(DefaultSavePlanner):
    """Saves stand-ins (expanded scalars: the shape and dtype, no data) whose data ``produce[key]()`` gives
    when the writer comes to them (``key``: the flattened name); other values as they are."""

    def __init__(self, produce: dict[str, Callable[[], Tensor]]) -> None:
        super().__init__()
        self.produce = produce

    def resolve_data(self, write_item: Any) -> Any:
        make = self.produce.get(write_item.index.fqn)
        if write_item.type == WriteItemType.BYTE_IO or make is None:
            return super().resolve_data(write_item)
        return make().contiguous()


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.zeros((), dtype=dtype).expand(shape)


def _optimizer(directory: Path, meta: Any, lightning: dict[str, Any], rename: Callable[[str], str]) -> tuple:
    """(optimizer state dict of stand-ins, {flattened name: produce}) of the checkpoint's one optimizer."""
    if len(meta.optimizers) > 1:
        raise CheckpointError(
            f"{directory}: holds {len(meta.optimizers)} optimizers; a DCP checkpoint for FSDP2 holds one"
            " (export the weights alone from Python: lightning_zero.export_dcp(..., optimizer=False))"
        )
    reader = ShardReader(directory, meta, keep_open=False)
    state: dict[str, dict[str, Any]] = {}
    produce: dict[str, Callable[[], Tensor]] = {}
    param_groups = []
    trainable = [n for names in meta.optimizers[0] for n in names if n in reader.location]
    kinds = next((found for n in trainable if (found := reader.state_of(n)) is not None), None)
    for names, hyper in zip(meta.optimizers[0], lightning["optimizer_groups"][0]):
        # how this run computed (fused, foreach, ...) is not the loading job's: torch's defaults
        hyper = {k: IMPLEMENTATION_DEFAULTS.get(k, v) for k, v in hyper.items() if k != "param_names"}
        param_groups.append({**hyper, "params": [rename(n) for n in names]})
        for name in (n for n in names if n in reader.location and kinds is not None):
            found = reader.state_of(name)
            unit, index = reader.location[name]
            shape = tuple(meta.units[unit].params[index].shape)
            if found is None:  # no step yet (no gradient): as torch initialises it, for FSDP2's template
                found = ({k: torch.zeros(()) if torch.is_tensor(v) else v for k, v in kinds[0].items()}, None)
            scalars, elementwise = found
            entry = state[rename(name)] = dict(scalars)
            for key in elementwise if elementwise is not None else kinds[1]:
                entry[key] = _stand_in(shape, torch.float32)  # (state over the fp32 masters)

                def read(name=name, key=key, shape=shape, stepped=elementwise is not None) -> Tensor:
                    out = torch.zeros(math.prod(shape))
                    if stepped:
                        reader.read(name, 0, out.numel(), out, key=key)
                    return out.view(shape)

                produce[f"optim.state.{rename(name)}.{key}"] = read
    return {"state": state, "param_groups": param_groups}, produce


def export_dcp(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    strip_prefix: str = "",
    optimizer: bool = True,
    weights_only: bool = True,
) -> Path:
    """Writes the sharded checkpoint ``checkpoint`` as the new DCP directory ``out_dir`` (see the module's
    docstring): the weights and, with ``optimizer`` where the checkpoint has it, the optimizer's state.
    ``weights_only=False`` unpickles the checkpoint's Lightning state without restrictions (only for one you
    trust). Bad input raises a one-line CheckpointError before anything is written.

    Use it to continue a run with FSDP2 (or torchtitan), which loads the directory at any world size as its own:
    ``get_state_dict(model, optimizer)``'s layout, ``{"model": ..., "optim": ...}``, names by parameter. One
    process writes it, streaming one tensor at a time from the ranks' shards; the directory appears only once
    complete (a failed export leaves nothing behind). The command ``lightning-zero consolidate CKPT OUT_DIR
    --dcp`` does the same.

    Args:
        checkpoint: a sharded checkpoint directory of lightning_zero (any world size and stage).
        out_dir: the DCP directory to create; it must not exist, its parent must.
        strip_prefix: removed from every name (``"model."`` for a LightningModule's ``self.model``), so that the
            names are the plain module's; every name must start with it.
        optimizer: include the optimizer's state (``"optim"``) when the checkpoint holds it; False: the weights.
        weights_only: unpickle the checkpoint's Lightning state safely (True), or without restrictions (False).

    Returns:
        ``out_dir``, as a Path.

    Raises:
        CheckpointError: ``out_dir`` exists or is a link, or its parent is missing; ``checkpoint`` is missing,
            incomplete or damaged (a file's size or checksum), holds a name that does not start with
            ``strip_prefix``, holds several optimizers (with ``optimizer``), or holds objects that safe unpickling
            refuses; DCP fails to write (then nothing is left behind).

    Example:
        ```python
        lightning_zero.export_dcp("ckpts/last.ckpt", "dcp-out", strip_prefix="model.")
        ```
    """
    directory, out_dir = Path(checkpoint), Path(out_dir)
    check_new_directory(out_dir)
    meta = read_metadata(directory)
    check_files(directory, meta, checksum=True)
    lightning = load_lightning_state(directory, weights_only=weights_only)
    outside = [k for k in meta.state_dict_keys if not k.startswith(strip_prefix)]
    if outside:
        raise CheckpointError(f"{directory}: {outside[:3]} do not start with strip_prefix {strip_prefix!r}")

    def rename(name: str) -> str:
        return name.removeprefix(strip_prefix)

    model: dict[str, Tensor] = {}
    produce: dict[str, Callable[[], Tensor]] = {}
    # the trained weights, whose the optimizer's state is (not a weight-averaging callback's average)
    for key, (_, make, shape, dtype) in _sources(directory, meta, lightning, average=False):
        model[rename(key)] = _stand_in(shape, dtype)
        produce[f"model.{rename(key)}"] = make
    state: dict[str, Any] = {"model": model}
    if optimizer and meta.optimizers and not meta.weights_only:
        state["optim"], more = _optimizer(directory, meta, lightning, rename)
        produce.update(more)

    def write(partial: Path) -> None:
        writer = dcp.FileSystemWriter(partial, single_file_per_rank=True, sync_files=True, thread_count=1)
        with warnings.catch_warnings():  # (that it saves from one process, which is what no_dist says)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.save(state, storage_writer=writer, planner=_LazySavePlanner(produce), no_dist=True)
            except CheckpointException as error:  # (a BaseException: one line instead, with its cause)
                raise CheckpointError(f"{out_dir}: cannot write it: {one_line(dcp_failure(error))}") from None

    return write_new_directory(out_dir, write)

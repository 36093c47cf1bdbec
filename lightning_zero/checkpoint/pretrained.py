"""Loading pretrained (unsharded) weights into a model wherever its parameters live.

``load_pretrained(module, source)`` accepts a state dict, a ``.safetensors`` file, a ``.pt``/``.bin``
file (loaded with ``weights_only=True`` and memory-mapped), a Hugging Face checkpoint directory
(``model.safetensors``, or sharded ``*.safetensors`` with ``model.safetensors.index.json``) or a
torch.distributed.checkpoint directory (FSDP2's or torchtitan's model; ``dcp.py``). Each parameter is
written where it lives, reading only what this rank keeps:

- inside ``configure_model`` under stage 3 (``ShardedConstruction``): this rank's slice of each
  parameter, read as a slice of the file;
- after stage-3 set-up: this rank's pieces of each unit (the unit layout's ranges of the parameter);
- anywhere else (stages 1-2, no strategy, buffers): the whole tensor, copied in.

One tensor at a time, so memory stays near the largest tensor. Names are matched exactly (a
``prefix`` is prepended to the module's names), but for a DCP checkpoint's, whose prefix is found as
``fit(ckpt_path=...)`` finds it (a LightningModule's ``self.model``). A shape that differs, and with
``strict`` a missing or unexpected name, is one error listing every missing and unexpected name and every
shape that differs, raised before anything is written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import Module

from lightning_zero.checkpoint.dcp import DcpSource
from lightning_zero.checkpoint.dcp_files import is_dcp
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.unit_index import UnitIndex


class _Source:
    """Names, shapes and flat element ranges of the tensors of a state dict, file or directory."""

    def __init__(self, source: Mapping[str, Tensor] | str | os.PathLike, names: list[str]) -> None:
        """``names``: the module's (prefixed) names, to find a DCP checkpoint's model by."""
        self.tensors: dict[str, Tensor] = {}
        self.files: dict[str, Path] = {}  # name -> safetensors file
        self.saved: dict[str, str] = {}  # name -> key in a DCP checkpoint
        if isinstance(source, Mapping):
            self.tensors = dict(source)
            return
        path = Path(source)
        if is_dcp(path):  # its model and the prefix, found as fit(ckpt_path=...) finds them (dcp.py)
            self.dcp = DcpSource(path)
            self.saved = self.dcp.model_section(names)[0]
            return
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {name: path / file for name, file in weight_map.items()}
            elif (path / "model.safetensors").exists():
                path = path / "model.safetensors"
            elif (path / "pytorch_model.bin").exists():
                path = path / "pytorch_model.bin"
            else:
                raise FileNotFoundError(
                    f"{source}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
                )
        if path.is_file() and path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(path, "pt") as f:
                self.files = dict.fromkeys(f.keys(), path)
        elif path.is_file():
            self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        elif not self.files:
            raise FileNotFoundError(f"{source}: no such file or directory")
        self._open: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self.tensors) + list(self.files) + list(self.saved)

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, "pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.saved:
            return self.dcp.shape(self.saved[name])
        return tuple(self.tensors[name].shape) if name in self.tensors else tuple(self._slice(name).get_shape())

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        """Elements [lo, hi) of the flattened tensor ``name``, reading no more than the rows they span."""
        if name in self.tensors:
            return self.tensors[name].reshape(-1)[lo:hi]
        if name in self.saved:
            out = torch.empty(hi - lo, dtype=self.dcp.tensors[self.saved[name]].properties.dtype)
            self.dcp.read(self.saved[name], lo, hi, out)
            return out
        piece = self._slice(name)
        shape = piece.get_shape()
        if len(shape) == 0:
            return piece[...].reshape(-1)[lo:hi]
        row = math.prod(shape[1:])
        first, last = lo // row, -(-hi // row)
        return piece[first:last].reshape(-1)[lo - first * row : hi - first * row]


def load_pretrained(
    module: Module, source: Mapping[str, Tensor] | str | os.PathLike, *, strict: bool = True, prefix: str = ""
) -> None:
    """Loads pretrained (unsharded) weights into ``module``'s parameters and persistent buffers, wherever they live,
    reading only what this rank keeps, one tensor at a time (memory stays near the largest tensor):

    - inside ``configure_model`` (or ``fabric.init_module()``) under stage 3: this rank's slice of each parameter,
      read as a slice of the file;
    - after stage-3 set-up: this rank's pieces of each unit;
    - anywhere else (stages 1-2, no strategy, buffers): the whole tensor, copied in.

    Call it on every rank (under stage 3 it is part of the collective construction or set-up). Names are matched
    exactly (``prefix`` prepended to the module's), but for a DCP checkpoint's, whose prefix is found as
    ``fit(ckpt_path=...)`` finds it. A shape that differs (and, with ``strict``, a missing or unexpected name) is
    one error listing every missing and unexpected name and every shape that differs, raised before anything is
    written.

    Args:
        module: the model (or a submodule, such as a LightningModule's ``self.model``) to load into.
        source: a state dict; a ``.safetensors`` file; a ``.pt``/``.bin`` file (loaded with ``weights_only=True``,
            memory-mapped); a Hugging Face checkpoint directory (``model.safetensors``, sharded ``*.safetensors``
            with ``model.safetensors.index.json``, or ``pytorch_model.bin``); or a torch.distributed.checkpoint
            directory (FSDP2's or torchtitan's model).
        strict: whether names of the module missing from ``source``, or names of ``source`` not in the module,
            are an error (shapes that differ always are); False loads the names they share.
        prefix: prepended to the module's names to find them in ``source`` (``"model."`` when ``source`` names
            the parameters of the LightningModule that holds ``module`` as ``self.model``).

    Raises:
        ValueError: a shape differs, or (with ``strict``) a name is missing or unexpected.
        FileNotFoundError: ``source`` is no file or directory, or a directory without the files above.
        CheckpointError: a DCP directory that cannot be read (its metadata or a tensor's data), or in which several
            sections hold the module's names equally well.
        pickle.UnpicklingError: a ``.pt``/``.bin`` file holding objects that ``weights_only=True`` refuses.

    Example:
        ```python
        def configure_model(self):  # a LightningModule under zero3: each rank reads its slices
            self.model = GPT(self.cfg)
            lightning_zero.load_pretrained(self.model, "path/to/checkpoint")
        ```
    """
    entries = module.state_dict(keep_vars=True)
    reader = _Source(source, [prefix + k for k in entries])
    names_of: dict[int, list[str]] = {}
    for key, value in entries.items():
        names_of.setdefault(id(value), []).append(key)
    available = set(reader.names())
    targets, missing, shapes = [], [], []
    for keys in names_of.values():
        found = next((prefix + k for k in keys if prefix + k in available), None)
        tensor = entries[keys[0]]
        if found is None:
            missing.append(keys[0])
        elif reader.shape(found) != tuple(tensor.shape):
            shapes.append(f"{found}: source {reader.shape(found)}, model {tuple(tensor.shape)}")
        else:
            targets.append((found, tensor))
    used = {prefix + k for keys in names_of.values() for k in keys}
    unexpected = sorted(n for n in available if n not in used)
    if shapes or (strict and (missing or unexpected)):
        raise ValueError(
            f"{source if not isinstance(source, Mapping) else 'the state dict'} does not match the model: missing"
            f" {sorted(missing)}; unexpected {unexpected}; shapes differ {shapes}"
        )
    construction = ShardedConstruction.active
    unit_location = UnitIndex.of(module)
    with torch.no_grad():
        for name, tensor in targets:
            located = unit_location(tensor)
            if construction is not None and construction.owns(tensor):
                construction.write(tensor, lambda lo, hi, name=name: reader.read(name, lo, hi))
            elif located is not None and not located[0].gathered:
                unit, index = located
                unit.write_owned_from(index, lambda lo, hi, name=name: reader.read(name, lo, hi))
            else:
                value = reader.read(name, 0, tensor.numel()).view(tensor.shape)
                if located is not None:
                    located[0].write_owned(located[1], value)
                tensor.copy_(value)

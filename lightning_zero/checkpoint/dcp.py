"""Migration in from torch.distributed.checkpoint (DCP): a checkpoint directory that FSDP2, torchtitan or
any ``dcp.save`` wrote, resumed under a ZeRO strategy at any stage and world size
(``trainer.fit(model, ckpt_path=dcp_dir)``, Fabric's ``load``) or loaded as pretrained weights
(``load_pretrained(module, dcp_dir)``).

A DCP directory holds ``.metadata`` (every tensor's global shape and dtype and the chunks the saving ranks
wrote, each a torch.save'd tensor in a ``.distcp`` file) and flattens the saved state dict's nesting into
paths (``metadata.planner_data``). The layouts read here, found from those paths:

- the module's state dict under any section: ``{"model": model_sd}`` (the DCP recipe), ``{"app": {"model":
  ...}}``, or at the top level (torchtitan); the section whose names best match the module's is the model;
- optimizer state as ``get_optimizer_state_dict`` returns it, nested (``optim.state.<fqn>.exp_avg``,
  ``optim.param_groups.<i>.lr``) or flattened (torchtitan: ``optimizer.state.<fqn>.exp_avg``,
  ``optimizer.param_groups.<fqn>.lr``).

The module's names may differ from the saved ones by a prefix (a LightningModule holding the model as
``self.model``: ``model.layers.0.weight`` here, ``layers.0.weight`` there): the prefix that matches the
most names is used, by ``fit`` and ``load_pretrained`` alike (``DcpSource.model_section``), and said (rank 0's
log). Each rank reads only the rows that hold its pieces of each tensor (DCP reshards the
saved chunks into them) with its own ``dcp.load(..., no_dist=True)``: no collective. Files are data
(``dcp_files.py``): ``.metadata`` is unpickled allowing only DCP's own metadata classes and checked against the
files, non-tensor values with ``weights_only=True``, and a read that fails names the file and the tensor.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_zero.checkpoint.dcp_files import DcpStorage, SlicePlanner, dcp_failure, one_line, read_dcp_metadata
from lightning_zero.checkpoint.format import CheckpointError, Metadata


def _path(metadata: Any, key: str) -> tuple:
    return tuple((metadata.planner_data or {}).get(key) or key.split("."))


class DcpSource:
    """Names, shapes and element ranges of a DCP checkpoint's tensors (by their saved keys)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata = read_dcp_metadata(path)
        self.tensors = {
            k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }

    def shape(self, key: str) -> tuple[int, ...]:
        """The saved shape of the tensor ``key``."""
        return tuple(self.tensors[key].size)

    def load(self, wanted: dict[str, Any], offsets: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
        """Fills ``wanted`` (saved key -> tensor to fill, or None for a non-tensor value) from the files, the
        tensors at ``offsets`` when given (else whole); returns it."""
        try:
            with warnings.catch_warnings():  # (that it loads in one process, which is what no_dist says)
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(wanted, storage_reader=DcpStorage(self.path, self.metadata),
                         planner=SlicePlanner(offsets or {}), no_dist=True)  # fmt: skip
        except (CheckpointException, Exception) as error:  # (DCP's CheckpointException is a BaseException)
            cause = dcp_failure(error)
            if isinstance(cause, CheckpointError):  # (DcpStorage's, naming the file and the tensor)
                raise cause from None
            raise CheckpointError(f"{self.path}: cannot read {sorted(wanted)[:3]}: {one_line(cause)}") from None
        return wanted

    def read(self, key: str, lo: int, hi: int, out: Tensor) -> None:
        """Elements [lo, hi) of the flattened tensor ``key`` into ``out``, reading only the rows they span."""
        shape, dtype = self.shape(key), self.tensors[key].properties.dtype
        if hi <= lo:
            return
        if len(shape) == 0:
            out.copy_(self.load({key: torch.empty((), dtype=dtype)})[key].reshape(-1)[lo:hi])
            return
        row = math.prod(shape[1:])
        first, last = lo // row, -(-hi // row)
        rows = torch.empty((last - first, *shape[1:]), dtype=dtype)
        self.load({key: rows}, {key: (first, *[0] * (len(shape) - 1))})
        out.copy_(rows.reshape(-1)[lo - first * row : hi - first * row])

    def model_section(self, names: list[str]) -> tuple[dict[str, str], tuple[str, str]]:
        """The saved model, by the module's names: module name -> saved key for the section whose names, up to a
        prefix, match the most of ``names`` (the module's state-dict keys; see the module's docstring), and that
        prefix as (here, there), which is logged when there is one."""
        wanted = set(names)
        sections: dict[tuple, dict[str, str]] = {}
        for key in self.tensors:
            path = _path(self.metadata, key)
            if _optimizer_entry(path) is None:
                sections.setdefault(path[:-1], {})[str(path[-1])] = key
        scored: dict[tuple, tuple[int, tuple[str, str]]] = {}  # section -> (names matched, prefixes)
        for section, saved in sections.items():
            for prefixes in _prefixes(names, saved):
                score = sum(_renamed(f, prefixes) in wanted for f in saved) if wanted else len(saved)
                if score > scored.get(section, (-1,))[0]:
                    scored[section] = (score, prefixes)
        if not scored:
            return {}, ("", "")
        top = max(score for score, _ in scored.values())
        tied = [s for s, (score, _) in scored.items() if score == top]
        if len(tied) > 1:  # (an EMA beside the model, say): the one named model, else the question is the user's
            tied = [s for s in tied if s in ((), ("model",))] or tied
        if len(tied) > 1:
            raise CheckpointError(
                f"{self.path}: {len(tied)} sections hold these weights equally well: {['.'.join(s) for s in tied]}"
                " (the model is taken from a section named 'model' or from the top level)"
            )
        section, prefixes = tied[0], scored[tied[0]][1]
        _say_prefix(self.path, section, prefixes, list(sections[section]))
        return {_renamed(f, prefixes): key for f, key in sections[section].items()}, prefixes


def _say_prefix(path: Path, section: tuple, prefixes: tuple[str, str], saved_names: list[str]) -> None:
    """Logs (rank 0) the prefix that relates the module's names to the saved ones, when there is one, with an
    example: which was used is not left to guess (fit and load_pretrained alike)."""
    here, there = prefixes
    if not (here or there) or not saved_names:
        return
    change = f"{here!r} added" if not there else f"{there!r} removed" if not here else f"{there!r} replaced by {here!r}"
    where = f"section {'.'.join(map(str, section))!r}" if section else "the top level"
    example = f"{saved_names[0]} is {_renamed(saved_names[0], prefixes)} here"
    said = f"the module's names are the saved ones (in {where}) with the prefix {change}: {example}"
    rank_zero_info(f"lightning_zero: {path}: {said}")


def _renamed(saved_name: str, prefixes: tuple[str, str]) -> str:
    """A saved name as the module's, given the (here, there) prefixes."""
    here, there = prefixes
    return here + saved_name[len(there) :] if saved_name.startswith(there) else saved_name


def _prefixes(names: list[str], saved: dict[str, str]) -> list[tuple[str, str]]:
    """(prefix here, prefix there) pairs relating the module's names to saved ones; identity first."""
    pairs = [("", "")]
    for name in names[:8]:
        parts = name.split(".")
        pairs += [(".".join(parts[:i]) + ".", "") for i in range(1, len(parts)) if ".".join(parts[i:]) in saved]
        pairs += [("", f[: -len(name)]) for f in saved if f.endswith("." + name)]
    return sorted(set(pairs), key=lambda p: (p != ("", ""), len(p[0]) + len(p[1])))


def _optimizer_entry(path: tuple) -> tuple[tuple, str, str, str] | None:
    """(section, "state" or "param_groups", parameter or group, key) for an optimizer entry's path, else None:
    nested (``(..., "state", fqn, key)``, ``(..., "param_groups", i, key)``) or flattened by torch's
    ``flatten_optimizer_state_dict`` (``(..., "state.<fqn>.<key>")``)."""
    if len(path) >= 3 and path[-3] in ("state", "param_groups"):
        return path[:-3], path[-3], str(path[-2]), str(path[-1])
    last = str(path[-1])
    for kind in ("state", "param_groups"):
        if last.startswith(kind + ".") and last.count(".") >= 2:
            fqn, key = last[len(kind) + 1 :].rsplit(".", 1)
            return path[:-1], kind, fqn, key
    return None


class DcpReader:
    """The reader interface of ``ShardReader`` over a DCP checkpoint: each tensor by the module's name."""

    def __init__(self, source: DcpSource, keys: dict[str, str], state: dict[str, dict], scalars: dict) -> None:
        self.source = source
        self.keys = keys  # module name -> saved key
        self.state = state  # module name -> {optimizer state key -> saved key}
        self.scalars = scalars  # module name -> {optimizer state key -> value} of its non-elementwise state
        self.shapes = {name: source.shape(key) for name, key in keys.items()}

    def read(self, name: str, lo: int, hi: int, out: Tensor, key: str | None = None, *, averaged: bool = False) -> None:
        """Copies elements [lo, hi) of ``name``'s flattened tensor, or with ``key`` of that optimizer state of it,
        into ``out``; ``averaged`` is ignored (the signature is ``ShardReader.read``'s)."""
        self.source.read(self.keys[name] if key is None else self.state[name][key], lo, hi, out)

    def state_of(self, name: str) -> tuple[dict[str, Any], list[str]] | None:
        """The saved non-elementwise optimizer state of ``name`` and its elementwise keys, or None if it has none."""
        if name not in self.state:
            return None
        scalars = self.scalars.get(name, {})
        return dict(scalars), [k for k in self.state[name] if k not in scalars]


def _optimizer(source: DcpSource, prefixes: tuple[str, str], shapes: dict[str, tuple]) -> tuple[dict, dict, Any]:
    """The saved optimizer state of the parameters in ``shapes`` (name -> shape): {name: {key: saved key}} of its
    elementwise state, {name: {key: value}} of the rest, and its param groups: [{hyper-parameter: value,
    "params": [names]}] when saved nested, {name: {hyper-parameter: value}} when flattened; or ({}, {}, [])."""
    sections: dict[tuple, list] = {}
    for key in source.metadata.state_dict_metadata:
        entry = _optimizer_entry(_path(source.metadata, key))
        if entry is not None:
            sections.setdefault(entry[0], []).append((*entry[1:], key))
    overlap = {s: sum(_renamed(e[1], prefixes) in shapes for e in es if e[0] == "state") for s, es in sections.items()}
    if not overlap or max(overlap.values()) == 0:
        return {}, {}, []
    entries = sections[max(overlap, key=overlap.get)]
    elementwise: dict[str, dict[str, str]] = {}
    small: dict[str, Any] = {}  # what is read whole: scalars, non-tensor values, the param groups
    for kind, owner, key, saved in entries:
        name = _renamed(owner, prefixes)
        scalar = saved in source.tensors and source.shape(saved) == () and (shapes.get(name) != () or key == "step")
        if kind == "state" and name in shapes and saved in source.tensors and not scalar:
            if source.shape(saved) != shapes[name]:  # (factored state, Adafactor's say: not cut as the weights are)
                raise CheckpointError(
                    f"{source.path}: optimizer state {saved} has shape {list(source.shape(saved))}, neither a scalar"
                    f" nor its parameter's {list(shapes[name])}: this optimizer's state cannot be resharded here"
                )
            elementwise.setdefault(name, {})[key] = saved
        elif kind == "param_groups" or name in shapes:
            dtype = source.tensors[saved].properties.dtype if saved in source.tensors else None
            small[saved] = torch.empty((), dtype=dtype) if dtype is not None else None
    values = source.load(small) if small else {}
    scalars: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}  # group index (nested) or parameter name (flattened) -> hyper-parameters
    for kind, owner, key, saved in entries:
        name = _renamed(owner, prefixes)
        if kind == "state" and saved in values:
            scalars.setdefault(name, {})[key] = values[saved]
        elif kind == "param_groups":
            groups.setdefault(owner if owner.isdigit() else name, {})[key] = values[saved]
    state = {name: {**dict.fromkeys(scalars.get(name, {})), **keys} for name, keys in elementwise.items()}
    state.update({name: dict.fromkeys(values) for name, values in scalars.items() if name not in state})
    if groups and all(owner.isdigit() for owner in groups):
        nested = [groups[i] for i in sorted(groups, key=int)]
        for group in nested:
            group["params"] = [_renamed(str(f), prefixes) for f in group.get("params", [])]
        return state, scalars, nested
    return state, scalars, groups


def _matched_groups(path: Path, here: list[list[list[str]]], saved: Any) -> list[list[dict]]:
    """The saved param groups' hyper-parameters for this run's one optimizer, checked to hold its groups: nested
    groups as the same sets of parameters, flattened ones (per parameter) alike within each group here."""
    if len(here) != 1:
        raise CheckpointError(
            f"{path}: holds the state of one optimizer, as FSDP2 and torchtitan save it; this module configures"
            f" {len(here)} optimizers (load its weights with load_pretrained(module, path) instead)"
        )
    mine = [sorted(group) for group in here[0]]
    if isinstance(saved, list):
        theirs = [sorted(group["params"]) for group in saved]
    else:  # flattened: a group here is matched if each of its parameters has the same hyper-parameters saved
        alike = [all(saved.get(n) == saved.get(g[0]) is not None for n in g) for g in mine]
        theirs = [g if ok else [*g, "(hyper-parameters missing or unlike)"] for g, ok in zip(mine, alike)]
        saved = [{**(saved[g[0]] if g else {}), "params": g} for g in mine]  # (every group here, empty ones too)
    if mine != theirs:
        raise CheckpointError(
            f"{path}: its optimizer's param groups differ from this run's (by parameter name): {mine} here,"
            f" {theirs} saved"
        )
    return [[{k: v for k, v in group.items() if k not in ("params", "param_names")} for group in saved]]


def read_dcp(
    path: Path, *, model_names: list[str], optimizer_names: list[list[list[str]]]
) -> tuple[Metadata, dict[str, Any], DcpReader]:
    """A DCP checkpoint as metadata (every tensor replicated, no shards), a Lightning state and a reader:
    the weights under ``model_names`` (the module's state-dict keys) and, when it holds optimizer state for
    them, that state for this run's one optimizer (``optimizer_names``: its param groups by name)."""
    source = DcpSource(path)
    keys, prefixes = source.model_section(model_names)
    state, scalars, param_groups = _optimizer(source, prefixes, {n: source.shape(k) for n, k in keys.items()})
    lightning_state: dict[str, Any] = {
        "state_dict": {},
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": lightning.__version__,
        "optimizer_groups": [],
    }
    matched: list[list[list[str]]] = []
    if state and optimizer_names:
        lightning_state["optimizer_groups"] = _matched_groups(path, optimizer_names, param_groups)
        lightning_state.update(optimizer_states=[{}], lr_schedulers=[])  # restored by the strategy, not Lightning
        matched = optimizer_names[:1]
    meta = Metadata(
        stage=0,  # not sharded as ours are: every tensor is read by range
        world_size=1,
        global_step=0,
        epoch=0,
        units=[],
        optimizers=matched,
        state_dict_keys=list(keys),
        weights_only=not state,
    )
    return meta, lightning_state, DcpReader(source, keys, state, scalars)

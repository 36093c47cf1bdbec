"""Migration in: resuming under a ZeRO strategy from a plain Lightning checkpoint file, as ``ddp`` or
single-device training writes it (``trainer.fit(model, ckpt_path="epoch=3.ckpt")``).

The file holds the whole ``state_dict`` and, per optimizer, torch's ``state_dict()`` (state keyed by
the parameter's index across its param groups). It is memory-mapped and unpickled with
``weights_only=True`` unless the user says the file is trusted; each rank then copies only its own
slices out of it (``io.load_model`` reads it like a checkpoint whose every tensor is replicated).
Optimizer state is matched to parameters by position, as torch itself does, so it is restored only
when the param groups have the sizes they had when saved; loops, schedulers and callbacks are
Lightning's own keys and are restored by Lightning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.format import AVERAGED, CURRENT, CheckpointError, Metadata, load_torch_file


class PlainReader:
    """The reader interface of ``ShardReader`` over whole tensors: a state dict and optimizer state by name."""

    def __init__(self, state_dict: dict[str, Tensor], optimizer_state: dict[str, dict[str, Any]]) -> None:
        self.state_dict = state_dict
        self.optimizer_state = optimizer_state  # parameter name -> torch's per-parameter state

    def _elementwise(self, name: str) -> list[str]:
        numel = self.state_dict[name].numel()
        state = self.optimizer_state[name]
        return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel]

    def read(self, name: str, lo: int, hi: int, out: Tensor, key: str | None = None) -> None:
        """Copies elements [lo, hi) of the flattened parameter ``name``, or with ``key`` of that optimizer state of
        it, into ``out``."""
        source = self.state_dict[name] if key is None else self.optimizer_state[name][key]
        out.copy_(source.reshape(-1)[lo:hi])

    def state_of(self, name: str) -> tuple[dict[str, Any], list[str]] | None:
        """The saved optimizer state of ``name`` that is not elementwise, and its elementwise keys (tensors of the
        parameter's size), or None if it has none."""
        if name not in self.optimizer_state:
            return None
        elementwise = self._elementwise(name)
        return {k: v for k, v in self.optimizer_state[name].items() if k not in elementwise}, elementwise


def _load(path: Path, weights_only: bool) -> dict[str, Any]:
    checkpoint = load_torch_file(path, weights_only=weights_only)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no state_dict)")
    return checkpoint


def _optimizer_state(path: Path, index: int, saved: Any, names: list[list[str]]) -> dict[str, dict[str, Any]]:
    """Torch's optimizer state dict, keyed by parameter name: by the names the groups carry when they do
    (``param_names``, e.g. a converted DeepSpeed checkpoint), else by position, as torch matches them."""
    sizes_here = [len(group) for group in names]
    try:
        sizes_saved = [len(group["params"]) for group in saved["param_groups"]]
        state = saved["state"]
    except (TypeError, KeyError):
        raise CheckpointError(f"{path}: optimizer {index}'s state is not a torch optimizer state_dict") from None
    if all("param_names" in group for group in saved["param_groups"]) and len(sizes_saved) == len(sizes_here):
        index_to_name = {i: n for g in saved["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        here = {n for group in names for n in group}
        unknown = sorted(index_to_name[i] for i in state if index_to_name.get(i) not in here)
        if unknown:
            raise CheckpointError(f"{path}: optimizer {index} has state for {unknown[:5]}, not in its groups here")
        return {index_to_name[i]: s for i, s in state.items()}
    if sizes_saved != sizes_here:
        raise CheckpointError(
            f"{path}: optimizer {index} has param groups of {sizes_here} parameters here and {sizes_saved} in the"
            " checkpoint, so its state cannot be matched to parameters"
        )
    by_index = [i for group in saved["param_groups"] for i in group["params"]]
    flat_names = [n for group in names for n in group]
    return {flat_names[by_index.index(i)]: s for i, s in state.items() if i in by_index}


def read_plain(
    path: Path, *, optimizer_names: list[list[list[str]]], weights_only: bool
) -> tuple[Metadata, dict[str, Any], PlainReader]:
    """A plain Lightning checkpoint as metadata (every tensor replicated, no shards), Lightning's state and
    a reader. ``optimizer_names``: each ZeRO optimizer's param groups by parameter name, as given."""
    checkpoint = _load(path, weights_only)
    saved_optimizers = checkpoint.get("optimizer_states") or []
    by_name: dict[str, dict[str, Any]] = {}
    matched = []
    for index, (saved, names) in enumerate(zip(saved_optimizers, optimizer_names)):
        by_name.update(_optimizer_state(path, index, saved, names))
        matched.append(names)
    lightning = dict(checkpoint)
    if CURRENT in checkpoint:  # WeightAveraging's: the model's own weights, and the average as "state_dict"
        lightning["state_dict"], lightning[AVERAGED] = lightning.pop(CURRENT), checkpoint["state_dict"]
    lightning["optimizer_groups"] = [
        [{k: v for k, v in group.items() if k != "params"} for group in saved["param_groups"]]
        for saved in saved_optimizers[: len(matched)]
    ]
    meta = Metadata(
        stage=0,  # not sharded
        world_size=1,
        global_step=int(checkpoint.get("global_step", 0)),
        epoch=int(checkpoint.get("epoch", 0)),
        units=[],
        optimizers=matched,
        state_dict_keys=list(lightning["state_dict"]),
        weights_only="optimizer_states" not in checkpoint,
    )
    return meta, lightning, PlainReader(lightning["state_dict"], by_name)

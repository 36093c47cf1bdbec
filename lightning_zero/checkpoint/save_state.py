"""What a save needs (``SaveSpec``) and what rank 0 takes from it in the training thread: Lightning's state with the
parameters and buffers that are not sharded, and the metadata (save.py's [Note: a save as a job])."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.nn import Module

from lightning_zero.checkpoint import hugging_face
from lightning_zero.checkpoint.format import AVERAGED, AVERAGED_IN_SHARDS, Metadata, ParamEntry, UnitEntry
from lightning_zero.sharding.averaging import WeightAverage
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.topology import Topology
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveSpec:
    """What one save writes besides the front door's own state, and which ranks write it (``ZeroEngine.save``
    fills it in from the engine)."""

    model: Module
    """The module whose state dict the checkpoint holds (its parameters not in ``units`` go whole into
    Lightning's state)."""
    units: Sequence[FlatUnit]
    """The module's flat units: each writing rank saves its partition of each."""
    optimizers: Sequence[ZeroOptimizer]
    """The ZeRO optimizers whose state is saved with the weights (written only where the front door's state has
    ``optimizer_states``: else the checkpoint holds the weights alone)."""
    stage: int
    """The ZeRO stage, recorded in the metadata."""
    rank: int
    """This process's global rank; rank 0 coordinates and writes the directory's other files."""
    topology: Topology = field(default_factory=lambda: Topology(shard_rank=0, shard_size=1))
    """Which ranks hold the partitions: this rank is ``shard_rank`` of ``shard_size``; with hybrid sharding only
    the first shard group writes (``writes_checkpoint_shards``: the others hold replicas of the same)."""
    consolidated: bool = False
    """Rank 0 also writes the whole model's fp32 weights into it as a Lightning checkpoint, from the shard files
    (format.py)."""
    average: WeightAverage | None = None
    """A weight-averaging callback's average, saved beside the weights (format.py)."""


def lightning_state(checkpoint: dict[str, Any], spec: SaveSpec) -> dict[str, Any]:
    """Lightning's own state (``checkpoint``, the front door's), with the parameters and buffers that are not sharded
    (and their average), the optimizers' hyper-parameters and the Hugging Face description; by reference."""
    sharded = {id(p) for u in spec.units for p in u.params}
    lightning = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    if spec.average is not None:
        lightning[AVERAGED] = {k: v.detach().cpu() for k, v in spec.average.whole().items()}
        lightning[AVERAGED_IN_SHARDS] = {"exported": spec.average.exported}
    lightning["state_dict"] = {
        k: v.detach() for k, v in spec.model.state_dict(keep_vars=True).items() if id(v) not in sharded
    }
    lightning["optimizer_groups"] = [
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in spec.optimizers
    ]
    lightning.update(hugging_face.describe(spec.model))  # see [Note: the Hugging Face description in a checkpoint]
    return lightning


def metadata(checkpoint: dict[str, Any], spec: SaveSpec, *, weights_only: bool) -> Metadata:
    """The checkpoint's metadata (format.py), its files not yet listed."""
    entries = spec.model.state_dict(keep_vars=True)
    keys: dict[int, list[str]] = {}  # tied parameters: every key that holds them
    for key, value in entries.items():
        keys.setdefault(id(value), []).append(key)
    return Metadata(
        stage=spec.stage,
        world_size=spec.topology.shard_size,
        global_step=int(checkpoint.get("global_step", 0)),
        epoch=int(checkpoint.get("epoch", 0)),
        units=[
            UnitEntry(
                [
                    ParamEntry(n, keys[id(p)], list(p.shape), str(p.dtype).removeprefix("torch."))
                    for n, p in zip(u.names, u.params)
                ],
                u.layout.bucket_bounds(),
            )
            for u in spec.units
        ],
        optimizers=[opt.param_names() for opt in spec.optimizers],
        state_dict_keys=list(entries),
        weights_only=weights_only,
        files={},
    )

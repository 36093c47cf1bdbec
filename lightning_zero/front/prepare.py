"""What every front door does to a model before the engine takes it: checks it, casts it for the precision,
places it, and makes every rank start from rank 0's values (the engine then shards it at stage 3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_module_states as torch_sync_module_states
from torch.nn import Module

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.stage3_setup import ShardedModule


def config_for(config: ZeroConfig | None, stage: int | None) -> ZeroConfig:
    """A front door's configuration: ``config`` (``ZeroConfig()`` by default) with ``stage`` if given."""
    config = config if config is not None else ZeroConfig()
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a ZeroConfig, got {type(config).__name__}")
    return config if stage is None else dataclasses.replace(config, stage=stage)


def apply_layer_sync(layer_sync: Any, model: Module, device: torch.device) -> Module:
    """``Trainer(sync_batchnorm=True)``: torch's SyncBatchNorm, which runs on CUDA only (ddp fails at the first
    forward on the CPU; here the set-up refuses it)."""
    if device.type == "cpu":
        raise ValueError(
            "sync_batchnorm=True: torch's SyncBatchNorm runs on CUDA only, and this run is on the CPU;"
            " remove it (BatchNorm's running statistics are still rank 0's before every step and before"
            " validation: ZeroConfig(broadcast_buffers=True), as ddp's default)"
        )
    return layer_sync.apply(model)


def place_module(
    module: Module,
    precision: Any,
    *,
    stage: int,
    device: torch.device,
    construction: ShardedConstruction | None,
) -> tuple[Module, ShardedConstruction | None]:
    """Returns ``module`` cast by ``precision`` (``convert_module``/``convert_buffers``, Lightning's and
    Fabric's plugins alike) and on ``device``, every rank holding rank 0's values (collective), and the
    construction it was built sharded in, if one built it (stage 3: its parameters are cast as they are made
    whole, so only its buffers are cast here). A module on the meta device or sharded by an earlier stage-3
    run is left where it is: stage 3 materializes or keeps its shards."""
    construction = construction if construction is not None and construction.managed else None
    sharded = ShardedModule.of(module) is not None
    on_meta = any(p.is_meta for p in module.parameters())
    if (on_meta or sharded) and stage != 3:
        what = (
            "parameters on the meta device, which only stage 3 can materialize"
            if on_meta
            else "parameters sharded by an earlier zero3 run (call trainer.strategy.gather_module() after it)"
        )
        raise ValueError(f"the model has {what}; zero.stage is {stage}")
    if construction is not None:
        precision.convert_buffers(module)
    elif not sharded:
        module = precision.convert_module(module)
    if not on_meta and not sharded:
        if construction is None:
            module.to(device)
        # every rank starts from rank 0's parameters and buffers (constructed ones agree already)
        skip = [n for n, p in module.named_parameters() if construction is not None and construction.owns(p)]
        torch_sync_module_states(module, _get_default_group(), 250 * 1024 * 1024, 0, skip)
    return module, construction


def check_not_shared(module: Module, set_up: Sequence[Module]) -> None:
    """Each model set up has an engine of its own, which shards and steps its parameters (see [Note: several
    models] in fabric.py): a parameter of a model set up before (tied weights, a submodule, the same model again)
    would be sharded and stepped twice, so it is refused."""
    taken = {id(p) for model in set_up for p in model.parameters()}
    shared = [name for name, p in module.named_parameters() if id(p) in taken]
    if shared:
        raise ValueError(
            f"parameters of this model belong to a model set up before ({', '.join(shared[:3])}"
            f"{', ...' if len(shared) > 3 else ''}): each model set up gets an engine of its own, which shards and"
            " steps its parameters; set up models that share parameters as one nn.Module"
        )


def construction_of(module: Module, constructions: Sequence[ShardedConstruction]) -> ShardedConstruction | None:
    """The stage-3 ``init_module`` context that built ``module`` (None: none did); several models may be built in
    one, or one each, before they are set up."""
    builders = [c for c in constructions if any(c.owns(p) for p in module.parameters())]
    if len(builders) > 1:
        raise ValueError(
            "this model's parameters were built in several fabric.init_module() blocks: build each model in one"
        )
    return builders[0] if builders else None

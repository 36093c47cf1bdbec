"""Stage 3's start for the engine: the module sharded into units (or its shards kept from an earlier run), and the
runtime that gathers them while in use."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.backward_end import BackwardEnd
from lightning_zero.sharding.construct import ShardedConstruction
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.stage3 import Stage3Runtime
from lightning_zero.sharding.stage3_setup import ShardedModule, default_init, initialize_sharded, shard_module
from lightning_zero.sharding.step_state import StepState
from lightning_zero.sharding.topology import Topology


def shard_or_reuse(
    module: Module,
    config: ZeroConfig,
    topology: Topology,
    device: torch.device,
    *,
    training: bool,
    dtype: torch.dtype | None,
    construction: ShardedConstruction | None,
    optimizers: Sequence[Optimizer],
) -> tuple[ShardedModule, int | None]:
    """``module`` sharded over ``topology``'s shard group (see ``ZeroEngine.shard``), and the peak bytes building it
    took where it was built or initialized sharded now (else None)."""
    sharded = ShardedModule.of(module)
    rank, size = topology.shard_rank, topology.shard_size
    if sharded is not None:  # trained, then evaluated (or trained again): keep the shards
        sharded.check(world_size=size, rank=rank)
        if training:
            for unit in sharded.units:
                if unit.requires_grad:
                    unit.make_trainable(**config.unit_options(unit.param_dtype))
        return sharded, None
    on_meta = any(p.is_meta for p in module.parameters())
    holder = {id(p): k for k, o in enumerate(optimizers) for g in o.param_groups for p in g["params"]}
    sharded = shard_module(
        module,
        config,
        rank=rank,
        world_size=size,
        device=device,
        dtype=dtype,
        construction=construction,
        holder=holder if training else None,
    )
    peak = construction.peak_bytes if construction is not None else None
    if on_meta:
        init = getattr(module, "init_module", default_init)
        peak = initialize_sharded(module, sharded.units, init, device=device)
        module.to(device)
    return sharded, peak


def start_runtime(
    module: Module,
    sharded: ShardedModule,
    config: ZeroConfig,
    topology: Topology,
    *,
    step: StepState,
    reducer: GradReducer | None,
    backward_end: BackwardEnd,
    rank: int,
) -> Stage3Runtime:
    """The runtime of ``sharded``'s units, its hooks installed on ``module``."""
    runtime = Stage3Runtime(
        sharded.units,
        sharded.modules,
        max_live_parameters=config.max_live_parameters,
        prefetch_bucket_size=config.prefetch_bucket_size,
        param_persistence_threshold=config.param_persistence_threshold,
        backward_end=backward_end,
        step=step,
        reducer=reducer,
        group=topology.shard_group,
        quantize_block=config.quantization_block_size if config.quantized_weights else None,
        node=_secondary_partition(config, topology, rank),
    )
    runtime.install_access_hooks(module)
    return runtime


def _secondary_partition(config: ZeroConfig, topology: Topology, rank: int) -> tuple[int, int, Any] | None:
    """hpZ's (node rank, node size, node group) when asked for and there is more than one node."""
    if not config.secondary_partition:
        return None
    if topology.cross_group is None:  # one node: the backward's gathers stay in it anyway
        if rank == 0:
            warnings.warn(
                "zero.secondary_partition: the run has one node (zero.node_size = the world size), so every"
                " gather stays inside it already; the secondary partition is off",
                stacklevel=2,
            )
        return None
    return topology.node_rank, topology.node_size, topology.node_group

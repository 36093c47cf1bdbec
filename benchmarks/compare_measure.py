"""What benchmarks/compare.py measures in its plain training loops: the elements the collectives called from
Python move, and the bytes a rank holds (torch modules and optimizers, FSDP2's shards, DeepSpeed's engine)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor

# Python-level collectives counted for the plain loops, and how many times their size each one moves.
COUNTED = {"all_reduce": 2, "all_gather_single": 1, "all_gather": 1, "reduce_scatter_single": 1, "reduce_scatter": 1}
COUNTED.update({"reduce": 1, "broadcast": 1})


def _numel(value) -> int:
    if torch.is_tensor(value):
        return value.numel()
    return sum(t.numel() for t in value if torch.is_tensor(t)) if isinstance(value, (list, tuple)) else 0


@contextmanager
def count_collectives(counter: list[int]):
    """Adds to ``counter[0]`` the elements of every collective called from Python: the whole tensor a
    reduce-scatter reads or an all-gather writes, twice an all-reduce's. Patched in ``torch.distributed``
    and in ``distributed_c10d``, whose deprecated wrappers (``all_gather_into_tensor``...) call these."""
    originals = {name: getattr(c10d, name) for name in COUNTED}

    def counted(name):
        def wrapper(*args, **kwargs):
            counter[0] += COUNTED[name] * max(_numel(v) for v in (*args, *kwargs.values()))
            return originals[name](*args, **kwargs)

        return wrapper

    for name in COUNTED:
        setattr(dist, name, counted(name))
        setattr(c10d, name, getattr(dist, name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)


def _local_bytes(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).nbytes


def torch_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameters, ``.grad`` tensors and optimizer state (FSDP2: local shards of DTensors)."""
    params = list(module.parameters())
    return {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(
            _local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ),
    }


def deepspeed_bytes(engine) -> dict[str, int]:
    """What the engine holds after backward. Stage 1/2: the flat model parameters (whole), the live ``.grad``
    tensors and reduced gradient partitions, the fp32 master partition and Adam's state. Stage 3: the
    parameter partitions and whatever is gathered, the flat gradient partition buffer, the fp32 master
    partition and Adam's state."""
    opt = engine.optimizer
    state = sum(v.nbytes for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        held = sum(p.ds_tensor.nbytes + p.data.nbytes for p in params)
        grads = opt.grad_partitions_flat_buffer.nbytes
        master = sum(t.nbytes for t in opt.fp32_partitioned_groups_flat)
    else:
        held = sum(t.nbytes for t in opt.bit16_groups_flat)
        partitions = [t for v in opt.averaged_gradients.values() for t in (v if isinstance(v, list) else [v])]
        grads = sum(p.grad.nbytes for p in params if p.grad is not None) + sum(t.nbytes for t in partitions)
        master = sum(t.nbytes for t in opt.single_partition_of_fp32_groups)
    return {"parameters": held, "gradients": grads, "optimizer_state": master + state}

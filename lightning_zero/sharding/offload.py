"""ZeRO-Offload: the fp32 master partition, the optimizer state and the reduced gradient partition of
every unit live in host memory, and the optimizer steps there.

[Note: what lives where with offload]
Device: the parameters (stages 1 and 2: the flat buffer; stage 3: the shard, or only the gathered
units with ``offload_param``), stage 1's full gradient buffer, and the gradient buckets in flight.
Host: the fp32 master partition (a separate allocation even when the parameters are fp32: the
device keeps its own copy to compute with), the reduced fp32 gradient partition the optimizer reads,
the optimizer's state (torch optimizers allocate it beside the host pieces they step), and with
``offload_param`` the stage-3 parameter shards. Buffers are pinned when the device is CUDA and
``offload_pin_memory`` is on, so copies in either direction run without blocking the host.

[Note: offloaded gradients]
A bucket's reduced chunk is added into the host partition when its reduce-scatter is retired. On a
CPU "device" that is one add. On CUDA the chunk is copied into a pinned staging buffer on a side
stream (which first waits for the compute stream, so for the reduction it waited on), off the compute
stream and without the host waiting; an event marks the copy, and ``drain`` (end of backward, or the
step) waits for the events and adds the staged chunks on the host, accumulating in fp32 across
micro-batches. The bucket buffer goes back to the pool with that event: whoever takes it next makes
the compute stream wait for the copy first (``GradReducer._pooled``; stage 1 before it zeroes its
region), so compute only waits for a copy when it is about to overwrite what is being copied.

[Note: the host step]
With ``fused_step`` "auto" (the default) and a plain ``torch.optim.AdamW``, offloaded units are stepped
by lightning_zero's host kernel (``kernels/host.py``, ``cpu_kernels/adamw.c``): all of a step's
offloaded runs in one call, threaded over ``torch.get_num_threads()``, unscaling, updating master and
moments and writing the 16-bit copy that goes back to the device in one pass (fused_step.py). What it
does not take (other optimizers, a unit whose pieces differ in step count, no C compiler found) runs
the optimizer as written on the host tensors; Adam and AdamW groups that leave ``foreach`` and
``fused`` unset get ``fused=True`` then: torch's fused CPU kernel (one call for all of a group's pieces,
vectorized and threaded) instead of the per-parameter loop torch picks for CPU tensors by default.
The updated parameters go back to the device as part of the post-step gather (stages 1 and 2:
``FlatUnit.publish``; stage 3: ``refresh_shard``): the staged 16-bit copy as it is, or the master,
cast on the host by ``copy_to``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Adam, AdamW, Optimizer

from lightning_zero.config import HostOffload


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, offload: HostOffload) -> Tensor:
    """A new host buffer for a unit whose parameters are on ``device``: pinned when copies to and from a
    CUDA device should not block."""
    pin = offload.pin_memory and device.type == "cuda"
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def wait_for_copy(buffer: Tensor, copied: torch.cuda.Event | None) -> None:
    """Before ``buffer`` is overwritten on the compute stream: waits (on the device) for its copy to the host."""
    if copied is not None:
        torch.cuda.current_stream(buffer.device).wait_event(copied)


def copy_to(target: Tensor, source: Tensor) -> None:
    """``target.copy_(source)`` across host and device; asynchronous from pinned host memory. From the
    host master to 16-bit device parameters the cast happens on the host, into a pinned staging buffer
    (the caching host allocator keeps it until the copy is done), so half the bytes cross the bus."""
    if source.device.type == "cpu" and target.device.type == "cuda" and source.dtype != target.dtype:
        staging = torch.empty(source.shape, dtype=target.dtype, pin_memory=True)
        staging.copy_(source)
        source = staging
    target.copy_(source, non_blocking=source.is_pinned() or target.is_pinned())


class HostGradients:
    """Adds reduced device gradient chunks into host partitions (see [Note: offloaded gradients])."""

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, Tensor, torch.cuda.Event]] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def add(self, target: Tensor, source: Tensor) -> torch.cuda.Event | None:
        """Adds ``source`` into ``target`` now, or (device to host) once drained; returns the event after
        which ``source`` may be overwritten, if there is one."""
        if target.device == source.device or source.device.type != "cuda":
            target.add_(source)
            return None
        if source.device not in self._streams:  # one side stream per device, made once
            self._streams[source.device] = torch.cuda.Stream(source.device)
        side = self._streams[source.device]
        side.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(side):
            staging = torch.empty(source.shape, dtype=source.dtype, pin_memory=target.is_pinned())
            staging.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        self._pending.append((target, staging, copied))
        return copied

    def drain(self) -> None:
        """Waits for the staged copies and adds them into their host partitions."""
        for target, staging, copied in self._pending:
            copied.synchronize()
            target.add_(staging)
        self._pending.clear()


def wait_for_device(units) -> None:
    """Before a host step of offloaded units on CUDA: waits until the device has done everything queued so
    far, the non-blocking copies out of the host master after the last step included (the step writes it)."""
    devices = {u.flat_param.device for u in units if u.offload is not None and u.flat_param.device.type == "cuda"}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def use_fused_host_step(optimizer: Optimizer) -> None:
    """Adam/AdamW groups that leave the implementation to torch take the fused CPU kernel (see [Note: the
    host step]); an explicit ``foreach`` or ``fused`` is kept."""
    if not isinstance(optimizer, (Adam, AdamW)):
        return
    for group in optimizer.param_groups:
        if group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable"):
            group["fused"] = True
            group["foreach"] = False

"""The ZeRO memory formulas for what this implementation allocates per rank.

For Psi trainable parameters over N ranks, with Adam, every rank holds (B = bytes per parameter and
gradient element: 4 with fp32 parameters, i.e. ``32-true`` and ``bf16-mixed`` whose autocast keeps
fp32 weights; 2 with ``16-mixed``, whose ZeroPrecision keeps fp16 ones; Lightning's DDP runs
``16-mixed`` as autocast too, so its B is always 4):

=========  ===========  ==========  ==================  ==================================
strategy   parameters   gradients   master + Adam (K)   total
=========  ===========  ==========  ==================  ==================================
ddp        4 Psi        4 Psi       8 Psi (no master)   16 Psi (every precision)
zero1      B Psi        B Psi       (12 or 8) Psi / N   fp32: 8 Psi + 8 Psi / N; fp16: 4 Psi + 12 Psi / N
zero2      B Psi        B Psi / N   (12 or 8) Psi / N   fp32: 4 Psi + 12 Psi / N; fp16: 2 Psi + 14 Psi / N
zero3      B Psi / N    B Psi / N   (12 or 8) Psi / N   16 Psi / N
=========  ===========  ==========  ==================  ==================================

With ZeRO-Offload (``offload_optimizer="cpu"``; sharding/offload.py) the master (always a copy of its
own, 4 Psi / N), Adam's moments (8 Psi / N) and the reduced gradient partition in fp32 (4 Psi / N;
stage 1 keeps its full gradient on the device as well) live in host memory:

====================  ==========================  ===========================================
strategy              device                      host
====================  ==========================  ===========================================
zero1+offload         2 B Psi                     16 Psi / N
zero2+offload         B Psi                       16 Psi / N
zero3+offload         B Psi / N                   16 Psi / N
zero3+offload_param   0                           16 Psi / N (fp32); 18 Psi / N (fp16 shards)
====================  ==========================  ===========================================

The master copy is the fp32 partition the optimizer steps. With fp32 parameters (``32-true``,
``bf16-mixed``) there is none (K = 8): the optimizer steps this rank's part of the parameters in
place (stages 1 and 2: its chunks of the flat buffer; stage 3: its shard), where DeepSpeed keeps a
second fp32 copy. Padding adds fewer than 2N elements per bucket. Transient, not counted: stage 2's
in-flight buckets, and at the step the fp32 copy of a 16-bit gradient partition (4 Psi / N) and
stage 1's reduced partition (B Psi / N).
"""

from __future__ import annotations

import torch


def formula_bytes(strategy: str, psi: int, world_size: int, param_bytes: int = 4) -> dict[str, float]:
    """Per-rank bytes by category with Adam, from the formulas of the module's docstring (padding not counted).

    Args:
        strategy: "ddp", "zero1", "zero2", "zero3", "zero1+offload", "zero2+offload", "zero3+offload" or
            "zero3+offload_param".
        psi: the number of trainable parameters (Psi).
        world_size: the ranks the state is sharded over (N).
        param_bytes: bytes per parameter and gradient element (B): 4 for fp32 parameters, 2 for fp16 ones
            (``16-mixed``); ddp ignores it: its parameters and gradients are fp32 under every precision.

    Returns:
        "parameters", "gradients" and "optimizer_state" (the master, where there is one, and Adam's moments)
        on the device and, for the offloaded strategies, ``host_parameters``, ``host_gradients`` and
        ``host_optimizer_state``: bytes, as floats (Psi / N need not be whole).

    Raises:
        ValueError: ``strategy`` is none of the above.
    """
    n, b = world_size, param_bytes
    if strategy in ("zero1+offload", "zero2+offload", "zero3+offload", "zero3+offload_param"):
        stage, shard_on_host = int(strategy[4]), strategy.endswith("offload_param")
        return {
            "parameters": 0 if shard_on_host else (b * psi / n if stage == 3 else b * psi),
            "gradients": b * psi if stage == 1 else 0,
            "optimizer_state": 0,
            "host_parameters": b * psi / n if shard_on_host else 0,
            "host_gradients": 4 * psi / n,
            "host_optimizer_state": (8 if shard_on_host and b == 4 else 12) * psi / n,
        }
    if strategy == "ddp":
        return {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer_state": 8 * psi}
    k = 12 if b == 2 else 8  # fp32 parameters are their own master
    if strategy == "zero1":
        return {"parameters": b * psi, "gradients": b * psi, "optimizer_state": k * psi / n}
    if strategy == "zero2":
        return {"parameters": b * psi, "gradients": b * psi / n, "optimizer_state": k * psi / n}
    if strategy == "zero3":
        return {"parameters": b * psi / n, "gradients": b * psi / n, "optimizer_state": k * psi / n}
    raise ValueError(f"strategy must be one of ddp, zero1, zero2, zero3 (or zeroN+offload), got {strategy!r}")


def unit_nbytes(unit) -> dict[str, int]:
    """A flat unit's persistent bytes by category, on the device and (``host_*``) offloaded to the host. Stage 3 counts
    its shard as the parameters (and, with fp32 parameters, not again as the master it doubles as); a gathered flat
    buffer is transient; what is on NVMe (a placeholder here) is counted by ``persistent_bytes``."""
    out = dict.fromkeys(("parameters", "gradients", "master"), 0)
    out.update({f"host_{key}": 0 for key in tuple(out)})
    params = unit.param_shard if unit.param_shard is not None else unit.flat_param
    training = unit.training
    master = None if training is None or training.master is params else training.master
    flat_grad = training.flat_grad if training is not None else None
    partition = training.grad_partition if training is not None and training.swap is None else None  # (NVMe's: a file)
    held = (("parameters", params), ("gradients", flat_grad), ("gradients", partition))
    for key, tensor in (*held, ("master", master)):
        if tensor is not None and not tensor.is_meta:
            on_host = unit.offload is not None and tensor is not unit.flat_param and tensor is not flat_grad
            on_host = on_host and (key != "parameters" or unit.offload.params)
            out[f"host_{key}" if on_host else key] += tensor.nbytes
    return out


def persistent_bytes(units: list, optimizers: list, module: torch.nn.Module, *, offloaded: bool) -> dict[str, int]:
    """A rank's persistent bytes (``ZeroStrategy.memory_bytes``): parameters, gradients, master weights and
    optimizer state on the device and, under ``host_*``, offloaded to the host (zeros without offload); ``nvme``:
    the bytes of its swap files (the master and Adam's moments with ``offload_optimizer="nvme"``, else 0).
    Parameters include frozen ones (stage 3: the shards, not units gathered for a moment); gradients are
    the stage's persistent storage (in-flight buckets are transient and not counted)."""
    totals = dict.fromkeys(("parameters", "gradients", "master", "optimizer_state"), 0)
    totals.update({f"host_{key}": 0 for key in tuple(totals)})
    for unit in units:
        for key, value in unit_nbytes(unit).items():
            totals[key] += value
    for optimizer in optimizers:
        if hasattr(optimizer, "state_nbytes"):  # a ZeroOptimizer
            totals["host_optimizer_state" if offloaded else "optimizer_state"] += optimizer.state_nbytes()
    swapped = [u.training.swap for u in units if u.training is not None and u.training.swap is not None]
    swapped += [u.param_swap for u in units if u.param_swap is not None]
    mapped = [u.training.grad_partition for u in units if u.training is not None and u.training.swap is not None]
    # the swap files' bytes on the disk (nvme/), and the gradient partitions mapped from files there
    totals["nvme"] = sum(swap.file.nbytes for swap in swapped) + sum(g.nbytes for g in mapped if g is not None)
    sharded = {id(p) for u in units for p in u.params}
    totals["parameters"] += sum(p.nbytes for p in module.parameters() if not p.requires_grad and id(p) not in sharded)
    return totals


def engine_bytes(
    units: list, optimizers: list, module: torch.nn.Module, average, offloaded: bool, node_size: int | None
) -> dict[str, int]:
    """An engine's persistent bytes by category (``persistent_bytes``; stage 3's units gathered for a moment are its
    ``peak_gathered_bytes``), ``weight_average`` while a weight average is kept (this rank's share,
    sharding/averaging.py), and with ``node_size`` (hpZ) the ``secondary_partition``, held between a forward and its
    backward."""
    totals = persistent_bytes(units, optimizers, module, offloaded=offloaded)
    if average is not None:
        totals["weight_average"] = average.nbytes()
    if node_size is not None:
        totals["secondary_partition"] = sum(
            u.flat_param.numel() // node_size * u.flat_param.element_size() for u in units
        )
    return totals


class SavedBytes:
    """Bytes autograd keeps from forward to backward, counted exactly (``start()`` ... ``stop()``).

    Records the storage of every tensor saved for backward while it runs; ``stop()`` returns their
    total size at that moment, each storage once. A stage-3 unit freed after forward counts 0 (its
    storage is resized to 0 until backward gathers it again); autocast's bf16 copies of weights and
    the activations count in full. (Allocator statistics cannot tell this on the CPU: gloo frees its
    temporaries on its own threads, where the profiler does not see them.)
    """

    def __init__(self) -> None:
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._storages.setdefault(storage.data_ptr() or id(storage), storage)
        return tensor

    def start(self) -> None:
        """Starts recording the tensors saved for backward (forgetting any recorded before)."""
        self._storages.clear()
        self._hooks.__enter__()

    def stop(self) -> int:
        """Stops recording; returns the bytes of the storages recorded since ``start``, each once, as they are now."""
        self._hooks.__exit__(None, None, None)
        total = sum(storage.nbytes() for storage in self._storages.values())
        self._storages.clear()
        return total

"""Per-rank memory of ddp / zero1 / zero2 / zero3 before a run, exactly as the strategies allocate it.

The layouts are the strategies' own (``layout.py``, ``stage3_setup.py``): padding, bucket bounds, units
and which rank owns which elements, so a model's numbers equal what ``ZeroStrategy.memory_bytes()``
reports after set-up, rank by rank. Counted: parameters, gradients, and optimizer state (the fp32
master and Adam's two moments and step counters). Not counted: activations (planning/activations.py counts
them, ``estimate --seq-len``), and what lives only for a moment (buckets in flight, stage 3's gathered units,
the fp32 copy of a 16-bit gradient at the step).

DeepSpeed's own estimator charges 18 bytes per sharded parameter in stage 2 (2 Psi + 18 Psi / N): it
counts an fp32 gradient partition. Here the gradient partition has the parameters' dtype (2 bytes in
fp16) and the fp32 copy exists only during the step, so stage 2 is 2 Psi + 14 Psi / N, the paper's number.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import Module

from lightning_zero.config import ZeroConfig
from lightning_zero.nvme.optimizer_swap import record_bytes
from lightning_zero.nvme.swap_file import ALIGN
from lightning_zero.sharding.layout import FlatLayout, build_layout
from lightning_zero.sharding.stage3_setup import assign_units, unit_modules

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# With ``--offload cpu``: ZeroConfig(offload_optimizer="cpu"), and for zero3 also offload_param="cpu"
OFFLOADED = ("zero1+offload", "zero2+offload", "zero3+offload", "zero3+offload_param")
# With ``--offload nvme`` also: ZeroConfig(offload_optimizer="nvme"), the last with offload_param="nvme" too
ON_NVME = ("zero1+nvme", "zero2+nvme", "zero3+nvme", "zero3+nvme_param")


@dataclass(frozen=True)
class RankBytes:
    """One rank's bytes on the device, and (``host_*``) in host memory with offload."""

    parameters: int
    gradients: int
    optimizer_state: int  # master weights + the optimizer's state
    host_parameters: int = 0
    host_gradients: int = 0
    host_optimizer_state: int = 0
    nvme: int = 0  # the swap files' bytes (offload_optimizer="nvme": the master and Adam's moments)

    @property
    def total(self) -> int:
        """Device bytes."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def host_total(self) -> int:
        """Host bytes (with offload)."""
        return self.host_parameters + self.host_gradients + self.host_optimizer_state


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model: trainable sizes by optimizer param group, by
    stage-3 unit, and the bytes of what is not sharded (frozen parameters, buffers)."""

    groups: list[list[int]]
    units: list[list[int]]
    frozen_elements: int

    @property
    def psi(self) -> int:
        """The number of trainable parameters, over every param group."""
        return sum(map(sum, self.groups))


def shape_of_count(psi: int) -> ModelShape:
    """A model known only by its parameter count: one parameter group, one stage-3 unit, nothing frozen.

    Args:
        psi: the number of trainable parameters.

    Returns:
        The model's shape, for ``estimate``.
    """
    return ModelShape([[psi]], [[psi]], 0)


def shape_of_module(module: Module, groups: Sequence[Sequence[torch.Tensor]], config: ZeroConfig) -> ModelShape:
    """The shape of a (meta or real) module whose optimizer has these param groups: each group's trainable
    parameters, the stage-3 units as the strategy cuts them, and the elements of the frozen parameters.

    Args:
        module: the model, on the meta device or a real one.
        groups: the optimizer's param groups, each as its list of parameters.
        config: the ZeRO config, whose ``unit_module_classes`` choose the stage-3 units.

    Returns:
        The model's shape, for ``estimate``.
    """
    params = list(dict.fromkeys(module.parameters()))
    trainable_groups = [[p.numel() for p in g if p.requires_grad] for g in groups]
    units = [
        [p.numel() for p in ps] for _, ps in assign_units(module, unit_modules(module, config.unit_module_classes))
    ]
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    return ModelShape([g for g in trainable_groups if g], units, frozen)


def _owned(layouts: Sequence[FlatLayout], rank: int) -> tuple[int, int]:
    """Elements and pieces rank ``rank`` owns over ``layouts``."""
    pieces = [pc for layout in layouts for pc in layout.pieces(rank)]
    return sum(pc.numel for pc in pieces), len(pieces)


def estimate(
    shape: ModelShape, world_size: int, precision: str, config: ZeroConfig, *, offload: str = "none"
) -> dict[str, list[RankBytes]]:
    """Bytes per rank of each strategy, as the strategies allocate them (see the module's docstring).

    Offloaded (sharding/offload.py): the fp32 master (a copy of its own even for fp32 parameters, except
    fp32 shards offloaded with offload_param, which are the master), the optimizer state and the reduced
    gradient partition in fp32 are on the host; stage 1's full gradient stays on the device. On NVMe
    (nvme/optimizer_swap.py): the master and moments in the swap files, chunk by chunk; the host holds the
    gradient partition, the step counts and the step's ring of ``nvme_buffer_count`` chunk buffers.

    Args:
        shape: the model (``shape_of_count`` or ``shape_of_module``).
        world_size: the ranks the state is sharded over (the shard group's size).
        precision: Lightning's precision: the ZeRO strategies' parameters are in fp32 unless it is "16-mixed",
            ddp's always.
        config: the ZeRO config: its bucket size and NVMe settings.
        offload: "none"; "cpu" adds each configuration of ``OFFLOADED``; "nvme" adds those and each of ``ON_NVME``.

    Returns:
        Configuration name -> one RankBytes per rank (index = rank): "ddp", "zero1", "zero2", "zero3", then
        the offloaded ones, in that order (least sharding and offload first).
    """
    b = 2 if precision == "16-mixed" else 4
    n = world_size
    frozen = shape.frozen_elements * b
    group_layouts = [build_layout(g, n, config.reduce_bucket_size) for g in shape.groups]
    unit_layouts = [build_layout(u, n, sum(u)) for u in shape.units]
    padded = sum(layout.total_numel for layout in group_layouts)
    padded3 = sum(layout.total_numel for layout in unit_layouts)
    # Lightning's DDP keeps fp32 weights and gradients under every precision (16-mixed is autocast)
    ddp_params = 4 * (shape.psi + shape.frozen_elements)
    out: dict[str, list[RankBytes]] = {
        "ddp": [RankBytes(ddp_params, 4 * shape.psi, 8 * shape.psi + 4 * sum(map(len, shape.groups)))] * n
    }
    for stage in (1, 2):
        rows = []
        for rank in range(n):
            owned, pieces = _owned(group_layouts, rank)
            grads = b * padded if stage == 1 else b * padded // n
            master = 4 * padded // n if b == 2 else 0  # fp32 parameters are stepped in place
            rows.append(RankBytes(b * padded + frozen, grads, master + 8 * owned + 4 * pieces))
        out[f"zero{stage}"] = rows
    rows = []
    for rank in range(n):
        owned, pieces = _owned(unit_layouts, rank)
        master = 4 * padded3 // n if b == 2 else 0  # fp32 parameter shards are the master
        rows.append(RankBytes(b * padded3 // n + frozen, b * padded3 // n, master + 8 * owned + 4 * pieces))
    out["zero3"] = rows
    if offload == "none":
        return out
    for name in OFFLOADED:
        stage, layouts = int(name[4]), unit_layouts if name.startswith("zero3") else group_layouts
        total = sum(layout.total_numel for layout in layouts)
        rows = []
        for rank in range(n):
            owned, pieces = _owned(layouts, rank)
            shard_on_host = name.endswith("offload_param")
            device_params = 0 if shard_on_host else (b * total // n if stage == 3 else b * total)
            master = 0 if shard_on_host and b == 4 else 4 * total // n
            rows.append(
                RankBytes(
                    device_params + frozen,
                    b * total if stage == 1 else 0,
                    0,
                    host_parameters=b * total // n if shard_on_host else 0,
                    host_gradients=4 * total // n,
                    host_optimizer_state=master + 8 * owned + 4 * pieces,
                )
            )
        out[name] = rows
    if offload == "nvme":
        out.update({name: _on_nvme(name, group_layouts, unit_layouts, n, b, frozen, config) for name in ON_NVME})
    return out


def _on_nvme(name: str, groups: list, units: list, n: int, b: int, frozen: int, config: ZeroConfig) -> list[RankBytes]:
    """The rows of ``name`` in ``ON_NVME``: the device as with host offload; the swap files and the host's share."""
    stage, layouts = int(name[4]), units if name.startswith("zero3") else groups
    total = sum(layout.total_numel for layout in layouts)
    chunk = config.nvme_chunk_numel()
    records = [record_bytes(min(chunk, layout.partition_numel - lo)) for layout in layouts
               for lo in range(0, layout.partition_numel, chunk)]  # fmt: skip
    ring = config.nvme_buffer_count * max(records, default=0)
    shards = name.endswith("nvme_param")  # (each unit's shard a file of its own, rounded up to 4096 bytes)
    shard_files = sum(-(-layout.partition_numel * b // ALIGN) * ALIGN for layout in layouts) if shards else 0
    rows = []
    for rank in range(n):
        _, pieces = _owned(layouts, rank)
        device_params = 0 if shards else (b * total // n if stage == 3 else b * total)
        rows.append(
            RankBytes(
                device_params + frozen,
                b * total if stage == 1 else 0,
                0,
                host_optimizer_state=4 * pieces + ring,
                nvme=sum(records) + shard_files + 4 * total // n,  # (the gradient partition: a mapped file)
            )
        )
    return rows


def parse_bytes(text: str) -> int:
    """The bytes of a size as it is written: '80GB' (10^9), '80GiB' (2^30), '512MB', '1e9' ...

    Args:
        text: a number, then optionally B, KB, MB, GB or TB (powers of 1000) or KiB, MiB, GiB or TiB (powers
            of 1024).

    Returns:
        The number of bytes, rounded down.

    Raises:
        ValueError: ``text`` is not such a size.
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", text)
    if not match:
        raise ValueError(f"device memory must look like 80GB, 80GiB or 1e9 (bytes), got {text!r}")
    unit = match.group(2) or "B"
    power = "BKMGT".index(unit[0])
    return int(float(match.group(1)) * (1024**power if "i" in unit else 1000**power))


def smallest_fitting(table: dict[str, list[RankBytes]], capacity: int) -> str | None:
    """The first configuration, in the table's order (least sharding and offload first), whose device bytes fit.

    Args:
        table: ``estimate``'s.
        capacity: the bytes of one device.

    Returns:
        The configuration's name, or None if no configuration fits on any rank.
    """
    for name, rows in table.items():
        if max(r.total for r in rows) <= capacity:
            return name
    return None


def format_table(table: dict[str, list[RankBytes]], capacity: int | None = None) -> str:
    """The table as text: a line per configuration, with the GiB of its rank that needs the most.

    Args:
        table: ``estimate``'s.
        capacity: the bytes of one device: a column says whether each configuration fits; None: no such column.

    Returns:
        The lines, a header first; the host and NVMe columns appear when some configuration uses them.
    """
    gib = 2**30
    host = any(r.host_total for rows in table.values() for r in rows)
    disk = any(r.nvme for rows in table.values() for r in rows)
    lines = [
        f"{'strategy':<20}{'parameters':>12}{'gradients':>12}{'optimizer':>12}{'total GiB':>12}"
        + (f"{'host GiB':>12}" if host else "")
        + (f"{'NVMe GiB':>12}" if disk else "")
        + (f"{'fits':>8}" if capacity else "")
    ]
    for name, rows in table.items():
        worst = max(rows, key=lambda r: (r.total, r.host_total))  # the rank that needs the most
        fits = ("   yes" if worst.total <= capacity else "    no") if capacity else ""
        lines.append(
            f"{name:<20}{worst.parameters / gib:>12.3f}{worst.gradients / gib:>12.3f}"
            f"{worst.optimizer_state / gib:>12.3f}{worst.total / gib:>12.3f}"
            + (f"{worst.host_total / gib:>12.3f}" if host else "")
            + (f"{worst.nvme / gib:>12.3f}" if disk else "")
            + f"{fits:>8}"
        )
    return "\n".join(lines)

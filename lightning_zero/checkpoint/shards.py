"""Reading any parameter's elements back out of a checkpoint's per-rank files, at any world size.

The saved layout of every unit is rebuilt from the metadata (sizes and bucket bounds at the saved
world size), so for each saved rank we know which element range of which parameter sits where in its
partition. Reading [lo, hi) of a parameter copies the overlapping pieces of the saved ranks' files,
which are memory-mapped: only the pages that are read are touched.
"""

from __future__ import annotations

import math
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.format import CheckpointError, Metadata, load_torch_file, rank_file
from lightning_zero.sharding.layout import FlatLayout, layout_from_buckets


class ShardReader:
    """Reads parameters, optimizer state and weight averages out of a sharded checkpoint's per-rank files by
    element range, whatever world size they were saved at (see the module's docstring)."""

    def __init__(self, directory: Path, meta: Metadata, *, keep_open: bool = True) -> None:
        """``keep_open=False`` maps a rank's file anew for every read, so pages read are released
        right after (for streaming the whole model with little memory); otherwise it stays mapped."""
        self.directory = directory
        self.meta = meta
        self.keep_open = keep_open
        self._files: dict[int, dict[str, Any]] = {}
        self.location = {p.name: (u, j) for u, unit in enumerate(meta.units) for j, p in enumerate(unit.params)}

    @cached_property
    def layouts(self) -> list[FlatLayout]:
        """Each saved unit's flat layout at the saved world size, rebuilt from the metadata's sizes and buckets."""
        sizes = [[math.prod(p.shape) for p in unit.params] for unit in self.meta.units]
        return [layout_from_buckets(n, self.meta.world_size, u.buckets) for n, u in zip(sizes, self.meta.units)]

    @cached_property
    def _pieces(self) -> dict[tuple[int, int], list[tuple[int, int, int, int]]]:
        """(saved unit, param index) -> [(saved rank, lo, hi, partition offset)]."""
        out: dict[tuple[int, int], list] = {}
        for u, layout in enumerate(self.layouts):
            for r in range(self.meta.world_size):
                for pc in layout.pieces(r):
                    out.setdefault((u, pc.param), []).append((r, pc.lo, pc.hi, pc.partition_offset))
        return out

    def rank_data(self, rank: int) -> dict[str, Any]:
        """Saved rank ``rank``'s file, memory-mapped (kept mapped for later reads with ``keep_open``)."""
        if rank in self._files:
            return self._files[rank]
        path = self.directory / rank_file(rank)
        data = load_torch_file(path, weights_only=True)  # a file that passed its checks may still not load
        if self.keep_open:
            self._files[rank] = data
        return data

    def read(self, name: str, lo: int, hi: int, out: Tensor, key: str | None = None, *, averaged: bool = False) -> None:
        """Copies elements [lo, hi) of parameter ``name`` into ``out`` (1-D, hi - lo elements): its
        fp32 master values, with ``key`` that optimizer state (e.g. "exp_avg"), or with ``averaged`` its
        weight average (format.py's AVERAGED_IN_SHARDS)."""
        unit, index = self.location[name]
        for rank, slo, shi, offset in self._pieces[(unit, index)]:
            a, b = max(lo, slo), min(hi, shi)
            if a >= b:
                continue
            source = self._partition(rank, unit, name, key, averaged)
            out[a - lo : b - lo].copy_(source[offset + a - slo : offset + b - slo])

    def _partition(self, rank: int, unit: int, name: str, key: str | None, averaged: bool) -> Tensor:
        """Saved rank ``rank``'s partition of ``unit`` (its master, state ``key`` or average), which holds a piece of
        ``name``, checked to have the size the metadata's layout gives it: a file that does not belong with the
        metadata is named, with the parameter, instead of failing in a copy (or being read at wrong offsets)."""
        path = self.directory / rank_file(rank)
        what = "weight average" if averaged else "master" if key is None else f"optimizer state {key!r}"
        try:
            saved = self.rank_data(rank)["units"][unit]
            source = saved["averaged"] if averaged else saved["master"] if key is None else saved["state"][key]
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f"{path}: holds no {what} of unit {unit} ({name}'s), as the metadata says") from None
        expected = self.layouts[unit].partition_numel
        if not torch.is_tensor(source) or source.dim() != 1 or source.numel() != expected:
            found = list(source.shape) if torch.is_tensor(source) else type(source).__name__
            raise CheckpointError(
                f"{path}: the {what} of unit {unit} ({name}'s) is {found}; the metadata's shapes give rank {rank}"
                f" [{expected}] (the file and the metadata are not of one checkpoint)"
            )
        return source

    def full(self, name: str, dtype: torch.dtype | None = None, *, averaged: bool = False) -> Tensor:
        """The whole parameter ``name`` (or its weight average) in its saved shape (fp32 unless ``dtype``)."""
        unit, index = self.location[name]
        entry = self.meta.units[unit].params[index]
        out = torch.empty(math.prod(entry.shape), dtype=dtype or torch.float32)
        self.read(name, 0, out.numel(), out, averaged=averaged)
        return out.view(entry.shape)

    def state_of(self, name: str) -> tuple[dict[str, Any], list[str]] | None:
        """The saved scalar optimizer state of ``name`` and its elementwise keys, or None if it has none."""
        unit, index = self.location[name]
        for rank, *_ in self._pieces[(unit, index)]:
            scalars = self.rank_data(rank)["units"][unit].get("scalars", {})
            if index in scalars:
                return scalars[index], list(self.rank_data(rank)["units"][unit]["state"])
        return None

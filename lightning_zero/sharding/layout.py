"""Where each parameter of a flat unit lives and which part of it each rank owns.

Pure arithmetic on element counts: no tensors, no torch.distributed. Every rank computes the same
layout from the same list of parameter sizes, so nothing here may depend on anything rank-local.

[Note: bucket-major layout]
A unit's flat buffer is a sequence of buckets. A bucket holds whole parameters back to back and is
padded to a multiple of 2 x world_size elements, so it splits into world_size equal chunks whose
starts stay aligned (DeepSpeed's alignment rule, applied per bucket). Rank r owns chunk r of every
bucket; a parameter may straddle chunks and is then owned in pieces by several ranks. Because each
bucket splits evenly, one reduce-scatter of a bucket's gradient delivers exactly chunk r to rank r,
and one all-gather of the chunks rebuilds the bucket: per step each element crosses the wire once in
each direction (the ZeRO paper's 2 Psi), never as an all-reduce. Rank r's *partition* is its chunks
concatenated bucket after bucket: one contiguous tensor per unit for master weights and gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters reduced and gathered as one collective."""

    start: int  # flat offset of the bucket's first element
    numel: int  # padded size, a multiple of 2 * world_size
    first_param: int  # the bucket holds parameters [first_param, end_param)
    end_param: int
    partition_offset: int  # where every rank's chunk of this bucket sits in its partition
    world_size: int

    @property
    def chunk_numel(self) -> int:
        """Elements of each rank's chunk of the bucket (its padded size split evenly)."""
        return self.numel // self.world_size

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """Flat [lo, hi) of the chunk that ``rank`` owns."""
        lo = self.start + rank * self.chunk_numel
        return lo, lo + self.chunk_numel


@dataclass(frozen=True)
class Piece:
    """The contiguous part of one parameter that one rank owns."""

    param: int  # index of the parameter in the unit
    lo: int  # element range [lo, hi) of the flattened parameter
    hi: int
    partition_offset: int  # where the piece starts in the owning rank's partition

    @property
    def numel(self) -> int:
        """Elements in the piece."""
        return self.hi - self.lo


@dataclass(frozen=True)
class FlatLayout:
    """Where every parameter of a flat unit sits in its flat buffer, and its buckets (see the Note above).

    Built by ``build_layout`` or ``layout_from_buckets``; the same on every rank.

    Attributes:
        numels: each parameter's number of elements, in the unit's order.
        offsets: each parameter's flat offset.
        param_bucket: each parameter's bucket index.
        buckets: the buckets, in flat order.
        world_size: the number of ranks the unit is sharded over.
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]  # flat offset of each parameter
    param_bucket: tuple[int, ...]  # bucket index of each parameter
    buckets: tuple[Bucket, ...]
    world_size: int

    @property
    def total_numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        last = self.buckets[-1]
        return last.start + last.numel

    @property
    def partition_numel(self) -> int:
        """Elements of one rank's partition (its chunk of every bucket)."""
        return self.total_numel // self.world_size

    @property
    def padding_numel(self) -> int:
        """Elements of the flat buffer that belong to no parameter (the buckets' padding)."""
        return self.total_numel - sum(self.numels)

    def bucket_bounds(self) -> list[list[int]]:
        """Each bucket's ``[first_param, end_param)``, as ``layout_from_buckets`` takes them."""
        return [[b.first_param, b.end_param] for b in self.buckets]

    def pieces(self, rank: int) -> list[Piece]:
        """Rank ``rank``'s pieces in partition order; at most one per parameter."""
        pieces = []
        for bucket in self.buckets:
            lo, hi = bucket.chunk_range(rank)
            for i in range(bucket.first_param, bucket.end_param):
                start, end = self.offsets[i], self.offsets[i] + self.numels[i]
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    pieces.append(Piece(i, a - start, b - start, bucket.partition_offset + a - lo))
        return pieces


def build_layout(numels: Sequence[int], world_size: int, bucket_numel: int) -> FlatLayout:
    """Packs parameters (in the given order) into buckets of about ``bucket_numel`` elements.

    A parameter larger than ``bucket_numel`` gets a bucket of its own; no parameter is split
    between buckets, so each gradient lands in exactly one bucket.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    bounds, first, filled = [], 0, 0
    for i, n in enumerate(numels):
        if filled and filled + n > bucket_numel:
            bounds.append((first, i))
            first, filled = i, 0
        filled += n
    bounds.append((first, len(numels)))
    return layout_from_buckets(numels, world_size, bounds)


def layout_from_buckets(numels: Sequence[int], world_size: int, bounds: Sequence[Sequence[int]]) -> FlatLayout:
    """The layout of parameters grouped into the buckets ``[first_param, end_param)`` given, in order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not numels or any(n < 1 for n in numels):
        raise ValueError(f"a flat unit needs at least one parameter and no empty ones, got sizes {list(numels)}")
    if [b[0] for b in bounds[1:]] != [b[1] for b in bounds[:-1]] or bounds[0][0] != 0 or bounds[-1][1] != len(numels):
        raise ValueError(f"bucket bounds {list(bounds)} do not cover parameters 0..{len(numels)} in order")
    align = 2 * world_size
    offsets, param_bucket, buckets = [], [], []
    start = partition_offset = 0
    for first, end in bounds:
        filled = 0
        for i in range(first, end):
            offsets.append(start + filled)
            param_bucket.append(len(buckets))
            filled += numels[i]
        padded = -(-filled // align) * align
        buckets.append(Bucket(start, padded, first, end, partition_offset, world_size))
        start += padded
        partition_offset += padded // world_size
    return FlatLayout(tuple(numels), tuple(offsets), tuple(param_bucket), tuple(buckets), world_size)

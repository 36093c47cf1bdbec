"""The bucket-major layout: equal aligned chunks, every element owned exactly once, padding outside."""

from __future__ import annotations

import random

import pytest

from lightning_zero.sharding.layout import build_layout

CASES = [
    ([7], 2, 100),
    ([7, 11, 77, 1, 13], 2, 50),
    ([7, 11, 77, 1, 13], 4, 50),
    ([1000], 3, 10),  # one parameter larger than a bucket
    ([5] * 9, 4, 12),
    ([1], 8, 1),
]


def _random_cases(n: int = 40):
    rng = random.Random(0)
    for _ in range(n):
        sizes = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        yield sizes, rng.choice([1, 2, 3, 4, 8]), rng.randint(1, 600)


@pytest.mark.parametrize("numels,world,bucket", CASES + list(_random_cases()))
def test_layout_invariants(numels, world, bucket):
    layout = build_layout(numels, world, bucket)
    # Buckets tile the buffer, each a multiple of 2 x world, split into equal chunks.
    assert layout.buckets[0].start == 0
    for prev, nxt in zip(layout.buckets, layout.buckets[1:]):
        assert nxt.start == prev.start + prev.numel
        assert nxt.partition_offset == prev.partition_offset + prev.chunk_numel
    for b in layout.buckets:
        assert b.numel % (2 * world) == 0 and b.numel > 0
        assert b.chunk_numel * world == b.numel
    assert layout.total_numel == layout.partition_numel * world
    # Parameters sit whole inside their bucket, in order, without overlap.
    for i, (offset, n) in enumerate(zip(layout.offsets, layout.numels)):
        b = layout.buckets[layout.param_bucket[i]]
        assert b.first_param <= i < b.end_param
        assert b.start <= offset and offset + n <= b.start + b.numel
        if i:
            assert offset >= layout.offsets[i - 1] + layout.numels[i - 1]
    # Padding per bucket stays below the alignment.
    assert 0 <= layout.padding_numel < 2 * world * len(layout.buckets)
    # Over all ranks, every element of every parameter is owned exactly once, at the partition
    # position that matches its flat position.
    owned = [[0] * n for n in numels]
    for rank in range(world):
        used_partition = set()
        for pc in layout.pieces(rank):
            assert 0 <= pc.lo < pc.hi <= numels[pc.param]
            b = layout.buckets[layout.param_bucket[pc.param]]
            lo, hi = b.chunk_range(rank)
            flat = layout.offsets[pc.param] + pc.lo
            assert lo <= flat and flat + pc.numel <= hi
            assert pc.partition_offset == b.partition_offset + flat - lo
            span = set(range(pc.partition_offset, pc.partition_offset + pc.numel))
            assert not span & used_partition and max(span) < layout.partition_numel
            used_partition |= span
            for e in range(pc.lo, pc.hi):
                owned[pc.param][e] += 1
        assert len({pc.param for pc in layout.pieces(rank)}) == len(layout.pieces(rank)), "one piece per parameter"
    assert all(c == 1 for counts in owned for c in counts)


def test_bucket_size_groups_parameters():
    layout = build_layout([10, 10, 10, 25, 3], world_size=2, bucket_numel=20)
    assert [(b.first_param, b.end_param) for b in layout.buckets] == [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_parameter_straddles_ranks():
    layout = build_layout([6, 6], world_size=2, bucket_numel=100)  # one bucket of 12: chunks [0, 6), [6, 12)
    assert [(p.param, p.lo, p.hi) for p in layout.pieces(0)] == [(0, 0, 6)]
    layout = build_layout([5, 7], world_size=2, bucket_numel=100)  # chunks [0, 6), [6, 12): param 1 straddles
    assert [(p.param, p.lo, p.hi) for p in layout.pieces(0)] == [(0, 0, 5), (1, 0, 1)]
    assert [(p.param, p.lo, p.hi) for p in layout.pieces(1)] == [(1, 1, 7)]


@pytest.mark.parametrize(
    "numels,world,bucket,match",
    [
        ([], 2, 10, "at least one parameter"),
        ([3, 0], 2, 10, "no empty"),
        ([3], 0, 10, "world_size"),
        ([3], 2, 0, "bucket"),
    ],
)
def test_layout_rejects_bad_input(numels, world, bucket, match):
    with pytest.raises(ValueError, match=match):
        build_layout(numels, world, bucket)

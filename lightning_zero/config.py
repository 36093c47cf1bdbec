"""The one typed configuration object of the ZeRO strategies.

A plain dataclass, so it is also an OmegaConf structured config and a jsonargparse-typed argument of
the Lightning CLI. Every field is validated in ``__post_init__``: a bad value fails before any process
is launched, with a message naming the key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_STAGES = (1, 2)


def _check(ok: bool, key: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"zero.{key} must be {allowed}, got {value!r}")


@dataclass(kw_only=True)
class ZeroConfig:
    """How the ZeRO strategy shards and communicates.

    Attributes:
        stage: 1 shards the optimizer state (and fp32 master weights); 2 also shards gradients.
        reduce_bucket_size: elements per gradient bucket. Each bucket is one reduce-scatter and one
            all-gather per step; in stage 2 at most two buckets are alive at once, so this bounds the
            transient gradient memory.
        overlap_comm: stage 2 only: reduce-scatter a bucket asynchronously as soon as it is full, while
            backward continues. When off, each bucket is reduced synchronously.
        timeout: seconds a collective may wait for the other ranks before the run fails with an error.
    """

    stage: int = 2
    reduce_bucket_size: int = 25_000_000
    overlap_comm: bool = True
    timeout: float = 1800.0

    def __post_init__(self) -> None:
        _check(
            not isinstance(self.stage, bool) and self.stage in SUPPORTED_STAGES,
            "stage",
            self.stage,
            f"one of {', '.join(map(str, SUPPORTED_STAGES))}",
        )
        _check(
            isinstance(self.reduce_bucket_size, int)
            and not isinstance(self.reduce_bucket_size, bool)
            and self.reduce_bucket_size > 0,
            "reduce_bucket_size",
            self.reduce_bucket_size,
            "an integer > 0 (elements)",
        )
        _check(isinstance(self.overlap_comm, bool), "overlap_comm", self.overlap_comm, "true or false")
        _check(
            isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool) and self.timeout > 0,
            "timeout",
            self.timeout,
            "a number of seconds > 0",
        )

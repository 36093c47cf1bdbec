"""FlatUnit: one flat, padded buffer of parameters, sharded over the data-parallel ranks.

A unit is the partition layer that every stage builds on: stages 1 and 2 make one unit per optimizer
param group. It owns
- ``flat_param``: every parameter of the unit, back to back in the bucket-major layout of
  ``layout.py``; the model's parameters are views into it, so the model reads what the
  all-gather writes;
- ``master``: this rank's partition (its chunk of every bucket) in fp32: the weights the
  optimizer updates, copied (and cast) back into ``flat_param`` after each step;
- ``pieces``: per-parameter views into ``master``, one per parameter this rank owns part of. The
  user's optimizer steps these, so per-parameter semantics (a parameter without a gradient is
  skipped: no momentum, no weight decay) hold exactly as on the unsharded model;
- gradient storage: stage 1 keeps a full flat gradient buffer, stage 2 only this rank's gradient
  partition (see [Note: gradient storage]);
- ``used``: which parameters received a gradient since the last ``zero_grad``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.sharding import collectives
from lightning_zero.sharding.layout import Bucket, FlatLayout, Piece


class FlatUnit:
    def __init__(
        self,
        params: Sequence[Parameter],
        names: Sequence[str],
        layout: FlatLayout,
        rank: int,
        *,
        full_grad: bool,
    ) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                "all parameters of one optimizer param group must share dtype and device to be flattened,"
                f" got dtypes {sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}"
                f" for parameters {list(names)}"
            )
        self.params = list(params)
        self.names = list(names)
        self.layout = layout
        self.rank = rank
        device, dtype = self.params[0].device, self.params[0].dtype

        self.flat_param = torch.zeros(layout.total_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, offset, numel in zip(self.params, layout.offsets, layout.numels):
                view = self.flat_param[offset : offset + numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)

        self.master = torch.empty(layout.partition_numel, dtype=torch.float32, device=device)
        for bucket in layout.buckets:
            self.master_chunk(bucket).copy_(self.param_chunk(bucket))

        # [Note: gradient storage]
        # Gradients are stored in the parameters' dtype (fp32, or fp16 under 16-mixed). Stage 1
        # accumulates full gradients across micro-batches in ``flat_grad`` and reduce-scatters them once
        # per step into a transient ``reduced`` partition. Stage 2 reduce-scatters every backward and
        # accumulates only this rank's partition, which is ``reduced`` at all times. At the step the
        # optimizer gets ``step_grad``: ``reduced`` itself when it is fp32, else an fp32 copy that lives
        # until the step is done. The padding stays zero, since no gradient is ever written there, so
        # it never reaches a norm.
        self.flat_grad = torch.zeros(layout.total_numel, dtype=dtype, device=device) if full_grad else None
        self.grad_partition = None if full_grad else torch.zeros(layout.partition_numel, dtype=dtype, device=device)
        self.reduced: Tensor | None = self.grad_partition
        self.step_grad: Tensor | None = None
        self.pieces: list[Piece] = layout.pieces(rank)
        self.piece_tensors: list[Tensor] = [
            self.master[pc.partition_offset : pc.partition_offset + pc.numel] for pc in self.pieces
        ]
        self.used = torch.zeros(len(self.params), dtype=torch.uint8, device=device)

    # --- views -------------------------------------------------------------------------------------
    def param_chunk(self, bucket: Bucket) -> Tensor:
        lo, hi = bucket.chunk_range(self.rank)
        return self.flat_param[lo:hi]

    def partition_slice(self, bucket: Bucket) -> slice:
        return slice(bucket.partition_offset, bucket.partition_offset + bucket.chunk_numel)

    def master_chunk(self, bucket: Bucket) -> Tensor:
        return self.master[self.partition_slice(bucket)]

    # --- per-step operations -----------------------------------------------------------------------
    def nonfinite(self) -> Tensor:
        """1 if this rank's reduced gradient holds an inf or nan, else 0 (a device tensor: no sync)."""
        return (~torch.isfinite(self.reduced)).any().to(torch.uint8).reshape(1)

    def attach_grads(self, used: Tensor) -> None:
        """Points each piece's ``.grad`` at its fp32 reduced gradient, or None where no rank produced one."""
        self.step_grad = self.reduced if self.reduced.dtype == self.master.dtype else self.reduced.to(self.master.dtype)
        for piece, tensor in zip(self.pieces, self.piece_tensors):
            lo = piece.partition_offset
            tensor.grad = self.step_grad[lo : lo + piece.numel] if used[piece.param] else None

    def release_grads(self) -> None:
        for tensor in self.piece_tensors:
            tensor.grad = None
        self.step_grad = None
        if self.flat_grad is not None:
            self.reduced = None

    def zero_grad(self) -> None:
        for grad in (self.flat_grad, self.grad_partition):
            if grad is not None:
                grad.zero_()
        self.used.zero_()
        self.release_grads()

    def gather_params(self, *, group=None) -> None:
        """Copies the updated master partition into the flat buffer and all-gathers every bucket."""
        works = []
        for bucket in self.layout.buckets:
            own = self.param_chunk(bucket)
            own.copy_(self.master_chunk(bucket))
            lo = bucket.start
            works.append(
                collectives.all_gather(self.flat_param[lo : lo + bucket.numel], own, async_op=True, group=group)
            )
        for work in works:
            collectives.wait(work)

    def nbytes(self) -> dict[str, int]:
        """Persistent bytes (the stage-1 reduced partition and fp32 step gradients are transient)."""
        grads = self.flat_grad if self.flat_grad is not None else self.grad_partition
        return {
            "parameters": self.flat_param.nbytes,
            "gradients": grads.nbytes,
            "master": self.master.nbytes,
        }

"""Buffers kept as ddp keeps them: rank 0's, broadcast before the forwards where ddp broadcasts them.

[Note: when buffers are broadcast]
DistributedDataParallel with ``broadcast_buffers=True`` (its default) broadcasts every buffer from rank 0
before a forward when its previous forward ran with gradients and with gradient synchronization (not
inside ``no_sync``, which Lightning enters for the micro-batches before a step's last). So the running
statistics that BatchNorm updated on each rank's own batch become rank 0's before the next step's first
training forward and before the first forward of validation during ``fit``, and every rank validates with
the same statistics (the logged ``val_loss`` and what a monitor selects follow). The ZeRO strategies do
the same at the same points: the condition is Lightning's loop (training or not, last micro-batch or
not), the same on every rank, so every rank issues the same broadcasts. Outside ``fit`` ddp does not wrap
the model and broadcasts nothing; neither do we. Buffers are never sharded (stage 3 shards parameters
only), so they are broadcast whole.
"""

from __future__ import annotations

import torch
from torch.nn import Module

from lightning_zero.sharding import collectives

BUCKET_BYTES = 250 * 1024 * 1024  # ddp's broadcast bucket


class BufferSync:
    """Rank 0's buffers of ``module`` before the forwards that follow a synchronized training forward."""

    def __init__(self, module: Module, *, group=None) -> None:
        self.module = module
        self.group = group
        self.pending = True  # ddp broadcasts before its first forward too

    def forward_starts(self, *, training: bool, synchronized: bool) -> None:
        """Before a forward (collective when it broadcasts): ``training``, a training step's forward;
        ``synchronized``, not a micro-batch before the step's last."""
        # Listed at each broadcast, as ddp does: code may replace a buffer (SWA's BatchNorm reset does).
        buffers = [b.detach() for b in self.module.buffers()]
        if self.pending and buffers:
            collectives.broadcast_coalesced(buffers, src=0, bucket_bytes=BUCKET_BYTES, group=self.group)
        self.pending = training and synchronized and torch.is_grad_enabled()  # (for the next forward)

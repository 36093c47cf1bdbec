"""Block-wise int8 quantization of a flat shard, for quantized weight gathers (ZeRO++'s qwZ).

[Note: quantized weight gathers]
With ``ZeroConfig(quantized_weights=True)`` stage 3 gathers a unit for the step's forward and backward as
int8: each rank splits its shard (``n`` elements, the same ``n`` on every rank) into blocks of ``block``
elements and keeps, per block, one fp32 scale ``absmax / 127``; each element becomes
``round(x / scale)`` in [-127, 127]. The int8 shards and the scales are all-gathered (``n`` bytes and
``4 ceil(n / block)`` bytes per rank instead of ``n`` elements of the parameters' dtype) and every rank
dequantizes every rank's part, its own included, into the unit's flat buffer: every rank computes with the
same weights. Rounding to nearest bounds the error of each element by half a step, ``absmax / 254`` of its
block (then the cast to the compute dtype). Only what the step's schedule gathers is quantized: the fp32
master weights, the optimizer, state dicts, ``gathered_parameters`` and checkpoints read the exact shards.
"""

from __future__ import annotations

import torch
from torch import Tensor

LEVELS = 127  # symmetric int8: -127..127 (-128 unused, so that negating a value is exact)


def scales_numel(numel: int, block: int) -> int:
    return -(-numel // block)


def quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``x`` (``(..., n)``, any float dtype) as int8 values and one fp32 scale per block of ``block`` elements
    of each row (the last block may be shorter). A non-finite value makes its block's scale non-finite, so
    the block dequantizes to non-finite values (an fp16 overflow stays visible after a quantized reduction)."""
    n, lead = x.shape[-1], x.shape[:-1]
    blocks = scales_numel(n, block)
    padded = torch.zeros(*lead, blocks * block, dtype=torch.float32, device=x.device)
    padded[..., :n] = x
    rows = padded.view(*lead, blocks, block)
    scales = rows.abs().amax(dim=-1) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    values = torch.round(rows / safe.unsqueeze(-1)).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return values.view(*lead, blocks * block)[..., :n], scales


def dequantize_into(out: Tensor, values: Tensor, scales: Tensor, block: int) -> None:
    """Writes ``values * scale`` of each block into ``out`` (in its own dtype). Shapes: ``out`` and ``values``
    ``(..., n)``, ``scales`` ``(..., ceil(n / block))``: several ranks' gathered parts at once."""
    n, blocks = values.shape[-1], scales.shape[-1]
    lead = values.shape[:-1]
    padded = torch.zeros(*lead, blocks * block, dtype=torch.float32, device=values.device)
    padded[..., :n] = values
    whole = padded.view(*lead, blocks, block) * scales.unsqueeze(-1)
    out.copy_(whole.view(*lead, blocks * block)[..., :n])

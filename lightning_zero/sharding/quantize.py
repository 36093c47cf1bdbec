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

from lightning_zero.kernels import launchers, reference
from lightning_zero.kernels.loader import use_kernels

LEVELS = reference.QUANTIZE_LEVELS
INT4_LEVELS = 7


def scales_numel(numel: int, block: int) -> int:
    """How many scales ``numel`` elements have in blocks of ``block``: ``ceil(numel / block)``."""
    return -(-numel // block)


def quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``x`` (``(..., n)``, any float dtype) as int8 values and one fp32 scale per block of ``block`` elements
    of each row (the last block may be shorter); a non-finite value makes its block's scale infinite, so the
    block dequantizes to non-finite values (an fp16 overflow stays visible after a quantized reduction).
    The CUDA kernel (cuda_kernels/quantize.cu) on CUDA tensors, its torch reference elsewhere."""
    return (launchers if use_kernels(x) else reference).quantize_blocks(x, block)


def quantize_int4(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """As ``quantize`` with 4 bits: values in [-7, 7] with scales absmax / 7, two to a byte (``(..., ceil(n /
    2))`` uint8, the even element in the low half). Torch ops on any device."""
    values, scales = reference.quantize_blocks(x, block, levels=INT4_LEVELS)
    n = values.shape[-1]
    nibbles = torch.zeros(*values.shape[:-1], n + n % 2, dtype=torch.uint8, device=values.device)
    nibbles[..., :n] = (values + INT4_LEVELS + 1).to(torch.uint8)  # 1..15 (0: padding)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), scales


def dequantize_int4_into(out: Tensor, packed: Tensor, scales: Tensor, block: int) -> None:
    """Writes what ``quantize_int4`` packed into ``out`` (``(..., n)``, its own dtype)."""
    n = out.shape[-1]
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :n]
    reference.dequantize_blocks(out, nibbles.to(torch.int8) - (INT4_LEVELS + 1), scales, block)


def dequantize_into(out: Tensor, values: Tensor, scales: Tensor, block: int) -> None:
    """Writes ``values * scale`` of each block into ``out`` (in its own dtype). Shapes: ``out`` and ``values``
    ``(..., n)``, ``scales`` ``(..., ceil(n / block))``: several ranks' gathered parts at once."""
    (launchers if use_kernels(out) else reference).dequantize_blocks(out, values, scales, block)

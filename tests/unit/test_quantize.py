"""Block-wise int8 quantization (sharding/quantize.py): the error of every element is at most half a step of
its block, all-zero blocks and ragged lengths survive, and several ranks' parts dequantize at once."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ZeroConfig
from lightning_zero.deepspeed_config import read_deepspeed_config
from lightning_zero.sharding.quantize import (
    INT4_LEVELS,
    LEVELS,
    dequantize_int4_into,
    dequantize_into,
    quantize,
    quantize_int4,
    scales_numel,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("numel", "block"), [(1000, 256), (256, 256), (7, 256), (4096, 64)])
def test_error_is_at_most_half_a_step_of_the_block(dtype, numel, block):
    torch.manual_seed(0)
    x = (torch.randn(numel) * torch.logspace(-3, 1, numel)).to(dtype)  # magnitudes vary across blocks
    values, scales = quantize(x, block)
    assert values.dtype == torch.int8 and values.numel() == numel
    assert scales.dtype == torch.float32 and scales.numel() == scales_numel(numel, block)
    out = torch.empty(numel, dtype=torch.float32)
    dequantize_into(out, values, scales, block)
    padded = torch.zeros(scales.numel() * block)
    padded[:numel] = x.float()
    absmax = padded.view(-1, block).abs().amax(dim=1)
    bound = (absmax / LEVELS / 2).repeat_interleave(block)[:numel]
    rounding = (absmax * 1e-6).repeat_interleave(block)[:numel]  # fp32 arithmetic on the block's scale
    error = (out - x.float()).abs()
    assert torch.all(error <= bound + rounding), float((error - bound).max())
    assert error.max() > 0  # it does quantize


def test_zero_blocks_stay_zero_and_extremes_are_exact():
    x = torch.zeros(600)
    x[300:] = torch.linspace(-3.0, 3.0, 300)
    values, scales = quantize(x, 256)
    out = torch.empty(600)
    dequantize_into(out, values, scales, 256)
    assert torch.equal(out[:256], torch.zeros(256))  # a zero block: scale 0, no division by zero
    assert scales[0] == 0
    assert out[-1] == pytest.approx(3.0, rel=1e-6) and out[300] == pytest.approx(-3.0, rel=1e-6)


def test_rows_of_several_ranks_dequantize_at_once():
    torch.manual_seed(1)
    parts = [torch.randn(300) for _ in range(3)]
    quantized = [quantize(p, 128) for p in parts]
    out = torch.empty(3, 300, dtype=torch.bfloat16)
    dequantize_into(out, torch.stack([v for v, _ in quantized]), torch.stack([s for _, s in quantized]), 128)
    for row, (values, scales) in zip(out, quantized):
        alone = torch.empty(300, dtype=torch.bfloat16)
        dequantize_into(alone, values, scales, 128)
        assert torch.equal(row, alone)


def test_config_and_deepspeed_mapping():
    settings = read_deepspeed_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    assert settings.zero.quantized_weights and settings.zero.stage == 3
    with pytest.raises(ValueError, match=r"zero.quantized_weights must be false unless zero.stage is 3, got True"):
        ZeroConfig(stage=2, quantized_weights=True)
    with pytest.raises(ValueError, match=r"zero.quantization_block_size must be an integer >= 1"):
        ZeroConfig(stage=3, quantized_weights=True, quantization_block_size=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": 2, "secondary_partition": True}, "zero.secondary_partition must be false unless zero.stage is 3"),
        ({"stage": 1, "quantized_gradients": True}, "zero.quantized_gradients must be false at zero.stage 1"),
        ({"stage": 3, "node_size": 0}, "zero.node_size must be null"),
        (
            {"stage": 3, "quantized_gradients": True, "shard_group_size": 2},
            "zero.shard_group_size must be null with zero.secondary_partition or zero.quantized_gradients",
        ),
    ],
)
def test_bad_zero_plus_plus_settings_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


def test_int4_packs_two_values_a_byte_within_half_a_step():
    torch.manual_seed(3)
    x = torch.randn(3, 301) * torch.logspace(-2, 1, 301)
    x[1, 70] = float("inf")
    packed, scales = quantize_int4(x, 64)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 151)
    out = torch.empty(3, 301)
    dequantize_int4_into(out, packed, scales, 64)
    assert not out[1, 64:128].isfinite().any() and out[1, 128:].isfinite().all()
    finite = torch.ones(3, 301, dtype=torch.bool)
    finite[1, 64:128] = False
    padded = torch.zeros(3, 320)
    padded[:, :301] = x.nan_to_num(posinf=0.0)
    bound = (padded.view(3, 5, 64).abs().amax(-1) / INT4_LEVELS / 2).repeat_interleave(64, dim=1)[:, :301]
    assert torch.all(((out - x).abs() <= bound * (1 + 1e-6) + 1e-7)[finite])

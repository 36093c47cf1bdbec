"""Tiled MLP and tiled loss (activations/tiled.py): equal to the whole computation (values and every gradient),
random numbers redrawn alike in the tiles' recomputation, autocast kept, and the memory they save measured with
torch's tracker (``MemTracker``, in bytes) on a GPT whose logits are its largest activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_zero.activations.checkpointing import UnitCheckpoints
from lightning_zero.activations.tiled import tiled_cross_entropy, tiled_mlp
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.support.compare import relative_error


def _mlp(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Dropout(dropout))


def _grads(mlp: nn.Module, tiles: int, weight: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    x = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight.grad = None
    torch.manual_seed(2)
    loss = tiled_cross_entropy(tiled_mlp(mlp, x, tiles), weight, target, tiles)
    params = [x, weight, *mlp.parameters()]
    return [loss.detach(), *torch.autograd.grad(loss, params)]


def test_tiles_give_the_whole_computation_and_its_gradients():
    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    target = torch.randint(50, (2, 10), generator=torch.Generator().manual_seed(4))
    target[0, 6:] = -100  # (padding: left out of the sum)
    mlp = _mlp(0.0)
    whole = _grads(mlp, 1, weight, target)
    x = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(1))
    expected = F.cross_entropy(F.linear(mlp(x), weight.detach()).flatten(0, 1), target.flatten(), reduction="sum")
    assert relative_error(whole[0], expected) <= 1e-6
    for tiles in (3, 10):  # (uneven tiles, and tiles of one token)
        tiled = _grads(mlp, tiles, weight, target)
        for name, a, b in zip(["loss", "x", "weight", "w1", "b1", "w2", "b2"], tiled, whole):
            assert relative_error(a, b) <= 1e-6, (tiles, name)


def test_a_tile_recomputed_in_backward_draws_its_forward_random_numbers():
    """With dropout each tile draws its own mask, and backward must see those masks again: the gradients equal
    those of the same tiles run one by one under autograd from the same seed."""
    mlp = _mlp(0.5)
    x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(5)
    tiled = tiled_mlp(mlp, x, 3)
    tiled_grads = torch.autograd.grad(tiled.square().sum(), [x, *mlp.parameters()])
    torch.manual_seed(5)
    by_hand = torch.cat([mlp(piece) for piece in x.chunk(3, dim=1)], dim=1)
    hand_grads = torch.autograd.grad(by_hand.square().sum(), [x, *mlp.parameters()])
    assert torch.equal(tiled, by_hand) and (tiled == 0).any()  # (dropout active)
    assert all(relative_error(a, b) <= 1e-6 for a, b in zip(tiled_grads, hand_grads))


def test_a_tile_recomputed_in_backward_runs_under_the_forwards_autocast():
    def grads(tiles: int, dtypes: list) -> list[torch.Tensor]:
        mlp, x = _mlp(0.0), torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        mlp[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tiled_mlp(mlp, x, tiles)
        return torch.autograd.grad(out.float().square().sum(), [x, *mlp.parameters()])

    dtypes: list[torch.dtype] = []
    whole, tiled = grads(1, []), grads(4, dtypes)
    assert dtypes == [torch.bfloat16] * 8  # (4 tiles forward, the same 4 recomputed in backward)
    assert all(a.dtype == torch.float32 and relative_error(a, b) <= 5e-3 for a, b in zip(tiled, whole))


def test_parameter_hooks_see_the_summed_gradient_once_and_bf16_tiles_sum_in_fp32():
    calls = []
    mlp = _mlp(0.0)
    mlp[0].weight.register_hook(lambda g: calls.append(1) or g * 0.5)
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(1))
    tiled_mlp(mlp, x, 3).square().sum().backward()
    tiled = mlp[0].weight.grad.clone()
    mlp[0].weight.grad = None
    mlp(x).square().sum().backward()
    assert len(calls) == 2 and relative_error(tiled, mlp[0].weight.grad) <= 1e-6  # (once per backward, halved)

    def weight_grad(tiles: int, dtype: torch.dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed(2)
        hidden, weight = torch.randn(1, 256, 16, generator=g), torch.randn(64, 16, generator=g)
        weight = weight.to(dtype).requires_grad_()
        target = torch.randint(64, (1, 256), generator=g)
        return torch.autograd.grad(tiled_cross_entropy(hidden.to(dtype), weight, target, tiles), [weight])[0]

    exact = weight_grad(1, torch.float64)
    one, many = (relative_error(weight_grad(tiles, torch.bfloat16), exact) for tiles in (1, 64))
    assert many <= 1.5 * one, (one, many)  # (64 bf16 sums would double the error)


def test_without_gradients_the_mlp_runs_tile_by_tile_too():
    mlp, x = _mlp(0.0), torch.randn(1, 12, 8)
    calls = []
    mlp[0].register_forward_hook(lambda module, args, out: calls.append(out.shape[1]))
    with torch.no_grad():
        out = tiled_mlp(mlp, x, 3)
    assert calls == [4, 4, 4] and relative_error(out, mlp(x)) <= 1e-6


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_bad_tiles_are_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="tiles must be an integer >= 1"):
        tiled_mlp(_mlp(0.0), torch.randn(1, 4, 8), bad)
    with pytest.raises(ValueError, match="model.mlp_tiles must be an integer >= 1"):
        GPTConfig(mlp_tiles=bad)


# the logits (vocab 2048, fp32) dwarf the blocks' activations, as at Llama's vocabulary and a long sequence
WIDE = dict(vocab_size=2048, block_size=256, n_layer=2, n_head=2, n_embd=32)


def _peak(tiles: int) -> tuple[int, list[torch.Tensor]]:
    """Peak activation and temporary bytes (MemTracker) of a checkpointed step of the GPT with ``tiles`` tiles."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**WIDE, mlp_tiles=tiles, loss_tiles=tiles))
    UnitCheckpoints(list(model.blocks), selective=False)
    tokens = torch.randint(2048, (1, 256), generator=torch.Generator().manual_seed(1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(tokens, tokens).backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return sum(v for k, v in peak.items() if str(k).endswith(("ACT", "TEMP"))), [p.grad for p in model.parameters()]


def test_tiling_the_loss_and_mlp_keeps_the_logits_from_existing_whole():
    whole, whole_grads = _peak(1)
    tiled, tiled_grads = _peak(8)
    logits = 256 * 2048 * 4  # one [1, 256, 2048] fp32 tensor: the untiled step holds several at once
    assert whole >= 2 * logits and tiled <= whole / 4, (whole, tiled)
    assert all(relative_error(a, b) <= 1e-5 for a, b in zip(tiled_grads, whole_grads))

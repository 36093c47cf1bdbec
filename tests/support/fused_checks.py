"""The fused kernels against their plain PyTorch counterparts, on any device: the fused GPT against the plain one,
and FusedAdamW against torch.optim.AdamW under a GradScaler (the CPU reference, emulator and GPU tests share them).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from lightning_zero.kernels.adamw import FusedAdamW
from lightning_zero.models.gpt import GPT, GPTConfig


def check_fused_gpt(cfg: dict, batch: int, device: str = "cpu", *, out_tol: float, rtol: float, atol: float) -> None:
    """GPTConfig(fused=True) against the plain GPT with the same weights: the logits (within ``out_tol``), then
    every parameter's gradient (``rtol``/``atol``)."""
    torch.manual_seed(0)
    plain, fused = GPT(GPTConfig(**cfg)).to(device), GPT(GPTConfig(**cfg, fused=True)).to(device)
    fused.load_state_dict(plain.state_dict())
    assert type(fused.blocks[0]).__name__ == "FusedBlock"
    idx = torch.randint(cfg["vocab_size"], (batch, cfg["block_size"]), device=device)
    out_plain, out_fused = plain(idx), fused(idx)
    torch.testing.assert_close(out_fused, out_plain, rtol=out_tol, atol=out_tol)
    out_plain.square().mean().backward()
    out_fused.square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=rtol, atol=atol, msg=name)


def check_fused_adamw_under_grad_scaler(
    device: str = "cpu", guard=contextlib.nullcontext, unscale_in_step: bool = True
) -> None:
    """FusedAdamW and torch.optim.AdamW, each under its own GradScaler, on the same scaled losses; step 2's
    gradients hold an inf, so both skip it and back their scale off. FusedAdamW's step (inside ``guard``,
    e.g. a CUDA sync check) must land on torch's parameters, with its step counts on the device, 4 of 5
    (``unscale_in_step=False``: the scaler unscales and skips itself; the counts stay on the host)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(17, 9), nn.Linear(9, 3)).to(device)
    twin = nn.Sequential(nn.Linear(17, 9), nn.Linear(9, 3)).to(device)
    twin.load_state_dict(model.state_dict())
    mine = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, unscale_in_step=unscale_in_step)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    # the scale changes every step: a step that did not unscale would land elsewhere
    scalers = [torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=1) for _ in range(2)]
    for step in range(5):
        x = torch.randn(5, 17, device=device)
        runs = ((model, mine, scalers[0], guard), (twin, theirs, scalers[1], contextlib.nullcontext))
        for net, opt, scaler, context in runs:
            opt.zero_grad()
            scaler.scale(net(x).square().mean()).backward()
            if step == 2:
                net[0].weight.grad[0, 0] = float("inf")
            with context():
                scaler.step(opt)
                scaler.update()
    # grown after steps 0, 1, 3 and 4, backed off at step 2
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**13, [s.get_scale() for s in scalers]
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        count = mine.state[p]["step"]
        assert count.device == (p.device if unscale_in_step else torch.device("cpu")), count.device
        assert count.item() == 4.0, count

"""Which optimizers the ZeRO strategies can shard: those that update every element on its own.

A ZeroOptimizer hands the user's optimizer this rank's *pieces* of each parameter (1-D views into the
master partition). An elementwise update (SGD, Adam, AdamW, ...) gives the same values on pieces as
on whole tensors; an update that depends on a tensor's shape or norm (Adafactor's factored moments,
Shampoo's preconditioners, LAMB's and LARS's trust ratios, Muon's orthogonalization) silently gives
different ones. Known elementwise optimizers are accepted by type; any other is probed: a few steps on
a matrix and a vector, once whole and once split into pieces, must agree.
"""

from __future__ import annotations

import inspect

import torch
from torch.optim import Optimizer

from lightning_zero.kernels.adamw import FusedAdamW

ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    FusedAdamW,
)
_PIECES = ((11, 19), (3, 4))  # how the probe splits its (5, 6) matrix and its 7-vector


def _probe_error(cls: type[Optimizer], defaults: dict) -> float:
    """Largest relative difference between stepping whole tensors and stepping them in pieces."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 6), (7,)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]

    whole = [torch.nn.Parameter(t.clone()) for t in start]
    flat = [torch.cat([t.reshape(-1) for t in start])]
    pieces, offset = [], 0
    for sizes in _PIECES:
        for n in sizes:
            pieces.append(torch.nn.Parameter(flat[0][offset : offset + n].clone()))
            offset += n
    optimizers = [cls(whole, **defaults), cls(pieces, **defaults)]
    for step in grads:
        for p, g in zip(whole, step):
            p.grad = g.clone()
        split = torch.cat([g.reshape(-1) for g in step]).split([n for sizes in _PIECES for n in sizes])
        for p, g in zip(pieces, split):
            p.grad = g.clone()
        for optimizer in optimizers:
            optimizer.step()
    a = torch.cat([p.detach().reshape(-1) for p in whole])
    b = torch.cat([p.detach().reshape(-1) for p in pieces])
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))


def check_elementwise(optimizer: Optimizer) -> None:
    """Raises a ValueError naming the optimizer unless its update is elementwise."""
    cls = type(optimizer)
    if cls in ELEMENTWISE:
        return
    name = f"{cls.__module__}.{cls.__qualname__}"
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in parameters}
    try:
        error = _probe_error(cls, defaults)
    except Exception as failure:  # noqa: BLE001 - any failure means we could not verify it
        raise ValueError(
            f"the ZeRO strategies need an optimizer that updates each element on its own, and {name} could not be"
            f" checked ({type(failure).__name__}: {failure}); use one of"
            f" {', '.join(c.__name__ for c in ELEMENTWISE)}, or the ddp strategy"
        ) from failure
    if not error <= 1e-6:
        raise ValueError(
            f"the ZeRO strategies shard every parameter across ranks, so the optimizer must update each element on"
            f" its own; {name} does not (stepping a tensor in pieces differs from stepping it whole by {error:.1e}):"
            " its update depends on the parameter's shape or norm, as Adafactor's, Shampoo's, LAMB's and Muon's do."
            " Use an elementwise optimizer (AdamW, SGD, ...) or the ddp strategy"
        )

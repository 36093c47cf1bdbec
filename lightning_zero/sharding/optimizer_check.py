"""Which optimizers the ZeRO strategies can shard: those that update every element on its own.

A ZeroOptimizer hands the user's optimizer this rank's *pieces* of each parameter (1-D views into the
master partition). An elementwise update (SGD, Adam, AdamW, ...) gives the same values on pieces as
on whole tensors; an update that depends on a tensor's shape or norm (Adafactor's factored moments,
Shampoo's preconditioners, LAMB's and LARS's trust ratios, Muon's orthogonalization) silently gives
different ones. Known elementwise optimizers are accepted by type, torch's others refused with the reason;
any other is probed: a few steps on a matrix and a vector, once whole and once split into pieces, must agree.

State an optimizer holds when it is handed over (Adagrad fills its sum and step count in ``__init__``; a state
loaded before ``fabric.setup``) is kept: each rank keeps its pieces of the per-element values, exactly the
elements a single process would hold for them, and the scalars as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.kernels.adamw import FusedAdamW
from lightning_zero.sharding.flat_unit import FlatUnit

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
# torch's optimizers that are not elementwise, by name (some are newer than the oldest torch supported); SparseAdam,
# which steps sparse gradients only, fails the probe with torch's own reason
REFUSED = {
    "Adafactor": "its update depends on the parameter's shape: it factors each matrix's second moment",
    "Muon": "its update depends on the parameter's shape: it orthogonalizes each matrix's update as a whole",
    "LBFGS": "its update depends on every parameter at once, through dot products of whole gradients",
}
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
    if getattr(torch.optim, cls.__name__, None) is cls and cls.__name__ in REFUSED:
        raise ValueError(
            f"the ZeRO strategies shard every parameter across ranks, so the optimizer must update each element on"
            f" its own; {name} does not ({REFUSED[cls.__name__]}). Use an elementwise optimizer (AdamW, SGD, ...) or"
            " the ddp strategy"
        )
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


def shard_held_state(state: dict[Tensor, dict], locate: Mapping[Parameter, tuple[FlatUnit, int]]) -> None:
    """Replaces the state ``state`` holds for whole parameters by this rank's pieces of it (see the module's
    docstring); the state of frozen parameters, and of those this rank owns no part of, goes. Raises a
    ValueError, on every rank alike, for a tensor that is neither a scalar nor shaped like its parameter."""
    held = {param: state.pop(param) for param in list(state)}
    for param, values in held.items():
        if param not in locate:  # frozen: never stepped
            continue
        unit, index = locate[param]
        cut = {key: _per_element(key, value, param, unit.names[index]) for key, value in values.items()}
        piece, tensor = unit.training.piece_of(index)
        if tensor is not None:  # copies (the whole tensors go) in the piece's dtype, as torch's load_state_dict casts
            own = slice(piece.lo, piece.hi)
            device = "cpu" if tensor.is_meta else tensor.device  # (a master on NVMe: swapped.py writes it there)
            state[tensor] = {
                k: v.reshape(-1)[own].to(device, tensor.dtype, copy=True) if cut[k] else v for k, v in values.items()
            }


def _per_element(key: str, value: Any, param: Parameter, name: str) -> bool:
    """True when ``value`` holds one value per element of ``param`` (a 0-d parameter's "step" is its step count, as
    in torch's optimizers), False for a scalar or what is not a tensor; raises a ValueError for any other tensor."""
    if torch.is_tensor(value) and value.shape == param.shape:
        return param.dim() > 0 or key != "step"
    if torch.is_tensor(value) and value.numel() > 1:
        raise ValueError(
            f"the optimizer's state {key!r} of {name} has shape {list(value.shape)}, neither a scalar nor one value per"
            f" element of the parameter's {list(param.shape)}: the ZeRO strategies cannot shard it"
        )
    return False

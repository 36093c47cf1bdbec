"""``gathered_parameters``: read (or write) whole parameters under any strategy, in the same code; and
``parameter_norms``, which needs no gathering.

Under stage 3 a parameter read outside a step raises (sharding/sharded_param.py); code that must read one
there (an EMA kept in a callback, a weight norm logged at an epoch's end, initializing a layer from a
callback) reads it inside ``with lightning_zero.gathered_parameters(pl_module):``, entered on every rank.
Under the ZeRO strategies that is ``ZeroStrategy.gathered_parameters``; under any other strategy (``ddp``,
one device) the parameters are whole already and the block just runs, so the code need not change when
the strategy does.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn import Module, Parameter

from lightning_zero.front.strategy import ZeroStrategy


def parameter_norms(module: pl.LightningModule, norm_type: float | int = 2.0) -> dict[str, Tensor]:
    """Each parameter's ``norm_type``-norm and their total (``weight_{p}_norm/<name>``, ``weight_{p}_norm_total``,
    as Lightning's ``grad_norm`` names gradients'), under any strategy: under the ZeRO strategies from the shards,
    with one all-reduce and nothing gathered (collective: on every rank, in or between steps); elsewhere from
    the whole parameters."""
    strategy = module.trainer.strategy if module._trainer is not None else None
    if isinstance(strategy, ZeroStrategy):
        return strategy.parameter_norms(norm_type)
    key = f"weight_{float(norm_type)}_norm"
    out = {f"{key}/{n}": p.detach().norm(norm_type) for n, p in module.named_parameters()}
    out[f"{key}_total"] = torch.stack(list(out.values())).norm(norm_type)
    return out


@contextmanager
def gathered_parameters(
    module: pl.LightningModule, *targets: Module | Parameter, modifier_rank: int | None = None
) -> Generator[list[Parameter], None, None]:
    """The parameters of ``targets`` (default: all of ``module``'s) whole inside the block; see
    ``ZeroStrategy.gathered_parameters`` (collective under the ZeRO strategies)."""
    targets = targets or (module,)
    strategy = module.trainer.strategy if module._trainer is not None else None
    if isinstance(strategy, ZeroStrategy):
        with strategy.gathered_parameters(*targets, modifier_rank=modifier_rank) as params:
            yield params
        return
    yield list(dict.fromkeys(p for t in targets for p in (t.parameters() if isinstance(t, Module) else [t])))

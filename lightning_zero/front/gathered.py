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
    the whole parameters. Use it to log weight norms under stage 3, where a parameter cannot be read outside a step.

    Args:
        module: the LightningModule whose parameters are measured.
        norm_type: the p of the p-norm (2.0: the L2 norm).

    Returns:
        Parameter name (prefixed as above) -> its norm, a scalar tensor, and the total under ``..._total``.

    Raises:
        ValueError: under the ZeRO strategies, a ``norm_type`` that is not a finite number > 0.

    Example:
        ```python
        self.log_dict(lightning_zero.parameter_norms(self))  # in a hook every rank runs
        ```
    """
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
    """The parameters of ``targets`` (default: all of ``module``'s) whole inside the block, under any strategy;
    see ``ZeroStrategy.gathered_parameters`` (collective under the ZeRO strategies: enter it on every rank, with
    the same targets). Under the ZeRO strategies a write made inside is kept: the values of the lowest rank that
    wrote a tensor, or of ``modifier_rank``, become every rank's (the shards and fp32 masters included). Under any
    other strategy the parameters are whole already and the block just runs.

    Args:
        module: the LightningModule (its trainer's strategy decides what is gathered).
        *targets: modules (with their submodules) or parameters to gather; none: all of ``module``'s.
        modifier_rank: the rank whose values of every gathered parameter are kept (DeepSpeed's idiom: that
            rank alone edits); None: each written tensor's lowest writing rank.

    Yields:
        The gathered parameters, each once.

    Raises:
        RuntimeError: under the ZeRO strategies, a write (or a ``modifier_rank``) inside a validation, test or
            predict step; at stage 3, a write (or a ``modifier_rank``) inside a training step with
            ``ZeroConfig(quantized_weights=True)``.
        ValueError: under the ZeRO strategies, a parameter's ``.data`` replaced inside by a tensor of another
            shape (raised on every rank).

    Example:
        ```python
        with lightning_zero.gathered_parameters(pl_module, pl_module.head):  # on every rank
            torch.nn.init.zeros_(pl_module.head.bias)  # whole here; the write is kept
        ```
    """
    targets = targets or (module,)
    strategy = module.trainer.strategy if module._trainer is not None else None
    if isinstance(strategy, ZeroStrategy):
        with strategy.gathered_parameters(*targets, modifier_rank=modifier_rank) as params:
            yield params
        return
    yield list(dict.fromkeys(p for t in targets for p in (t.parameters() if isinstance(t, Module) else [t])))

"""Gradient norms under ZeRO, where no rank holds a parameter's whole gradient.

- ``ZeroOptimizer.grad_norm()``: the global L2 norm (what clipping uses), anywhere in a step.
- ``grad_norm(pl_module, norm_type)``: Lightning's ``lightning.pytorch.utilities.grad_norm`` result
  (``grad_{p}_norm/<name>`` per parameter and ``grad_{p}_norm_total``), computed from the shards with
  one all-reduce of per-parameter partial sums. Collective: call it on every rank.
- Inside ``on_before_optimizer_step`` each trainable parameter's ``.grad`` is a ``ShardedGrad``:
  ``p.grad.norm(norm_type)`` (what Lightning's own ``grad_norm`` utility does) returns the true norm, and any
  other use raises an error that says what to do instead, rather than silently seeing nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_zero.sharding.zero_optimizer import ZeroOptimizer

_METADATA = {"size", "dim", "numel", "nelement", "element_size", "__len__", "__repr__", "__format__"}


class ShardedGrad(Tensor):
    """A parameter's ``.grad`` during ``on_before_optimizer_step`` under ZeRO (no storage of its own)."""

    param_name: str
    norms_of: Callable[[float], dict[str, Tensor]]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is torch._C.TensorBase.data:
            return args[0]  # ``p.grad.data`` stays a ShardedGrad
        if func is Tensor.norm or func is torch.norm:
            norm_type = args[1] if len(args) > 1 else kwargs.get("p", 2.0)
            return args[0].norms_of(float(norm_type))[f"grad_{float(norm_type)}_norm/{args[0].param_name}"]
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in _METADATA:
            if name == "__repr__":
                return f"ShardedGrad({args[0].param_name!r}, shape={tuple(args[0].shape)})"
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise RuntimeError(
            f"the gradient of {args[0].param_name!r} is sharded across ranks by the ZeRO strategy, so `{name}` cannot"
            " read it. Use `p.grad.norm(2)` (any norm type) or `lightning_zero.grad_norm(self)` for norms, the"
            " optimizer's `grad_norm()` for the global norm, and Trainer(gradient_clip_val=...) to clip"
        )


def _holder(module: pl.LightningModule) -> dict[int, ZeroOptimizer]:
    optimizers = [getattr(o, "_optimizer", o) for o in module.trainer.strategy.optimizers]
    return {id(p): z for z in optimizers if isinstance(z, ZeroOptimizer) for p in z.module_params()}


def grad_norm(module: pl.LightningModule, norm_type: float | int | str = 2.0) -> dict[str, Tensor]:
    """Like ``lightning.pytorch.utilities.grad_norm`` for a LightningModule trained with a ZeRO strategy: each
    parameter's gradient norm and their total, computed from the shards with one all-reduce, nothing gathered.
    Collective: call it on every rank, inside a step once the gradients exist (``on_before_optimizer_step``).

    Args:
        module: the LightningModule being trained.
        norm_type: the p of the p-norm (a number, or a string ``float`` reads, such as "2").

    Returns:
        ``grad_{p}_norm/<name>`` -> the norm of each parameter the ZeRO optimizers train, and
        ``grad_{p}_norm_total``; empty where no optimizer is a ZeRO one.

    Raises:
        ValueError: ``norm_type`` is not a number, or (with ZeRO optimizers) not a finite number > 0.
        RuntimeError: ``module`` is not attached to a Trainer.

    Example:
        ```python
        def on_before_optimizer_step(self, optimizer):
            self.log_dict(lightning_zero.grad_norm(self, norm_type=2))
        ```
    """
    norm_type = float(norm_type)
    holders = _holder(module)
    out: dict[str, Tensor] = {}
    for zero in dict.fromkeys(holders.values()):
        out.update({k: v for k, v in zero.grad_norms_by_param(norm_type).items() if "_norm/" in k})
    if out:
        total = torch.stack(list(out.values())).norm(norm_type)
        out[f"grad_{norm_type}_norm_total"] = total
    return out


@contextmanager
def sharded_grads(module: pl.LightningModule, optimizers: Sequence[Any]) -> Iterator[None]:
    """Gives the trainable parameters of ``optimizers`` a ``ShardedGrad`` for the duration of the block."""
    cache: dict[tuple[int, float], dict[str, Tensor]] = {}
    names = {id(p): n for n, p in module.named_parameters()}
    zeros = [z for z in optimizers if isinstance(z, ZeroOptimizer)]
    params = [(p, z) for z in zeros for p in z.params_with_grads()]

    def norms_for(zero: ZeroOptimizer) -> Callable[[float], dict[str, Tensor]]:
        def norms(norm_type: float) -> dict[str, Tensor]:
            if (id(zero), norm_type) not in cache:
                cache[(id(zero), norm_type)] = zero.grad_norms_by_param(norm_type)
            return cache[(id(zero), norm_type)]

        return norms

    for p, zero in params:
        grad = Tensor._make_subclass(ShardedGrad, torch.empty(1, dtype=p.dtype, device=p.device).expand(p.shape))
        grad.param_name = names.get(id(p), "?")
        grad.norms_of = norms_for(zero)
        p.grad = grad
    try:
        yield
    finally:
        for p, _ in params:
            p.grad = None

"""What a stage-3 parameter is while its unit is not gathered: a ``ShardedParameter``.

[Note: reading a sharded parameter]
While its unit's values are not on this rank (freed, or a gather still in flight) a parameter's class is a
``ShardedParameter`` subclass made for its runtime (``Stage3Runtime`` swaps the class of the parameter
object itself, as ``fully_shard`` swaps a module's; the object, its identity and its place in optimizers
and modules stay). Whatever only looks at it (shape, dtype, device, ``numel``, ``requires_grad``, hooks)
works as on the whole model. Whatever reads its values goes through ``__torch_function__`` first:

- inside a step (training, validation, test or predict; not in backward), the unit is gathered there and
  kept until the step ends, as when the parameter is read as a module attribute (``schedule.access``).
  So ``sum(p.pow(2).sum() for p in self.parameters())``, ``self.log("norm", ...)`` over
  ``named_parameters()`` or a ``state_dict()`` taken in a step see the real values, and a penalty's
  backward finds them still gathered. Collective, like every gather: every rank reads the same parameters
  in the same order (the same code on every rank does);
- anywhere else (callbacks between steps, after ``fit``, rank 0 alone) it raises one error that names the
  parameter and the ways to read it: ``lightning_zero.gathered_parameters(pl_module, ...)`` on every rank,
  ``trainer.strategy.full_state_dict()`` or, after ``fit``, ``gather_module()``. A NaN
  never reaches user code.

One exception: ``torch.equal`` between parameters outside a step answers by identity (a parameter equals
itself, and no other), without reading: Lightning's finetuning callbacks use it to find a parameter among
an optimizer's (``BaseFinetuning.filter_on_optimizer``), between steps.

Once the unit's values are here the class is the parameter's own again, so a unit's forward costs nothing
extra.

[Note: a read after the unit's forward]
A unit whose forward has returned may stay gathered a while (until the next entry or the end of the forward
pass frees it). A parameter read then without attribute access (``self.parameters()`` in a penalty iterates
``_parameters.items()``, which ``GatherOnAccess`` never sees) would save the gathered tensor for its backward
with nothing keeping it gathered: freed when the forward pass ends, it would be the NaN placeholder when the
penalty's backward (created later, so run before the unit's own) reads it. So when a unit's forward returns,
its parameters take the sharded class while the unit is still gathered: a read goes through ``read`` and pins
the unit until the step ends, as any other read in a step (its gather is then a no-op); its next entry
(forward, backward or recomputation) waits for it, which gives them their own class back.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.utils._pytree import tree_leaves

# Methods that look at a tensor without reading its values.
_METADATA = {
    "size",
    "dim",
    "numel",
    "nelement",
    "element_size",
    "stride",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "get_device",
    "data_ptr",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "requires_grad_",
    "retain_grad",
    "__len__",
    "__hash__",
}
# Properties that hand out the values (or a view of them); every other property is metadata.
_VALUES = {"data", "T", "mT", "H", "mH", "real", "imag"}


class Reader(Protocol):
    """What a sharded parameter's class asks when its values are used (``Stage3Runtime``)."""

    def can_read(self) -> bool:
        """Whether ``read`` would gather (in a step) rather than raise."""

    def read(self, param: Tensor) -> None:
        """Makes ``param``'s values valid here, or raises."""

    def replace(self, param: Tensor, value: Tensor) -> bool:
        """``param.data = value``: True if kept as a write."""

    def describe(self, param: Tensor) -> str:
        """The parameter's name."""


class ShardedParameter(Parameter):
    """Base of the classes a stage-3 runtime gives its parameters while they are not gathered."""

    reader: Reader
    original: type

    @classmethod
    def of(cls, original: type, reader: Reader) -> type:
        """The class for ``original`` parameters (``Parameter`` or a subclass) of ``reader``'s units."""
        return type(f"Sharded{original.__name__}", (cls, original), {"reader": reader, "original": original})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        attribute = getattr(getattr(func, "__self__", None), "__name__", None)
        if name == "__set__" and attribute == "data" and cls.reader.replace(args[0], args[1]):
            return None  # user code's ``p.data = t``: kept as a write (see [Note: a replaced .data] in param_writes.py)
        if name == "__get__":
            reads = attribute in _VALUES
        else:  # (setting ``.data`` or ``.grad`` is how the runtime itself re-points a parameter: not a read)
            reads = name not in _METADATA and name not in ("__set__", "__delete__")
        if name == "__repr__":
            param = args[0]
            return f"ShardedParameter({cls.reader.describe(param)!r}, shape={tuple(param.shape)}, not gathered here)"
        if func in (torch.equal, Tensor.equal) and len(args) == 2 and not cls.reader.can_read():
            return args[0] is args[1]  # see the module's Note
        if reads:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, ShardedParameter):
                    type(leaf).reader.read(leaf)  # gathers in a step (the class is then the original), else raises
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def original_class(param: Tensor) -> type:
    """``param``'s own class: the one it had before it took a sharded class, or its class if it has none."""
    cls = type(param)
    return cls.original if issubclass(cls, ShardedParameter) else cls


def read_error(name: str, where: str) -> RuntimeError:
    """The error (returned, not raised) for a read of parameter ``name``'s values ``where`` it is not gathered, naming
    the ways to read or write it."""
    return RuntimeError(
        f"{name!r} is sharded across ranks by the ZeRO strategy (stage 3) and is not gathered {where}: its values"
        " can be read inside a training/validation/test/predict step, inside `with"
        " lightning_zero.gathered_parameters(pl_module, *modules_or_params):` entered on every rank, through"
        " trainer.strategy.full_state_dict() (every rank), or after fit through"
        " trainer.strategy.gather_module(); lightning_zero.parameter_norms(pl_module) needs no gathering. To write"
        " one, write it inside gathered_parameters on every rank: the write is kept (the lowest rank that wrote"
        " gives every rank its values)"
    )

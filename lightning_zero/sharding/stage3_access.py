"""Stage 3's module-level hooks into a model: gathering a sharded parameter read as an attribute, and finding the
tensors a module's forward returned (whose gradients start a unit's backward)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module

if TYPE_CHECKING:
    from lightning_zero.sharding.stage3 import Stage3Runtime


def output_tensors(output: Any, depth: int = 0) -> Iterator[Tensor]:
    """The tensors in a module's output: nested tuples, lists, dicts (a Hugging Face ``ModelOutput``),
    dataclasses and plain objects' attributes."""
    if isinstance(output, Tensor):
        yield output
    elif depth > 8 or output is None or isinstance(output, (str, bytes, int, float, bool)):
        return
    elif isinstance(output, Mapping):
        for value in output.values():
            yield from output_tensors(value, depth + 1)
    elif isinstance(output, (tuple, list, set)):
        for value in output:
            yield from output_tensors(value, depth + 1)
    elif dataclasses.is_dataclass(output):
        for field in dataclasses.fields(output):
            yield from output_tensors(getattr(output, field.name), depth + 1)
    elif hasattr(output, "__dict__") and not isinstance(output, Module):
        for value in vars(output).values():
            yield from output_tensors(value, depth + 1)


class GatherOnAccess(dict):
    """A module's ``_parameters``: reading a sharded parameter as an attribute makes it whole first."""

    def __init__(self, runtime: Stage3Runtime, params: dict) -> None:
        super().__init__(params)
        self.runtime = runtime

    def __getitem__(self, name: str) -> Any:
        param = super().__getitem__(name)
        if not torch.compiler.is_compiling():  # see [Note: compiled models]
            self.runtime.on_access(param)
        return param

"""The start and end of a backward pass: events every rank sees at the same point of its schedule.

[Note: end of backward]
What no hook has reduced yet (stage-2 buckets still filling, stage-3 entries not finished, the root
unit) is reduced when backward ends, in an order fixed by the layouts. That callback is queued with
the autograd engine (``queue_callback``) when the backward starts: by a hook on the loss, which the
strategy registers before Lightning's backward, or else by the first gradient hook that runs. It
runs inside the same ``backward()`` call, after every gradient was accumulated and before it
returns, so ``on_after_backward`` and code after a plain ``loss.backward()`` see reduced gradients.
A reentrant activation checkpoint runs an inner backward (a separate graph task); the hook on the
loss makes sure the callback belongs to the outer one. ``on_begin`` callbacks run when the backward
starts (inside it, where ``torch._C._will_engine_execute_node`` can tell which gradients will come).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def in_backward() -> bool:
    """Whether the caller runs inside the autograd engine (a hook, or a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class BackwardEnd:
    def __init__(self) -> None:
        self.on_begin: list[Callable[[], None]] = []
        self.on_end: list[Callable[[], None]] = []
        self._armed = False

    @property
    def armed(self) -> bool:
        """Between the start of a backward and its end callback."""
        return self._armed

    def arm(self) -> None:
        """Called from inside a backward: runs ``on_begin`` and queues ``on_end`` once per backward."""
        if self._armed:
            return
        self._armed = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end)
        for callback in self.on_begin:
            callback()

    def arm_on(self, loss: Tensor) -> None:
        """Arms at the very start of ``loss``'s backward (in its outer graph task)."""
        if isinstance(loss, Tensor) and loss.requires_grad:
            loss.register_hook(self._arm_hook)

    def _arm_hook(self, grad: Tensor) -> None:
        self.arm()

    def _end(self) -> None:
        self._armed = False
        for callback in self.on_end:
            callback()

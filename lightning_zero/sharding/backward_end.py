"""The start and end of a backward pass: events every rank sees at the same point of its schedule.

[Note: end of backward]
What no hook has reduced yet (stage-2 buckets still filling, stage-3 entries not finished, the root
unit) is reduced when backward ends, in an order fixed by the layouts. That callback is queued with
the autograd engine (``queue_callback``) when the backward starts: by a hook on the loss, which the
strategy registers before Lightning's backward, or else by the first gradient hook that runs. It
runs inside the same ``backward()`` call, after every gradient was accumulated and before it
returns, so ``on_after_backward`` and code after a plain ``loss.backward()`` see reduced gradients.
A reentrant activation checkpoint runs an inner backward (a separate graph task); the hook on the
loss makes sure the callback belongs to the outer one. Begin callbacks run when the backward
starts (inside it, where ``torch._C._will_engine_execute_node`` can tell which gradients will come). Work
is registered by name (``BackwardWork``), which fixes its order.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import Tensor


def in_backward() -> bool:
    """Whether the caller runs inside the autograd engine (a hook, or a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class BackwardWork(enum.IntEnum):
    """Who works at a backward's start and end, in this order: stage 3's schedule finishes its backward (it
    reduces what it still holds) before the gradient reducer launches what is left and waits for everything."""

    SCHEDULE = 1
    REDUCTION = 2


class BackwardEnd:
    """Runs the registered work when a backward starts and ends, and when one that raised is forgotten (see the
    Note above)."""

    def __init__(self) -> None:
        self._begin: dict[BackwardWork, list[Callable[[], None]]] = {work: [] for work in BackwardWork}
        self._end: dict[BackwardWork, list[Callable[[], None]]] = {work: [] for work in BackwardWork}
        self._raised: dict[BackwardWork, list[Callable[[], None]]] = {work: [] for work in BackwardWork}
        self._armed = False

    def register(
        self,
        work: BackwardWork,
        *,
        begin: Callable[[], None] | None = None,
        end: Callable[[], None] | None = None,
        raised: Callable[[], None] | None = None,
    ) -> None:
        """``begin`` runs when a backward starts, ``end`` when it ends, ``raised`` when one that raised before its end
        is forgotten (``forget_raised``), each in ``BackwardWork``'s order."""
        for callbacks, fn in ((self._begin, begin), (self._end, end), (self._raised, raised)):
            if fn is not None:
                callbacks[work].append(fn)

    def unregister(self, *callbacks: Callable[[], None]) -> None:
        """Removes ``callbacks`` wherever they were registered (begin, end or raised)."""
        for registered in (*self._begin.values(), *self._end.values(), *self._raised.values()):
            for fn in callbacks:
                if fn in registered:
                    registered.remove(fn)

    @property
    def armed(self) -> bool:
        """Between the start of a backward and its end callback."""
        return self._armed

    def arm(self) -> None:
        """Called from inside a backward: runs the begin callbacks and queues the end ones once per backward."""
        if self._armed:
            return
        self._armed = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_callbacks)
        for work in BackwardWork:
            for callback in self._begin[work]:
                callback()

    def forget_raised(self) -> None:
        """Outside a backward (the front door's next event): if the last one raised before its end (it stayed armed, and
        the loop went on), its work is told and the next backward arms afresh."""
        if self._armed and not in_backward():
            self._armed = False
            for work in BackwardWork:
                for callback in self._raised[work]:
                    callback()

    def arm_on(self, loss: Tensor) -> None:
        """Arms at the very start of ``loss``'s backward (in its outer graph task)."""
        if isinstance(loss, Tensor) and loss.requires_grad:
            loss.register_hook(self._arm_hook)

    def _arm_hook(self, grad: Tensor) -> None:
        self.arm()

    def _end_callbacks(self) -> None:
        self._armed = False
        for work in BackwardWork:
            for callback in self._end[work]:
                callback()

"""Stages 1 and 2: the all-gathers that spread each rank's updated parameters after a step.

[Note: post-step gathers]
After the optimizer step every rank holds the new values of its own chunk of each bucket only; one
all-gather per bucket makes the flat buffers (which the model's parameters view) whole again. They
are all launched right after the step, in the order the forward first uses the buckets (the reverse
of the agreed reduce order, so the same on every rank), and each is waited on where a parameter of
its bucket is first used: from the launch to the end of the next training step a torch-function
mode sees every op's arguments and waits for a pending bucket before the first op that reads one of
its parameters, be it inside a module's forward, a functional call on a parameter, a regulariser
over ``self.parameters()`` or a callback averaging weights between steps. The gathers thus run while
the forward of the earlier layers computes, and results are bitwise those of gathering at once. A model
that runs code compiled by ``torch.compile`` waits for them at once instead: Dynamo would trace the
mode's ``__torch_function__`` into every graph and recompile whenever the mode comes or goes.

Whatever is still pending at the end of the next training step, and before anything that reads
parameters without ops of its own (validation steps, checkpoints, state dicts, the next optimizer
step, teardown), is waited on by ``wait_all``, which also leaves the mode. As a last net, a gradient
arriving for a parameter whose bucket was never waited on (read through something that bypasses
torch functions) stops the run with an error naming it, instead of training on half-written values.

[Note: the mode's lifetime]
The mode is entered in ``launch`` and left in ``wait_all``, in different frames, while torch keeps
modes on a stack that each ``__exit__`` pops from the top. So ``launch`` overlaps only when the stack
is empty (no mode of the user's is active, so none can pop ours by exiting later); otherwise it waits
at once. ``wait_all`` pops ours if it is on top; if a mode the user entered after the step is still
active (entered in one hook, left in a later one), ours is left below it, emptied: it only passes ops
through, and the next ``launch`` pops it once it is on top again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.overrides import TorchFunctionMode

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.layout import Bucket


class ParamGathers:
    """Stages 1 and 2's post-step all-gathers: launched after a step, each waited on where its bucket is first read
    (see the Notes above)."""

    def __init__(self, units: Sequence[FlatUnit], *, overlap: bool, group=None) -> None:
        """``overlap``: ZeroConfig.overlap_param_gather, unless the model runs compiled code (see the Note)."""
        self.group = group
        self.overlap = overlap
        self._mode: _WaitOnUse | None = None
        self._abandoned: list[_WaitOnUse] = []  # emptied modes left below a user's (see the Note)
        self._pending: dict[tuple[int, int], object] = {}  # (id(unit), bucket.start) -> the gather's work
        self._key_of: dict[int, tuple[int, int]] = {}  # id(param) -> its bucket's key
        self.add_units(units)

    def add_units(self, units: Sequence[FlatUnit]) -> None:
        """Maps the parameters of ``units`` to their buckets, so reading one waits for its bucket's gather."""
        for unit in units:
            for index, p in enumerate(unit.params):
                self._key_of[id(p)] = (id(unit), unit.layout.buckets[unit.layout.param_bucket[index]].start)

    def launch(self, units: Sequence[FlatUnit], reduce_order: Sequence[tuple[FlatUnit, Bucket]]) -> None:
        """After a step: starts the gathers of ``units``' buckets in forward order, the reverse of the reducer's
        ``reduce_order`` (and waits, unless overlapping)."""
        stepped = {id(u) for u in units}
        for unit, bucket in reversed(reduce_order):
            if id(unit) in stepped:
                self._pending[(id(unit), bucket.start)] = unit.publish(bucket, group=self.group)
        while self._abandoned and _top_mode() is self._abandoned[-1]:
            self._abandoned.pop().__exit__(None, None, None)
        if not self.overlap or torch._C._len_torch_function_stack() > 0:
            self.wait_all()
        elif self._mode is None:
            self._mode = _WaitOnUse(self)
            self._mode.__enter__()

    def wait_used(self, args: tuple, kwargs: dict | None) -> None:
        """Waits for the pending gathers of the buckets of the parameters among an op's ``args`` and ``kwargs`` (also
        inside a list or tuple)."""
        for arg in (*args, *(kwargs or {}).values()):
            for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
                key = self._key_of.get(id(tensor))
                if key is not None:
                    work = self._pending.pop(key, None)
                    if work is not None:
                        collectives.wait(work)

    def wait_all(self) -> None:
        """Waits for every pending gather and leaves the mode (see [Note: the mode's lifetime])."""
        pending, self._pending = self._pending, {}
        for work in pending.values():
            collectives.wait(work)
        mode, self._mode = self._mode, None
        if mode is not None and _top_mode() is mode:
            mode.__exit__(None, None, None)  # see [Note: the mode's lifetime]
        elif mode is not None:
            self._abandoned.append(mode)

    def check_read(self, unit: FlatUnit, bucket: Bucket, index: int) -> None:
        """A gradient of ``unit``'s parameter ``index`` arrived (the reducer's gradient hook)."""
        if self._pending and (id(unit), bucket.start) in self._pending:
            raise RuntimeError(
                f"parameter {unit.names[index]!r} got a gradient although it was never read through a torch op"
                " while its post-step all-gather was running (read through .data_ptr(), a C++ extension or a view"
                " taken before the step); set ZeroConfig(overlap_param_gather=False)"
            )

    def remove_hooks(self) -> None:
        """Waits for every pending gather and leaves the mode (``wait_all``): nothing is left to watch."""
        self.wait_all()


def runs_compiled_code(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds modules compiled by ``torch.compile`` or ``module.compile()`` (or is a LightningModule
    compiled whole, which Lightning unwraps and marks)."""
    compiled = torch._dynamo.eval_frame.OptimizedModule
    return getattr(model, "_compiler_ctx", None) is not None or any(
        isinstance(m, compiled) or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()
    )


def _top_mode() -> TorchFunctionMode | None:
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


class _WaitOnUse(TorchFunctionMode):
    def __init__(self, gathers: ParamGathers) -> None:
        super().__init__()
        self.gathers = gathers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.gathers._pending:
            self.gathers.wait_used(args, kwargs)
        return func(*args, **(kwargs or {}))

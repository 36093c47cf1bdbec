"""Where the engine is in a step: one state machine, owned by the engine, asked by every component.

[Note: the step's phases]
FSDP2 keeps a ``TrainingState`` per module group; ours is one per engine, moved only by the engine at the
step's boundaries the front doors report (engine.py's [Note: the step's boundaries]):

    IDLE --begin_training_forward--> FORWARD --end_training_forward--> FORWARD_DONE --before_backward--> BACKWARD
     ^  ^                              |  (manual optimization: the step's backward runs inside the forward, and    |
     |  |                              |   end_training_forward(step_ends=True) ends the step: back to IDLE)        |
     |  +------------------------------+-----------------------------------------------------after_backward------+
     +--forward_only-- EVALUATING (a validation/test/predict step, or an evaluation call of Fabric's model)
     +--before_backward-- LOOSE_BACKWARD --after_backward--> IDLE

A new forward (training or forward-only) in FORWARD_DONE ends the step first: its training_step returned no loss,
so no backward comes (``ends_open_step``); so does one in FORWARD (the last forward raised, and the loop went on).
A backward with no forward of this engine's before it (Fabric: a loss made through another model; Lightning: a
manual_backward outside training_step) is a LOOSE_BACKWARD, outside any step. A backward that raised (the loop went
on: Fabric skipping a batch that ran out of memory) leaves the step as its forward left it (``ready_for``). Anything
else raises ``IllegalTransition``, naming both phases: a forward or a backward inside a running backward (the
whole model recomputed by activation checkpointing through the front door), a forward inside a forward-only step,
a forward's end or a backward's end that never began.
Components ask: stage 3's runtime whether a step is on (``in_step``) and whether it trains (``training``), the
gradient reducer and the buffer broadcasts whether the micro-batch is inside ``no_sync``. The engine resets it on
teardown (after an error too). A unit's own gradient lifecycle is its own (unit_training.py's ``GradState``).
"""

from __future__ import annotations

import enum
from collections.abc import Generator
from contextlib import contextmanager

from lightning_zero.sharding.backward_end import in_backward


class StepPhase(enum.Enum):
    """Where the engine is in a step (see [Note: the step's phases]); each value names the phase in errors."""

    IDLE = "idle"
    FORWARD = "training forward"
    FORWARD_DONE = "after a training forward"
    BACKWARD = "backward"
    LOOSE_BACKWARD = "backward outside a step"  # of a loss no forward of this engine's made (Fabric)
    EVALUATING = "forward-only step"


_P = StepPhase
# event -> {phase it may come in: the phase it leads to}
_TRANSITIONS: dict[str, dict[StepPhase, StepPhase]] = {
    "begin_training_forward": {_P.IDLE: _P.FORWARD, _P.FORWARD_DONE: _P.FORWARD, _P.FORWARD: _P.FORWARD},
    "end_training_forward": {_P.FORWARD: _P.FORWARD_DONE},
    "end_step_in_forward": {_P.FORWARD: _P.IDLE},  # manual optimization: the step's backward ran inside it
    # a backward inside the step's forward (manual optimization) or inside a forward-only step (a manual_backward in
    # validation_step) leaves the phase as it is
    "before_backward": {
        _P.FORWARD_DONE: _P.BACKWARD,
        _P.IDLE: _P.LOOSE_BACKWARD,
        _P.FORWARD: _P.FORWARD,
        _P.EVALUATING: _P.EVALUATING,
    },
    # (in FORWARD: Fabric's backward of a loss after a forward of this engine's raised)
    "after_backward": {_P.BACKWARD: _P.IDLE, _P.LOOSE_BACKWARD: _P.IDLE, _P.FORWARD: _P.IDLE},
    "begin_forward_only": {_P.IDLE: _P.EVALUATING, _P.FORWARD_DONE: _P.EVALUATING, _P.FORWARD: _P.EVALUATING},
    "end_forward_only": {_P.EVALUATING: _P.IDLE},
}


_OPENING = ("begin_training_forward", "begin_forward_only", "before_backward")  # events that begin something


class IllegalTransition(RuntimeError):
    """A step's boundary reported in a phase it may not come in (see [Note: the step's phases])."""


class StepState:
    """The engine's step phase and ``no_sync`` depth: moved by the engine (``advance``), asked by the components."""

    def __init__(self) -> None:
        self.phase = StepPhase.IDLE
        self._no_sync_depth = 0

    def advance(self, event: str) -> StepPhase:
        """Moves to the phase ``event`` leads to from the current one (see the Note), or raises naming both."""
        self.ready_for(event)
        self.phase = _TRANSITIONS[event][self.phase]
        return self.phase

    def ready_for(self, event: str) -> None:
        """Raises if ``event`` may not come now (before the engine acts on it; ``advance`` moves once it has).
        Before an event that begins something, a backward that raised (the phase says backward, but no backward
        runs) first leaves the step as its forward left it: open after a training forward (its end is then the next
        forward's), else none."""
        raised = self.phase in (StepPhase.BACKWARD, StepPhase.LOOSE_BACKWARD) and not in_backward()
        if raised and event in _OPENING:
            self.phase = StepPhase.FORWARD_DONE if self.phase is StepPhase.BACKWARD else StepPhase.IDLE
        allowed = _TRANSITIONS[event]
        if self.phase not in allowed:
            expected = " or ".join(phase.value for phase in allowed)
            raise IllegalTransition(
                f"{event.replace('_', ' ')} in the engine's phase '{self.phase.value}': it comes only in {expected}"
                " (see [Note: the step's phases] in lightning_zero/sharding/step_state.py); the front door reported"
                " the step's boundaries out of order"
            )

    @property
    def ends_open_step(self) -> bool:
        """A forward now first ends the step still open: its forward gave no backward (or raised)."""
        return self.phase in (StepPhase.FORWARD, StepPhase.FORWARD_DONE)

    def reset(self) -> None:
        """Teardown, after an error too: no step is on."""
        self.phase = StepPhase.IDLE

    @property
    def in_step(self) -> bool:
        """Between a step's begin and its end (stage 3 gathers for it)."""
        return self.phase not in (StepPhase.IDLE, StepPhase.LOOSE_BACKWARD)

    @property
    def training(self) -> bool:
        """The step in progress trains (the same on every rank)."""
        return self.phase in (StepPhase.FORWARD, StepPhase.FORWARD_DONE, StepPhase.BACKWARD)

    @property
    def evaluating(self) -> bool:
        """Inside a validation/test/predict step (the same on every rank)."""
        return self.phase is StepPhase.EVALUATING

    @property
    def in_no_sync(self) -> bool:
        """A micro-batch before the step's last (``no_sync``): stage 1 only accumulates its gradients."""
        return self._no_sync_depth > 0

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Inside the block micro-batches are before the step's last (``in_no_sync``); blocks may nest."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

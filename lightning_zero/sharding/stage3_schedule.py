"""Stage 3's collective schedule: which unit is gathered, freed and reduced, decided from events every
rank sees in the same order. Pure bookkeeping over unit indices; ``Stage3Runtime`` executes it.

[Note: one schedule on every rank]
Collectives are matched across ranks by issue order, so every decision below is a function of
events that happen identically on every rank, never of which unit this rank happened to run:
- Units are numbered in registration order (``S``). A forward pass walks a cursor along ``S``: when a
  unit at or after the cursor runs, every unit the cursor skips over is gathered too ("served": this
  rank does not need it, another rank may run it), and when the forward ends the rest of ``S`` is
  served. So each forward pass gathers every unit once, in ``S`` order, whichever units a rank runs:
  a unit skipped on some ranks (an expert no token was routed to, a data-dependent branch, layer
  drop) costs a gather there and nothing else. The cursor's stops are the pass's *entries*.
- A unit called again right after itself stays in its entry (no gather). A unit called after a
  later-registered one ran is a new entry gathered on the spot: such out-of-order calls must happen
  the same way on every rank (the README's contract), as must parameter reads outside a unit's own
  forward (``access``), which keep the unit gathered ("pinned") until the step ends.
- Backward walks the entries in reverse. Each entry is gathered again ("started") when the first
  gradient reaches its outputs, and is finished when backward reaches an earlier entry, or at the end
  of backward: then its unit's gradients are reduce-scattered (at the unit's first entry of the pass,
  zeros for parameters without a gradient on this rank) and the unit is freed. Entries no event
  reached on this rank are started and finished on the way, so every rank issues the same gathers
  and reduce-scatters. Autograd runs a single-device graph in decreasing creation order, so when the
  hook of an entry's output fires, every node created after that entry's forward ended has run: the
  gradients of later entries are complete (pinned units are reduced at the end of backward instead).
- Prefetch (forward and backward) starts the next units in schedule order while both budgets allow:
  ``max_live`` elements of gathered units in all, and, ahead of the one running, units up to the
  first that reaches ``max_prefetch`` elements (DeepSpeed's ``stage3_prefetch_bucket_size``; 0:
  none); whether a unit is gathered is itself a function of the schedule, so prefetch is too.
- A forward-only step (validation, test, predict) may run many forward passes: ``generate()`` runs one
  per token. A unit entered again there begins another pass, whose cursor starts again at the first unit
  (so it serves skipped units as the first pass did). From the second pass on every unit gathered, and those
  still gathered when it begins, stay gathered until the step ends ("kept") while the kept
  units fit ``max_live`` (all of them if the whole model does, else in gathering order as long as the largest
  unit still fits beside them): a step costs at most two gathers per kept unit however many passes it makes,
  and a step of one pass keeps nothing (its memory is a training forward's). Units beyond the budget are
  gathered and freed as above.
Frees and waits are local: they change memory and timing, never the sequence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol


class Executor(Protocol):
    """What carries the schedule's decisions out (``Stage3Runtime``); ``unit`` is an index into ``S``."""

    def gather(self, unit: int) -> None:
        """Starts the all-gather of ``unit`` (asynchronously)."""

    def wait(self, unit: int) -> None:
        """Returns once ``unit``'s parameters are whole."""

    def free(self, unit: int) -> None:
        """Releases the gathered parameters (waiting for a pending gather)."""

    def reduce(self, unit: int) -> None:
        """Starts the reduce-scatter of ``unit``'s gradients."""


class Schedule:
    """Decides which units are gathered, freed and reduced, from the events of a step (see the Note above).

    Args:
        sizes: each unit's number of elements, in ``S`` order.
        persistent: the units gathered for the whole run (never freed, not counted in ``max_live``).
        max_live: elements of gathered units allowed at once, persistent ones not counted.
        executor: what carries the decisions out.
        max_prefetch: elements gathered ahead of the running unit at most (None: only ``max_live``).
    """

    def __init__(
        self,
        sizes: Sequence[int],
        persistent: set[int],
        max_live: int,
        executor: Executor,
        max_prefetch: int | None = None,
    ) -> None:
        self.sizes = list(sizes)
        self.persistent = set(persistent)
        self.max_live = max_live
        self.max_prefetch = max_live if max_prefetch is None else max_prefetch
        self.run = executor
        self.gathered: set[int] = set(self.persistent)  # persistent units are gathered at set-up
        self.pinned: set[int] = set()
        self.kept: set[int] = set()  # a forward-only step's units gathered until it ends
        self._forward_only = False  # the step has no backward
        self._keeping = False  # ... and its second pass has begun: gathered units are kept while they fit
        scheduled = [size for u, size in enumerate(self.sizes) if u not in self.persistent]
        self._all_fit = sum(scheduled) <= max_live  # every unit can be kept
        self._largest = max(scheduled, default=0)
        self.peak_live = 0
        self._reset_pass()
        self._open = False

    # --- state -------------------------------------------------------------------------------------
    def _reset_pass(self) -> None:
        self.entries: list[int] = []  # unit of each entry of this pass
        self._cursor = 0  # next unit of S the forward has not reached
        self._first: dict[int, int] = {}  # unit -> its first entry
        self._latest: dict[int, int] = {}  # unit -> its latest entry
        self._forward_done = False
        self._in_backward = False
        self._top = 0  # the entry backward is in (len(entries): none yet)
        self._state: list[str] = []  # per entry: "", "started" or "finished"
        self._need: Counter[int] = Counter()  # started, unfinished entries per unit
        self._active: list[tuple[int, int]] = []  # (unit, entry) of each unit whose forward is running

    def live_numel(self) -> int:
        """Elements of the gathered units now, persistent ones not counted."""
        return sum(self.sizes[u] for u in self.gathered if u not in self.persistent)

    def _gather(self, unit: int) -> None:
        if unit not in self.gathered:
            self.gathered.add(unit)
            self.run.gather(unit)
            self.peak_live = max(self.peak_live, self.live_numel())
            if self._keeping and self._fits_kept(unit):
                self.kept.add(unit)

    def _fits_kept(self, unit: int) -> bool:
        """Whether ``unit``, gathered in a forward-only step's later passes, is kept (see the module's Note)."""
        if self._all_fit:
            return True
        kept = sum(self.sizes[u] for u in self.kept) + self.sizes[unit]
        return kept + self._largest <= self.max_live

    def _start_keeping(self) -> None:
        """A forward-only step's second pass begins: what is gathered now is kept too, while it fits."""
        self._keeping = True
        for unit in sorted(self.gathered - self.persistent):
            if self._fits_kept(unit):
                self.kept.add(unit)

    def _free(self, unit: int) -> None:
        if unit in self.gathered and not (unit in self.persistent or unit in self.pinned or unit in self.kept):
            self.gathered.discard(unit)
            self.run.free(unit)

    # --- a step --------------------------------------------------------------------------------------
    def begin_step(self, *, forward_only: bool = False) -> None:
        """``forward_only``: a step with no backward, whose later passes keep their units (see the module's Note)."""
        self.end_step()
        self._open = True
        self._forward_only = forward_only

    def end_step(self) -> None:
        """Frees everything not persistent (after backward, or after a forward-only step)."""
        self.pinned.clear()
        self.kept.clear()
        self._forward_only = self._keeping = False
        for unit in sorted(self.gathered):
            self._free(unit)
        self._reset_pass()
        self._open = False

    @property
    def in_forward(self) -> bool:
        """Whether a unit's forward is running (one was entered and has not returned)."""
        return bool(self._active)

    def active_unit(self) -> int | None:
        """The unit whose forward runs innermost now (None: none)."""
        return self._active[-1][0] if self._active else None

    # --- forward ---------------------------------------------------------------------------------------
    def enter(self, unit: int) -> int:
        """A unit's forward starts; returns its entry (the tag of its outputs' backward hooks)."""
        if not self._open or self._forward_done:
            self._reset_pass()
            self._open = True
        if self._active:  # called from inside another unit's forward: gathered with it, for the step
            self.access(unit)
            self._active.append((unit, -1))  # no entry: pinned units are reduced at the end of backward
            return -1
        if unit < self._cursor and self._forward_only and self._latest.get(unit) != len(self.entries) - 1:
            # a unit entered again: another pass, which serves the units skipped here as the first did
            if not self._keeping:
                self._start_keeping()
            self._cursor = 0
        if unit >= self._cursor:
            first, self._cursor = self._cursor, unit + 1
            self._free_behind(first)
            for served in range(first, unit):  # skipped here, maybe run elsewhere
                self._append(served)
                self._free(served)
            self._append(unit)
        elif self._latest.get(unit) != len(self.entries) - 1:
            self._free_behind(self._cursor)
            self._append(unit)  # out of order: must be so on every rank
        self._prefetch_forward()
        self.run.wait(unit)
        self._active.append((unit, self._latest[unit]))
        return self._latest[unit]

    def exit(self, unit: int) -> int:
        """A unit's forward returned; returns the entry its outputs belong to (-1: none)."""
        if self._active and self._active[-1][0] == unit:
            return self._active.pop()[1]
        return -1

    def access(self, unit: int) -> None:
        """A parameter of ``unit`` is read outside the unit's own forward: keep it whole until the step ends."""
        self._gather(unit)
        self.run.wait(unit)
        self.pinned.add(unit)

    def _append(self, unit: int) -> None:
        self._latest[unit] = len(self.entries)
        self._first.setdefault(unit, len(self.entries))
        self.entries.append(unit)
        self._gather(unit)

    def _free_behind(self, below: int) -> None:
        """Frees the gathered units before position ``below`` of S (prefetched ones lie after it)."""
        for unit in sorted(self.gathered):
            if unit < below:
                self._free(unit)

    def _prefetch_forward(self) -> None:
        ahead = sum(self.sizes[u] for u in self.gathered if u >= self._cursor and u not in self.persistent)
        for unit in range(self._cursor, len(self.sizes)):
            if unit in self.gathered:
                continue
            if self.live_numel() + self.sizes[unit] > self.max_live or ahead >= self.max_prefetch:
                return
            self._gather(unit)
            ahead += self.sizes[unit]

    def end_forward(self) -> None:
        """The forward pass is over (the step returned, or backward starts): serve the rest of S."""
        if not self._open or self._forward_done:
            return
        self._free_behind(self._cursor)
        for unit in range(self._cursor, len(self.sizes)):
            self._append(unit)
            self._free(unit)  # served: gathered for the ranks that run it, freed at once
        self._cursor = len(self.sizes)
        self._forward_done = True
        self._active.clear()

    # --- backward --------------------------------------------------------------------------------------
    @property
    def in_backward_pass(self) -> bool:
        """Whether this step's backward has begun (by the schedule's events: the same on every rank)."""
        return self._in_backward

    def begin_backward(self) -> None:
        """Backward starts (once per pass; later calls do nothing): the forward pass ends (``end_forward``) and backward
        walks its entries from the last."""
        self.end_forward()
        if not self._in_backward:
            self._in_backward = True
            self._top = len(self.entries)  # the entry backward is in (none yet)
            self._state = [""] * len(self.entries)

    def entry_for_recompute(self, unit: int) -> int:
        """The entry whose backward re-runs ``unit``'s forward (activation checkpointing)."""
        self.begin_backward()
        if self._top < len(self.entries) and self.entries[self._top] == unit:
            return self._top
        below = [k for k in range(self._top - 1, -1, -1) if self.entries[k] == unit]
        return below[0] if below else self._latest.get(unit, -1)

    def recompute(self, unit: int) -> int:
        """``unit``'s forward runs again inside backward (activation checkpointing): gather it; returns its entry.

        A recomputation re-runs a checkpointed region's units in forward order, inside the backward of the
        region's last entry (non-reentrant: when its first saved tensor is unpacked) or of the region's node
        (reentrant), before backward has reached the region's earlier entries: those are started here, not
        reached (backward finishes each entry, and reduces its unit, only when the gradient reaches it or an
        earlier entry, as without checkpointing). They are started in backward's order, every entry between the
        one backward is in and the recomputed one, so a rank where a unit of the region did not run (and is not
        recomputed) starts the same ones; the region's first unit must run on every rank (the README's SPMD list).
        An entry finished already is gathered again on demand."""
        entry = self.entry_for_recompute(unit)
        if entry < 0:
            return entry
        if entry < self._top:  # in backward's order, as on a rank where an earlier recomputed unit did not run
            for k in range(self._top - 1, entry - 1, -1):
                self._start(k)
        elif entry > self._top:
            self._gather(unit)
        self.run.wait(unit)
        return entry

    def backward(self, entry: int) -> None:
        """The first gradient reached an output of ``entry`` (or a reentrant recomputation's inner backward did):
        gather it.

        Entries above it that no event reached on this rank get their events now, in order, as on the
        ranks where they ran."""
        self.begin_backward()
        if entry < 0:
            return
        if entry > self._top:  # an entry already finished needs its unit again: on demand (as everywhere else)
            self._gather(self.entries[entry])
        for k in range(self._top - 1, entry - 1, -1):
            self._event(k)
        self.run.wait(self.entries[entry])

    def _event(self, k: int) -> None:
        """Backward reaches entry ``k``: the entry above is finished, ``k`` is gathered, later ones prefetched."""
        if self._top < len(self.entries):
            self._finish(self._top)
        self._top = k
        self._start(k)
        self._prefetch_backward()

    def _start(self, k: int) -> None:
        if self._state[k] == "":
            self._state[k] = "started"
            self._need[self.entries[k]] += 1
            self._gather(self.entries[k])

    def _finish(self, k: int) -> None:
        unit = self.entries[k]
        self._state[k] = "finished"
        self._need[unit] -= 1
        if self._first[unit] == k and unit not in self.pinned:
            self.run.reduce(unit)
        if self._need[unit] == 0:
            self._free(unit)

    def _prefetch_backward(self) -> None:
        started = {self.entries[k] for k in range(self._top) if self._state[k] == "started"}
        ahead = sum(self.sizes[u] for u in started - self.persistent - {self.entries[self._top]})
        for k in range(self._top - 1, -1, -1):
            if self._state[k]:
                continue
            unit = self.entries[k]
            if unit not in self.gathered:
                if self.live_numel() + self.sizes[unit] > self.max_live or ahead >= self.max_prefetch:
                    return
                ahead += 0 if unit in self.persistent else self.sizes[unit]
            self._start(k)

    def end_backward(self) -> None:
        """End of backward: finish every entry left, reduce the pinned units, free what is not pinned."""
        self.begin_backward()
        for k in range(self._top - 1, -1, -1):
            self._event(k)
        if self._top < len(self.entries):
            self._finish(self._top)
        for unit in sorted(self.pinned):
            self.run.reduce(unit)
        for unit in sorted(self.gathered):
            self._free(unit)
        pinned = self.pinned
        self._reset_pass()
        self.pinned = pinned
        self._open = False

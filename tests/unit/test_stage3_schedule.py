"""The stage-3 schedule on its own (no processes): ranks that run different subsets of the units, in
registration order with repeats, issue the same gathers and reduce-scatters in the same order; each
unit runs gathered, is reduced once per backward after its last gradient, and the live budget holds."""

from __future__ import annotations

import random

import pytest

from lightning_zero.sharding.stage3_schedule import Schedule


class Recorder:
    """The executor: records the collectives (gather, reduce) and tracks what is gathered."""

    def __init__(self) -> None:
        self.sequence: list[tuple[str, int]] = []
        self.gathered: set[int] = set()

    def gather(self, unit: int) -> None:
        assert unit not in self.gathered
        self.gathered.add(unit)
        self.sequence.append(("gather", unit))

    def wait(self, unit: int) -> None:
        assert unit in self.gathered, f"waited on unit {unit}, which is not gathered (released before its use)"

    def free(self, unit: int) -> None:
        self.gathered.discard(unit)

    def reduce(self, unit: int) -> None:
        self.sequence.append(("reduce", unit))


def _run_rank(calls, sizes, persistent, max_live, *, pinned_at=None):
    """One training step: forward ``calls`` (units), then backward in reverse; returns the recorder."""
    recorder = Recorder()
    recorder.gathered.update(persistent)
    schedule = Schedule(sizes, persistent, max_live, recorder)
    schedule.begin_step()
    tags = []
    for position, unit in enumerate(calls):
        if pinned_at is not None and position == pinned_at[0]:
            schedule.access(pinned_at[1])
        schedule.enter(unit)
        assert unit in recorder.gathered, f"unit {unit} is not gathered for its forward"
        assert schedule.live_numel() <= max(max_live, sizes[unit]) + (sizes[pinned_at[1]] if pinned_at else 0)
        tags.append((unit, schedule.exit(unit)))
    schedule.end_forward()
    reduced_at = {}
    for unit, tag in reversed(tags):
        assert not any(op == ("reduce", unit) for op in recorder.sequence), f"unit {unit} reduced before its backward"
        schedule.backward(tag)
        assert unit in recorder.gathered, (
            f"unit {unit} is not gathered for its backward (released while an entry of it still needs it)"
        )
        reduced_at[unit] = len(recorder.sequence)
    schedule.end_backward()
    schedule.end_step()
    reduces = [u for op, u in recorder.sequence if op == "reduce"]
    assert sorted(reduces) == list(range(len(sizes))), "every unit is reduced exactly once"
    assert recorder.gathered == set(persistent)
    return recorder


def _patterns(seed: int, n: int, ranks: int):
    rng = random.Random(seed)
    base = []
    for unit in range(n):
        base += [unit] * rng.choice([1, 1, 1, 2])  # some units run twice in a row
    return [[u for u in base if rng.random() > 0.3] for _ in range(ranks)]


@pytest.mark.parametrize("seed", range(40))
def test_ranks_that_skip_different_units_issue_the_same_collectives(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 7)
    sizes = [rng.randint(1, 5) for _ in range(n)]
    persistent = {u for u in range(n) if rng.random() < 0.2}
    max_live = rng.choice([1, 4, 10, 100])
    sequences = [_run_rank(calls, sizes, persistent, max_live).sequence for calls in _patterns(seed, n, 4)]
    assert all(s == sequences[0] for s in sequences), sequences
    gathers = [u for op, u in sequences[0] if op == "gather"]
    non_persistent = [u for u in range(n) if u not in persistent]
    # Forward gathers every unit once in order; backward once more per entry.
    assert gathers[: len(non_persistent)] == non_persistent


def test_out_of_order_calls_made_alike_on_every_rank_match():
    sizes, persistent = [3, 3, 3, 3], set()
    # rank 1 skips unit 2; both call unit 0 again after unit 1 (an out-of-order call every rank makes)
    a = _run_rank([0, 1, 0, 2, 3], sizes, persistent, 6)
    b = _run_rank([0, 1, 0, 3], sizes, persistent, 6)
    assert a.sequence == b.sequence
    # unit 0 is reduced after both of its calls' backward: last among the reductions of this pass
    assert [u for op, u in a.sequence if op == "reduce"] == [3, 2, 1, 0]


def test_a_parameter_read_outside_its_unit_pins_the_unit_until_the_end_of_backward():
    sizes = [2, 2, 2, 2]
    a = _run_rank([0, 1, 2, 3], sizes, set(), 2, pinned_at=(2, 3))
    b = _run_rank([0, 1, 3], sizes, set(), 2, pinned_at=(2, 3))
    assert a.sequence == b.sequence
    assert [u for op, u in a.sequence if op == "reduce"][-1] == 3  # pinned: reduced at the end of backward


def test_prefetch_fills_the_live_budget_and_no_more():
    for budget in (2, 4, 6):
        recorder = Recorder()
        schedule = Schedule([2] * 6, set(), budget, recorder)
        schedule.begin_step()
        schedule.enter(0)
        assert schedule.live_numel() == budget
        assert recorder.sequence == [("gather", u) for u in range(budget // 2)]


def test_prefetch_ahead_stays_within_its_own_budget():
    """``max_prefetch`` (DeepSpeed's stage3_prefetch_bucket_size) bounds what is gathered ahead of the
    running unit, forward and backward, below a larger live budget; 0 turns prefetch off."""
    for ahead_budget in (0, 2, 4):
        recorder = Recorder()
        schedule = Schedule([2] * 6, set(), 100, recorder, max_prefetch=ahead_budget)
        schedule.begin_step()
        tags = []
        for unit in range(6):
            tags.append(schedule.enter(unit))
            ahead = sum(2 for u in recorder.gathered if u > unit)
            assert ahead == min(ahead_budget, 2 * (5 - unit)), (ahead_budget, unit, sorted(recorder.gathered))
            schedule.exit(unit)
        schedule.end_forward()
        for unit in reversed(range(6)):
            schedule.backward(tags[unit])
            ahead = sum(2 for u in recorder.gathered if u < unit)
            assert ahead == min(ahead_budget, 2 * unit), (ahead_budget, unit, sorted(recorder.gathered))
        schedule.end_backward()


def test_a_recomputation_entering_several_units_reduces_each_after_its_backward():
    """Activation checkpointing of units 0 and 1 together: their forward runs again inside the backward of unit 1's
    entry (non-reentrant: when its first saved tensor is unpacked), unit 0's before unit 1's. Unit 0 is gathered
    for it, and unit 1 is reduced only once backward reaches unit 0's entry, after its gradients came."""
    recorder = Recorder()
    schedule = Schedule([4, 4, 4], set(), 100, recorder)
    schedule.begin_step()
    tags = []
    for unit in range(3):
        schedule.enter(unit)
        tags.append(schedule.exit(unit))
    schedule.end_forward()
    schedule.backward(tags[2])
    schedule.backward(tags[1])  # the gradient reaches the region's output
    for unit in (0, 1):  # the recomputation
        assert schedule.recompute(unit) == tags[unit]
        assert unit in recorder.gathered
    assert ("reduce", 1) not in recorder.sequence, "unit 1 reduced before its backward ran"
    schedule.backward(tags[0])
    assert recorder.sequence[-1] == ("reduce", 1)
    schedule.end_backward()
    assert [u for op, u in recorder.sequence if op == "reduce"] == [2, 1, 0]


def _generate(sizes, max_live, passes, skip=(), *, forward_only=True):
    """A step of ``passes`` forward passes (``generate()`` runs one per token); ``skip``: units this rank does not
    run. Returns the recorder and the schedule's peak of live elements."""
    recorder = Recorder()
    schedule = Schedule(sizes, set(), max_live, recorder)
    schedule.begin_step(forward_only=forward_only)
    for _ in range(passes):
        for unit in range(len(sizes)):
            if unit not in skip:
                schedule.enter(unit)
                assert unit in recorder.gathered
                schedule.exit(unit)
    schedule.end_forward()
    schedule.end_step()
    assert not recorder.gathered
    return recorder.sequence, schedule.peak_live


def test_a_forward_only_step_keeps_its_units_gathered_from_its_second_pass_while_they_fit():
    # The whole model fits the budget: at most two gathers per unit however many passes, alike on a rank that
    # skips a unit (the passes serve it).
    sequence, _ = _generate([4, 4, 4], 12, passes=3)
    counts = [sequence.count(("gather", unit)) for unit in range(3)]
    assert max(counts) <= 2 and _generate([4, 4, 4], 12, passes=6)[0] == sequence
    assert _generate([4, 4, 4], 12, passes=6, skip={1})[0] == sequence
    # It does not: the last unit of the first pass (still gathered) and the first of the second are kept, with
    # room for the largest unit beside them; the other two are gathered in every pass, on every rank alike.
    sequence, _ = _generate([4, 4, 4, 4], 13, passes=5)
    assert [sequence.count(("gather", unit)) for unit in range(4)] == [2, 5, 5, 1]
    assert _generate([4, 4, 4, 4], 13, passes=5, skip={0})[0] == _generate([4, 4, 4, 4], 13, 5, skip={2})[0] == sequence
    # One pass keeps nothing: it holds what a training step's forward holds.
    assert _generate([4, 4, 4, 4], 100, passes=1)[1] == _generate([4, 4, 4, 4], 100, 1, forward_only=False)[1]
    # A training step is unchanged: each pass gathers again.
    assert len(_generate([4, 4], 100, passes=2, forward_only=False)[0]) == 4


@pytest.mark.parametrize("skipped", [{1}, {2}, {1, 2}])
def test_a_recomputed_region_with_a_unit_skipped_on_one_rank_issues_the_same_collectives(skipped):
    """checkpoint_sequential over units 0..3 (non-reentrant: recomputed in forward order inside the backward of
    unit 3's entry), one rank not running ``skipped`` (layer drop, a data-dependent branch): the gathers and
    reduce-scatters are the same on both ranks, with prefetch on (DeepSpeed's default budgets, large units)."""

    def rank(run):
        recorder, million = Recorder(), 10**6
        schedule = Schedule([60 * million] * 5, set(), 10**9, recorder, max_prefetch=50 * million)
        schedule.begin_step()
        tags = {}
        for unit in sorted(run):
            schedule.enter(unit)
            tags[unit] = schedule.exit(unit)
        schedule.end_forward()
        schedule.backward(tags[4])
        schedule.backward(tags[3])  # the gradient reaches the region's output
        for unit in (0, 1, 2, 3):
            if unit in run:
                schedule.recompute(unit)
        for unit in (2, 1, 0):
            if unit in run:
                schedule.backward(tags[unit])
        schedule.end_backward()
        schedule.end_step()
        return recorder.sequence

    assert rank({0, 1, 2, 3, 4} - skipped) == rank({0, 1, 2, 3, 4})

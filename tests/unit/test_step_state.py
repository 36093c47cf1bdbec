"""The engine's step phases (sharding/step_state.py): the orders every front door drives are legal; each order a
front door could drive wrongly raises one error naming both phases, from the state machine and from the engine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.config import ZeroConfig
from lightning_zero.engine import ZeroEngine
from lightning_zero.sharding import collectives
from lightning_zero.sharding.step_state import _TRANSITIONS, IllegalTransition, StepPhase, StepState
from lightning_zero.sharding.topology import make_topology

pytestmark = pytest.mark.unit

P = StepPhase
DOORS = {  # the events each front door reports, and the phases they leave
    "trainer automatic": (
        ["begin_training_forward", "end_training_forward", "before_backward", "after_backward"],
        P.IDLE,
    ),
    "trainer step without backward": (["begin_training_forward", "end_training_forward"], P.FORWARD_DONE),
    "trainer manual": (["begin_training_forward", "before_backward", "before_backward", "end_step_in_forward"], P.IDLE),
    "evaluation": (["begin_forward_only", "end_forward_only"], P.IDLE),
    "evaluation after a step without backward": (
        ["begin_training_forward", "end_training_forward", "begin_forward_only", "end_forward_only"],
        P.IDLE,
    ),
    "fabric loss through another model": (["before_backward", "after_backward"], P.IDLE),
    "fabric forward that raised, then another": (
        ["begin_training_forward", "begin_training_forward", "end_training_forward"],
        P.FORWARD_DONE,
    ),
    "fabric backward after a forward that raised": (
        ["begin_training_forward", "before_backward", "after_backward"],
        P.IDLE,
    ),
    "manual_backward in validation_step": (["begin_forward_only", "before_backward", "end_forward_only"], P.IDLE),
    "a backward that raised, then the next forward": (
        ["begin_training_forward", "end_training_forward", "before_backward", "begin_training_forward"],
        P.FORWARD,
    ),
    "manual_backward outside training_step, then a step": (["before_backward", "begin_training_forward"], P.FORWARD),
}


@pytest.mark.parametrize("door", DOORS)
def test_every_front_doors_order_is_legal(door):
    events, final = DOORS[door]
    state = StepState()
    for event in events:
        state.advance(event)
    assert state.phase is final


ILLEGAL = [(event, phase) for event, allowed in _TRANSITIONS.items() for phase in StepPhase if phase not in allowed]
IN_BACKWARD = (P.BACKWARD, P.LOOSE_BACKWARD)  # (outside a running backward, these phases are a backward that raised)


def _inside_a_backward(fn) -> None:
    """Runs ``fn`` inside a running backward (a gradient hook), raising what it raises."""
    x = torch.ones(1, requires_grad=True)
    y = x * 2
    raised: list[BaseException] = []

    def hook(grad):
        try:
            fn()
        except IllegalTransition as error:
            raised.append(error)
        return grad

    y.register_hook(hook)
    y.backward()
    if raised:
        raise raised[0]


@pytest.mark.parametrize(("event", "phase"), ILLEGAL, ids=[f"{e}-in-{p.name}" for e, p in ILLEGAL])
def test_an_illegal_transition_names_both_phases(event, phase):
    state = StepState()
    state.phase = phase
    with pytest.raises(IllegalTransition) as raised:
        if phase in IN_BACKWARD:
            _inside_a_backward(lambda: state.advance(event))
        else:
            state.advance(event)
    message = str(raised.value)
    assert f"phase '{phase.value}'" in message and event.replace("_", " ") in message
    assert all(allowed.value in message for allowed in _TRANSITIONS[event])
    assert state.phase is phase  # nothing moved


@pytest.mark.parametrize(("phase", "left"), [(P.BACKWARD, P.FORWARD_DONE), (P.LOOSE_BACKWARD, P.IDLE)])
def test_a_backward_that_raised_leaves_the_step_as_its_forward_left_it(phase, left):
    state = StepState()
    state.phase = phase  # (after_backward never came: the backward raised and the loop went on)
    state.ready_for("begin_training_forward")
    assert state.phase is left and state.ends_open_step == (left is P.FORWARD_DONE)


def test_illegal_orders_cover_what_a_front_door_can_do_wrong():
    wrong = {(e, p) for e, p in ILLEGAL}
    assert ("after_backward", P.IDLE) in wrong  # a backward's end that never began
    assert ("end_training_forward", P.IDLE) in wrong  # a forward's end that never began
    assert ("begin_training_forward", P.BACKWARD) in wrong  # a forward inside a (running) backward
    assert ("before_backward", P.BACKWARD) in wrong  # a backward inside a backward
    assert ("begin_forward_only", P.BACKWARD) in wrong  # an evaluation inside a backward
    assert ("begin_training_forward", P.EVALUATING) in wrong  # a training forward inside a forward-only step
    assert ("begin_forward_only", P.EVALUATING) in wrong  # a forward-only step inside another


def test_no_sync_nests_and_unwinds():
    state = StepState()
    with state.no_sync():
        with state.no_sync():
            assert state.in_no_sync
        assert state.in_no_sync
    assert not state.in_no_sync


@pytest.fixture
def engine():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        topology = make_topology(None, rank=0, world_size=1, local_world_size=1)
        engine = ZeroEngine(ZeroConfig(stage=2), topology, torch.device("cpu"))
        engine.wrap(model, [optimizer])
        yield engine
        engine.teardown()
    finally:
        dist.destroy_process_group()


def test_the_engine_refuses_a_backwards_end_that_never_began(engine):
    with pytest.raises(IllegalTransition, match="after backward in the engine's phase 'idle'"):
        engine.after_backward()
    with pytest.raises(IllegalTransition, match="end training forward in the engine's phase 'idle'"):
        engine.end_training_forward()


def test_the_engine_refuses_a_forward_inside_a_backward(engine):
    engine.begin_training_forward()
    loss = engine.module(torch.ones(2, 4)).sum()
    engine.end_training_forward()
    engine.before_backward(loss)
    loss.register_hook(lambda grad: engine.begin_training_forward())
    with pytest.raises(IllegalTransition, match="begin training forward in the engine's phase 'backward'"):
        loss.backward()


def test_the_engine_refuses_a_forward_only_step_inside_another(engine):
    def nested() -> None:
        engine.forward_only(engine.module, torch.ones(2, 4))

    with pytest.raises(IllegalTransition, match="begin forward only in the engine's phase 'forward-only step'"):
        engine.forward_only(nested)
    assert engine.step.phase is P.IDLE  # the outer step ended all the same


def test_a_manual_step_ends_inside_the_step_so_stage3_serves_the_units_it_did_not_run():
    """Manual optimization: a step whose last forward ran one unit of four and had no backward. Its end still gathers
    the three others (what a rank that ran them issued), as the step's end runs before the phase leaves the step."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        topology = make_topology(None, rank=0, world_size=1, local_world_size=1)
        limits = {"max_live_parameters": 20, "prefetch_bucket_size": 0, "unit_min_params": 1}
        config = ZeroConfig(stage=3, param_persistence_threshold=0, **limits)
        engine = ZeroEngine(config, topology, torch.device("cpu"))
        engine.shard(model, training=True, dtype=None, optimizers=[optimizer])
        (zero,) = engine.wrap(model, [optimizer], marks_micro_batches=False)
        engine.begin_training_forward()
        loss = model(torch.ones(2, 4)).sum()
        engine.before_backward(loss)
        loss.backward()
        zero.step()
        with collectives.record() as issued:
            model[0](torch.ones(2, 4))  # (a forward after the step: metrics, say)
            gathers_before_end = sum(entry[0] == "all_gather" for entry in issued)
            engine.end_training_forward(step_ends=True)
        served = sum(entry[0] == "all_gather" for entry in issued) - gathers_before_end
        assert served == 3, issued
        assert engine.step.phase is P.IDLE
        engine.teardown()
    finally:
        dist.destroy_process_group()


def _train(stage: int, *, raise_in: int | None) -> dict[str, torch.Tensor]:
    """SGD steps on batches 0, 2 and 3 through an engine in a one-rank world; with ``raise_in=1`` batch 1 runs too, and
    its backward raises (a hook on the output): the loop catches it, drops the step's gradients and goes on, as a
    Fabric loop skipping a batch."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        topology = make_topology(None, rank=0, world_size=1, local_world_size=1)
        config = ZeroConfig(stage=stage, param_persistence_threshold=0, unit_min_params=1, reduce_bucket_size=8)
        engine = ZeroEngine(config, topology, torch.device("cpu"))
        if stage == 3:
            engine.shard(model, training=True, dtype=None, optimizers=[optimizer])
        (zero,) = engine.wrap(model, [optimizer])
        for step in [0, 1, 2, 3] if raise_in is not None else [0, 2, 3]:
            engine.begin_training_forward()
            out = model(torch.full((2, 4), float(step + 1)))
            engine.end_training_forward()
            if step == raise_in:
                out.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("a failed backward")))
            engine.before_backward(loss := out.square().sum())
            try:
                loss.backward()
            except ValueError:
                zero.zero_grad()
                continue
            engine.after_backward()
            zero.step()
            zero.zero_grad()
        state = engine.full_state_dict(model)
        engine.teardown()
        return state
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_backward_that_raised_and_was_skipped_leaves_training_as_if_it_never_ran(stage):
    """The failed backward had launched the reductions of the buckets no gradient could reach (and stage 3 had
    entered its backward); the next one starts afresh instead of refusing its gradients as already reduced."""
    skipped, clean = _train(stage, raise_in=1), _train(stage, raise_in=None)
    assert skipped.keys() == clean.keys()
    for name in clean:
        torch.testing.assert_close(skipped[name], clean[name], rtol=0, atol=0, msg=name)

"""Two models in Fabric under zero1/zero2/zero3: a student trained by distillation from a frozen teacher, each set
up by Fabric (``fabric.setup`` and ``fabric.setup_module``) with an engine of its own, on 2 ranks against one
process and ddp (fabric.py's [Note: several models]).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroConfig, ZeroFabricStrategy
from tests.support.compare import assert_close
from tests.support.helpers import COLLECTIVE_TIMEOUT_S

MICRO, ACCUMULATE, STEPS, LR = 4, 2, 4, 0.05  # global micro-batches of 4 samples, 2 per step
SAVED_AT = 2  # steps taken when the checkpoints are saved
RESUMED_AT = {1: 3, 2: 1, 3: 1}  # the stage each stage's checkpoints are loaded at


def _student(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # (stage 3 builds it sharded in init_module, from these values)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _teacher(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 4)).requires_grad_(False).eval()


def _batches(rank: int, world: int) -> list:
    """Micro-batch k holds samples 4k..4k+3; rank r of W takes its r-th share (one process takes all)."""
    generator = torch.Generator().manual_seed(2)
    samples = STEPS * ACCUMULATE * MICRO
    x, y = torch.randn(samples, 8, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    share = slice(rank * MICRO // world, (rank + 1) * MICRO // world)
    return [(x[lo : lo + MICRO][share], y[lo : lo + MICRO][share]) for lo in range(0, samples, MICRO)]


def _distill(student, teacher, optimizer, batches, *, backward, no_sync, clip) -> list[float]:
    """The loop: the teacher called between the student's forward and backward, under ``torch.no_grad()`` (as
    distillation does) and, every other micro-batch, with gradients enabled (its parameters are frozen)."""
    losses = []
    for k, (x, y) in enumerate(batches):
        accumulating = (k + 1) % ACCUMULATE != 0
        with no_sync(accumulating):
            logits = student(x)
            with torch.no_grad() if k % 2 == 0 else nullcontext():
                target = teacher(x)
            loss = F.cross_entropy(logits, y) + F.kl_div(
                F.log_softmax(logits / 2, -1), F.softmax(target / 2, -1), reduction="batchmean"
            )
            backward(loss / ACCUMULATE)
        losses.append(float(loss.detach()))
        if not accumulating:
            clip()
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _fabric_loop(fabric: Fabric, student, teacher, optimizer, batches) -> list[float]:
    return _distill(
        student,
        teacher,
        optimizer,
        batches,
        backward=fabric.backward,
        no_sync=lambda enabled: fabric.no_backward_sync(student, enabled=enabled),
        clip=lambda: fabric.clip_gradients(student, optimizer, max_norm=0.5),
    )


def _single() -> dict:
    student, teacher = _student(), _teacher()
    optimizer = torch.optim.AdamW(student.parameters(), lr=LR)
    losses = _distill(
        student,
        teacher,
        optimizer,
        _batches(0, 1),
        backward=torch.Tensor.backward,
        no_sync=lambda enabled: nullcontext(),
        clip=lambda: torch.nn.utils.clip_grad_norm_(student.parameters(), 0.5),
    )
    return {"losses": losses, "student": student.state_dict(), "teacher": teacher.state_dict()}


def _set_up(stage: int, world: int, seeds: tuple[int, int] = (0, 1)):
    config = ZeroConfig(
        stage=stage,
        param_persistence_threshold=0,  # stage 3: every unit really gathered and freed, the teacher's too
        unit_min_params=16,
        reduce_bucket_size=100,
        timeout=COLLECTIVE_TIMEOUT_S,
        check_collectives=stage == 3,  # every call of either model checks that the ranks issued the same
    )
    fabric = Fabric(strategy=ZeroFabricStrategy(config), accelerator="cpu", devices=world)
    fabric.launch()
    with fabric.init_module():  # (stage 3: each built sharded, in a block of its own)
        student = _student(seeds[0])
    with fabric.init_module():
        teacher = _teacher(seeds[1])
    student, optimizer = fabric.setup(student, torch.optim.AdamW(student.parameters(), lr=LR))
    return fabric, student, fabric.setup_module(teacher), optimizer


def _states(fabric: Fabric, student, teacher) -> dict:
    state = fabric.strategy.get_module_state_dict
    return {"student": state(student), "teacher": state(teacher)}


def _runs(rank: int, world: int, root) -> dict:
    batches, out = _batches(rank, world), {}
    for stage in (1, 2, 3):
        fabric, student, teacher, optimizer = _set_up(stage, world)
        losses = _fabric_loop(fabric, student, teacher, optimizer, batches[: SAVED_AT * ACCUMULATE])
        fabric.save(root / f"zero{stage}-student", {"model": student, "optimizer": optimizer, "step": SAVED_AT})
        fabric.save(root / f"zero{stage}-teacher", {"model": teacher})
        with pytest.raises(ValueError, match=r"holds one model, got 2 \(student, teacher\): save each model"):
            fabric.save(root / "both", {"student": student, "teacher": teacher, "optimizer": optimizer})
        with pytest.raises(ValueError, match=r"\['model', 'optimizer'\] are not all of one model"):
            fabric.save(root / "mixed", {"model": teacher, "optimizer": optimizer})
        with pytest.raises(ValueError, match=r"belong to a model set up before \(0.weight, 0.bias\)"):
            fabric.setup_module(nn.Sequential(student.module[0]))
        losses += _fabric_loop(fabric, student, teacher, optimizer, batches[SAVED_AT * ACCUMULATE :])
        engine = fabric.strategy.models[1].engine[0]  # the teacher's
        teacher_engine = (len(engine.optimizers), [(unit.trainable, unit.gathered) for unit in engine.units])
        run = {"losses": losses, **_states(fabric, student, teacher), "teacher_engine": teacher_engine}

        fabric, student, teacher, optimizer = _set_up(RESUMED_AT[stage], world, seeds=(10, 11))  # (the loads set them)
        fabric.load(root / f"zero{stage}-teacher", {"model": teacher})
        asked = {"model": student, "optimizer": optimizer, "step": 0}
        fabric.load(root / f"zero{stage}-student", asked)
        resumed = _fabric_loop(fabric, student, teacher, optimizer, batches[SAVED_AT * ACCUMULATE :])
        out[stage] = {
            **run,
            "resumed_losses": resumed,
            "resumed": _states(fabric, student, teacher),
            "step": asked["step"],
        }
    return out


def _ddp(rank: int, world: int) -> dict:
    """ddp's distillation: its teacher is not set up (DDP refuses a module with nothing to train)."""
    fabric = Fabric(strategy="ddp", accelerator="cpu", devices=world)
    fabric.launch()
    student, teacher = _student(), _teacher()
    student, optimizer = fabric.setup(student, torch.optim.AdamW(student.parameters(), lr=LR))
    _fabric_loop(fabric, student, teacher, optimizer, _batches(rank, world))
    return {k: v.detach().clone() for k, v in student.state_dict().items()}


def test_a_frozen_teacher_beside_the_student(ranks, tmp_path):
    """A student distilled from a frozen teacher, both set up by Fabric, equals one process and ddp at every stage
    (ranks identical), the teacher sharded and gathered by its own engine at stage 3 with no optimizer state; each
    model's checkpoint loads back at another stage and the run goes on as before; a checkpoint of both models at
    once, an optimizer saved with another model and a parameter set up twice are refused with the way out."""
    single = _single()
    results = ranks(_runs, 2, tmp_path)
    ddp = ranks(_ddp, 2)
    for stage in (1, 2, 3):
        runs, where = [result[stage] for result in results], f"zero{stage}"
        mean = [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])]
        assert_close(mean, single["losses"], f"{where}: the mean of the ranks' losses against one process")
        for rank, run in enumerate(runs):
            for model in ("student", "teacher"):
                for key, value in single[model].items():
                    assert torch.equal(run[model][key], runs[0][model][key]), (
                        f"{where}: {model} {key} differs on rank {rank}"
                    )
                    assert_close(run[model][key], value, f"{where} rank {rank}: {model} {key} against one process")
                    resumed = f"{where} rank {rank}: {model} {key} loaded at zero{RESUMED_AT[stage]} and trained on"
                    assert_close(run["resumed"][model][key], run[model][key], resumed)
            assert_close(
                run["resumed_losses"], run["losses"][SAVED_AT * ACCUMULATE :], f"{where}: losses after the load"
            )
            assert run["step"] == SAVED_AT, f"{where} rank {rank}: step {run['step']}"
            # no optimizer state; stage 3: its two units frozen and sharded between its calls
            expected = (0, [(False, False), (False, False)] if stage == 3 else [])
            assert run["teacher_engine"] == expected, f"{where} rank {rank}: the teacher's {run['teacher_engine']}"
    for rank, state in enumerate(ddp):
        for key, value in single["student"].items():
            assert_close(state[key], value, f"ddp rank {rank}: student {key} against one process")

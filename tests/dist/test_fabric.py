"""Lightning Fabric under zero1/zero2/zero3 (``Fabric(strategy="zero2")``), on 2 ranks, against one process.

A LitGPT-style loop: the model built in ``fabric.init_module(empty_init=True)`` (stage 3: sharded as it is
built), ``fabric.setup``, micro-batches accumulated under ``fabric.no_backward_sync``, ``fabric.backward``,
``fabric.clip_gradients``, the step; ``fabric.save`` mid-run and ``fabric.load`` into a fresh setup at another
stage, resumed; fp16 with dynamic loss scaling; checkpoints crossing between Fabric and the Trainer.
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import lightning_zero
from lightning_zero import ZeroConfig, ZeroFabricStrategy, ZeroPrecision
from tests.support.compare import assert_close, whole_state
from tests.support.helpers import COLLECTIVE_TIMEOUT_S
from tests.support.lightning_features import SAMPLES, Features, feature_trainer

MICRO, ACCUMULATE, STEPS = 4, 2, 6  # global micro-batch of 4 samples, 2 per step: 6 steps use 48 samples


class Plain(Features):
    """The feature model with one AdamW and no scheduler (a Fabric program steps no scheduler here)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _batches(model: Features, rank: int, world: int, start: int = 0):
    """Micro-batch k holds samples 4k..4k+3; rank r of W takes its r-th share (one process takes all)."""
    x, y = model.data.tensors
    for k in range(start * ACCUMULATE, STEPS * ACCUMULATE):
        lo = k * MICRO
        share = slice(lo + rank * MICRO // world, lo + (rank + 1) * MICRO // world)
        yield x[share], y[share]


def _train(fabric, model, optimizer, batches, losses: list) -> None:
    for k, (x, y) in enumerate(batches):
        accumulating = (k + 1) % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss / ACCUMULATE)
        losses.append(float(loss.detach()))
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()


def _fabric(stage: int, world: int, async_save: bool = False, zero: dict | None = None, **kwargs) -> Fabric:
    config = ZeroConfig(
        stage=stage,
        param_persistence_threshold=0,
        reduce_bucket_size=100,
        timeout=COLLECTIVE_TIMEOUT_S,
        async_save=async_save,
        **(zero or {}),
    )
    fabric = Fabric(strategy=ZeroFabricStrategy(config), accelerator="cpu", devices=world, **kwargs)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric):
    pl.seed_everything(0)
    # empty_init skips initialization (as under ddp) but at stage 3, which builds the model sharded as it runs it
    with fabric.init_module(empty_init=fabric.strategy.config.stage == 3):
        model = Plain()
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.lr)
    return fabric.setup(model, optimizer)


def _run(stage: int, world: int, root, **kwargs) -> dict:
    """The whole loop, saving after step 3; then a fresh setup at stage 3 loads it and does steps 4-6."""
    fabric = _fabric(stage, world, **kwargs)
    model, optimizer = _setup(fabric)
    losses: list[float] = []
    rank = fabric.global_rank
    batches = list(_batches(model, rank, world))
    _train(fabric, model, optimizer, batches[: 3 * ACCUMULATE], losses)
    fabric.save(root / f"fabric-zero{stage}", {"model": model, "optimizer": optimizer, "step": 3})
    _train(fabric, model, optimizer, batches[3 * ACCUMULATE :], losses)
    state = fabric.strategy.get_module_state_dict(model)
    scaler = fabric.strategy.precision.scaler
    scale, skipped = (scaler.scale, scaler.skipped_steps) if scaler is not None else (None, None)

    # the resumed run also checkpoints the backbone's activations (the engine's, through Fabric), offloaded
    checkpointed = {"activation_checkpointing": "units", "offload_activations": "cpu"}
    resumed = _fabric(3, world, zero={**checkpointed, "unit_module_classes": ["Sequential"]}, **kwargs)
    model2, optimizer2 = _setup(resumed)
    asked = {"model": model2, "optimizer": optimizer2, "step": 0}
    extra = resumed.load(root / f"fabric-zero{stage}", asked)
    model2.eval()  # (no dropout here: the mode changes nothing, and a model in eval() mode still trains)
    resumed_losses: list[float] = []
    _train(resumed, model2, optimizer2, batches[3 * ACCUMULATE :], resumed_losses)
    activations = resumed.strategy.engine.activations  # (the backbone, its input in the host pool)
    assert len(activations.modules) == 1 and activations.memory_bytes()["host_activations"] > 0
    resumed.save(root / f"weights-zero{stage}", {"model": model2})
    with pytest.raises(KeyError, match="the state of 1 optimizers"):  # strict: nothing is silently left out
        resumed.load(root / f"weights-zero{stage}", {"model": model2, "optimizer": optimizer2})
    return {
        "losses": losses,
        "state": {k: v.float().clone() for k, v in state.items()},
        "resumed_losses": resumed_losses,
        "resumed_state": {k: v.float().clone() for k, v in resumed.strategy.get_module_state_dict(model2).items()},
        "extra": extra,
        "step": asked["step"],
        "scale": scale,
        "skipped": skipped,
        "resumed_scale": resumed.strategy.precision.scaler.scale if scaler is not None else None,
    }


def _single() -> dict:
    """One process, plain torch: the same micro-batches whole, gradients averaged over the accumulation."""
    pl.seed_everything(0)
    model = Plain()
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.lr)
    losses = []
    for k, (x, y) in enumerate(_batches(model, 0, 1)):
        loss = F.cross_entropy(model(x), y)
        (loss / ACCUMULATE).backward()
        losses.append(float(loss.detach()))
        if (k + 1) % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _fabric_runs(rank: int, world: int, root) -> dict:
    out = {f"zero{stage}": _run(stage, world, root) for stage in (1, 2, 3)}
    out["zero2-fp16"] = _run(2, world, root / "fp16", plugins=[ZeroPrecision("16-mixed")])
    return out


def test_fabric_loop_equals_one_process(ranks, tmp_path):
    """Under zero1/2/3 the Fabric loop (sharded init, accumulation without sync, clipping) equals one process:
    each rank's losses average to its, and the weights equal its; a checkpoint saved at step 3 and loaded into
    a fresh zero3 setup (its plain values into the state given, as Fabric's own load does) goes on as the run
    did, in eval() mode too; a strict load of a checkpoint without the optimizer asked for raises. fp16 with loss
    scaling resumes with its loss scale (two models: test_fabric_two_models.py)."""
    assert SAMPLES >= STEPS * ACCUMULATE * MICRO
    single = _single()
    results = ranks(_fabric_runs, 2, tmp_path)
    for name in ("zero1", "zero2", "zero3"):
        for rank, result in enumerate(results):
            run, where = result[name], f"Fabric {name} rank {rank}"
            mean = [(a + b) / 2 for a, b in zip(results[0][name]["losses"], results[1][name]["losses"])]
            assert_close(mean, single["losses"], f"{where}: the mean of the ranks' losses against one process")
            for key, value in single["state"].items():
                assert_close(run["state"][key], value, f"{where}: {key} against one process")
            assert_close(run["resumed_losses"], run["losses"][3 * ACCUMULATE :], f"{where}: losses after the load")
            for key, value in run["state"].items():
                assert_close(run["resumed_state"][key], value, f"{where}: {key} resumed at zero3")
            assert run["step"] == 3 and run["extra"] == {}, f"{where}: load set {run['step']}, returned {run['extra']}"
    for rank, result in enumerate(results):
        run = result["zero2-fp16"]
        assert run["scale"] is not None and run["scale"] == run["resumed_scale"], f"fp16 rank {rank}: loss scales"
        assert run["skipped"] < STEPS, f"fp16 rank {rank}: every step skipped"
        for key, value in run["state"].items():
            assert_close(run["resumed_state"][key], value, f"fp16 rank {rank}: {key} resumed")
        assert_close(run["resumed_losses"], run["losses"][3 * ACCUMULATE :], f"fp16 rank {rank}: after the load")


def _script(rank: int, world: int) -> dict:
    """``lightning_zero.initialize`` at every stage: the same loop through the engine's own methods."""
    out = {}
    for stage in (1, 2, 3):
        pl.seed_everything(0)
        model = Plain()
        config = ZeroConfig(
            stage=stage, param_persistence_threshold=0, timeout=COLLECTIVE_TIMEOUT_S, check_collectives=stage == 3
        )
        engine = lightning_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=model.lr), config)
        for k, (x, y) in enumerate(_batches(model, rank, world)):
            last = (k + 1) % ACCUMULATE == 0
            with engine.no_sync() if not last else contextlib.nullcontext():
                engine.backward(F.cross_entropy(engine(x), y) / ACCUMULATE)
            if last:
                engine.clip_grad_norm_(0.5)
                engine.step()
        out[stage] = {k: v.float().clone() for k, v in engine.state_dict().items()}
    log = engine.fabric.strategy.engine.collective_check.log  # (stage 3, checked before every call of the model)
    if rank == 1:
        log.append(("all_reduce", "world", 1, "torch.float32"))  # as if rank 1 had issued one more
    with pytest.raises(RuntimeError, match="the ranks issued different collectives before call 13 of the model"):
        engine(x)
    return out


def test_plain_script_engine_equals_one_process(ranks):
    """``engine = lightning_zero.initialize(model, optimizer, config)`` (a torchrun script's front door): the
    loop with accumulation and clipping equals one process at every stage; with ``check_collectives`` a rank
    that issued one more collective is named before the next call of the model, on every rank."""
    single = _single()
    for rank, result in enumerate(ranks(_script, 2)):
        for stage, state in result.items():
            for key, value in single["state"].items():
                assert_close(state[key], value, f"initialize zero{stage} rank {rank}: {key} against one process")


def _crossing(rank: int, world: int, root) -> dict:
    """A Fabric checkpoint resumed by the Trainer, and a Trainer checkpoint loaded by Fabric."""
    fabric = _fabric(2, world)
    model, optimizer = _setup(fabric)
    batches = list(_batches(model, fabric.global_rank, world))
    _train(fabric, model, optimizer, batches, [])
    fabric.save(root / "from-fabric", {"model": model, "optimizer": optimizer})
    fabric_state = {k: v.float().clone() for k, v in fabric.strategy.get_module_state_dict(model).items()}

    trainer = feature_trainer("zero3", world, root, max_epochs=1, enable_checkpointing=False)
    pl.seed_everything(0)
    trained = Plain()
    trainer.fit(trained, ckpt_path=str(root / "from-fabric"))  # an epoch from Fabric's weights and Adam state
    trainer.save_checkpoint(root / "from-trainer")
    trainer_state = whole_state(trainer)

    loader = _fabric(3, world)
    model2, optimizer2 = _setup(loader)
    extra = loader.load(root / "from-trainer", {"model": model2, "optimizer": optimizer2})
    loaded = {k: v.float().clone() for k, v in loader.strategy.get_module_state_dict(model2).items()}
    steps = [s["step"] for s in optimizer2.optimizer.optimizer.state.values()]  # (the wrapped AdamW's, on pieces)
    return {"fabric": fabric_state, "trainer": trainer_state, "loaded": loaded, "extra": extra, "steps": steps}


def test_checkpoints_cross_between_fabric_and_the_trainer(ranks, tmp_path):
    """The Trainer resumes a Fabric checkpoint (zero2 -> zero3: the weights and Adam's state, then an epoch of
    its own), and Fabric loads the Trainer's (zero3 -> zero3): the weights equal what the Trainer saved, Adam
    counts the steps of both, and Lightning's entries come back from ``fabric.load``."""
    for rank, result in enumerate(ranks(_crossing, 2, tmp_path)):
        for key, value in result["trainer"].items():
            assert_close(result["loaded"][key], value, f"rank {rank}: {key} loaded by Fabric from the Trainer's")
        moved = max(float((result["trainer"][k] - v).abs().max()) for k, v in result["fabric"].items())
        assert moved > 0, f"rank {rank}: the Trainer's epoch changed nothing"
        assert set(map(int, result["steps"])) == {STEPS + 8}, f"rank {rank}: Adam's steps {result['steps']}"
        assert {"epoch", "global_step", "loops"} <= set(result["extra"]), f"rank {rank}: {sorted(result['extra'])}"

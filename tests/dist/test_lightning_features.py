"""Lightning's features under zero1/zero2/zero3 (stage 3 really sharding: every unit gathered only when
used) as under ddp, on 2 ranks, and against one process seeing the same global batches.

- Callbacks on one Trainer, then ``test(ckpt_path="best")`` and ``predict`` on it: ModelCheckpoint
  (monitor, top-k, best), EarlyStopping, LearningRateMonitor (a SequentialLR of warm-up and cosine),
  GradientAccumulationScheduler, BackboneFinetuning (a frozen backbone whose parameter group is added to
  the optimizer at epoch 1), a ``grad_norm`` the user logs: the losses, learning rates, weights, best
  checkpoint and predictions equal one process's (ddp cannot: see the test).
- The Tuner: ``lr_find`` (its losses and suggestion; it saves and restores a checkpoint of each strategy's
  kind) as under ddp; ``scale_batch_size`` refused by Lightning as under ddp (no distributed strategy).
- Manual optimization with two optimizers, each clipped and stepped by hand (and a OneCycleLR).

BatchNorm, weight averaging and torch.compile: test_lightning_model_features.py.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.tuner import Tuner

from tests.support.compare import assert_close, whole_state
from tests.support.lightning_features import STRATEGIES, Features, Recorder, feature_trainer


def _callbacks_run(name: str, world: int, root) -> dict:
    pl.seed_everything(0)
    module = Features()
    logger = Recorder()
    checkpoint = ModelCheckpoint(root / name, monitor="val_loss", save_top_k=2, mode="min")
    stopping = EarlyStopping("val_loss", patience=1, min_delta=0.02)  # stops within the epochs given
    callbacks = [
        checkpoint,
        stopping,
        LearningRateMonitor("step"),
        GradientAccumulationScheduler({0: 1, 2: 2}),
        BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, backbone_initial_ratio_lr=0.5),
    ]
    trainer = feature_trainer(
        name,
        world,
        root,
        max_epochs=8,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=True,
        log_every_n_steps=1,
        gradient_clip_val=1.0,
    )
    trainer.fit(module)
    fitted = whole_state(trainer)
    tested = trainer.test(module, ckpt_path="best", verbose=False)
    best = whole_state(trainer)
    predictions = torch.cat(trainer.predict(module))
    return {
        "losses": module.losses,
        "metrics": [
            (step, {k: v for k, v in m.items() if not k.startswith("zero/")})  # (the strategy's own)
            for step, m in logger.metrics
            if not any(k.startswith("test") for k in m)
        ],
        "state": fitted,
        "best_state": best,
        "best": (checkpoint.best_model_path.split("/")[-1], float(checkpoint.best_model_score)),
        "top_k": sorted(p.split("/")[-1] for p in checkpoint.best_k_models),
        "stopped_epoch": stopping.stopped_epoch,
        "epochs": trainer.current_epoch,
        "test": tested,
        "predictions": predictions,
        "groups": len(trainer.optimizers[0].param_groups),
    }


def _tuner_run(name: str, world: int, root) -> dict:
    pl.seed_everything(0)
    module = Features()
    trainer = feature_trainer(name, world, root / f"tune-{name}", max_epochs=3)
    finder = Tuner(trainer).lr_find(module, min_lr=1e-4, max_lr=1.0, num_training=20, early_stop_threshold=None)
    trainer = feature_trainer(name, world, root / f"scale-{name}", max_epochs=1)
    # Lightning refuses to tune the batch size under any distributed strategy, ddp included: the same here.
    with pytest.raises(ValueError, match="Tuning the batch size is currently not supported with distributed"):
        Tuner(trainer).scale_batch_size(module)
    return {"lr_losses": finder.results["loss"], "suggestion": finder.suggestion(), "lr": module.lr}


def _manual_run(name: str, world: int, root) -> dict:
    pl.seed_everything(0)
    module = Features(manual=True)
    # toggle_optimizer freezes the other optimizer's parameters: ddp must be told some go unused.
    name = "ddp_find_unused_parameters_true" if name == "ddp" else name
    trainer = feature_trainer(name, world, root, max_epochs=2)
    trainer.fit(module)
    return {"losses": module.losses, "state": whole_state(trainer)}


def _features(rank: int, world: int, root) -> dict:
    return {name: {"callbacks": _callbacks_run(name, world, root)} for name in STRATEGIES[1:]}


class BackwardAfterClip(Features):
    """A backward after clipping, before the step: the clip has reduced the step's gradients already."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch, batch_idx):
        backbone, _ = self.optimizers()
        self.manual_backward(self._loss(batch))
        self.clip_gradients(backbone, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        self.manual_backward(self._loss(batch))


def _manual(rank: int, world: int, root) -> dict:
    results = {name: _manual_run(name, world, root) for name in STRATEGIES}
    for name in STRATEGIES[1:]:  # what ddp does (the later gradients unclipped) cannot be had: one clear error
        with pytest.raises(RuntimeError, match="got a gradient after this step's gradients were reduced"):
            feature_trainer(name, world, root, max_steps=1).fit(BackwardAfterClip())
    return results


def _tuning(rank: int, world: int, root) -> dict:
    return {name: _tuner_run(name, world, root) for name in STRATEGIES}


def test_callbacks_checkpoints_test_and_predict_equal_one_process(ranks, tmp_path):
    """Against one process, not ddp: ddp builds its reducer over the parameters that train at set-up, so
    the backbone that BackboneFinetuning unfreezes later trains on each rank's own gradients (its losses
    leave one process's at the first step of epoch 1); the ZeRO strategies reduce it with the rest."""
    results = ranks(_features, 2, tmp_path)
    single = _callbacks_run("auto", 1, tmp_path / "single")  # one process: the same global batches
    assert single["groups"] == 2 and 1 <= single["stopped_epoch"] < 7, "the callbacks did not act: nothing is seen"
    logged = {key for _, metrics in single["metrics"] for key in metrics}
    # pg2: the backbone's group, added at epoch 1
    assert {"lr-AdamW/pg1", "lr-AdamW/pg2", "val_loss", "grad_norm"} <= logged, logged
    for name in STRATEGIES[1:]:
        runs = [result[name]["callbacks"] for result in results]
        # Each rank's loss is over half the global batch: their mean is one process's loss.
        mean = (torch.tensor(runs[0]["losses"]) + torch.tensor(runs[1]["losses"])) / 2
        assert_close(mean, single["losses"], f"{name}: the training losses")
        for rank, run in enumerate(runs):
            where = f"{name} rank {rank}"
            assert [s for s, _ in run["metrics"]] == [s for s, _ in single["metrics"]], f"{where}: logged steps"
            for (step, got), (_, want) in zip(run["metrics"], single["metrics"]):
                assert set(got) == set(want), f"{where}: logged keys at step {step}: {set(got) ^ set(want)}"
                for key in want:
                    assert_close(got[key], want[key], f"{where}: {key} logged at step {step}")
            for key, value in single["state"].items():
                assert_close(run["state"][key], value, f"{where}: {key} after fit")
                assert_close(
                    run["best_state"][key], single["best_state"][key], f"{where}: {key} of the best checkpoint"
                )
            assert (run["best"][0], run["top_k"]) == (single["best"][0], single["top_k"]), where
            assert_close(run["best"][1], single["best"][1], f"{where}: the best score")
            assert (run["stopped_epoch"], run["epochs"], run["groups"]) == (
                single["stopped_epoch"],
                single["epochs"],
                single["groups"],
            ), where
            assert_close(run["test"][0]["test_loss"], single["test"][0]["test_loss"], f"{where}: test_loss of the best")
            assert_close(run["predictions"], single["predictions"][rank::2], f"{where}: the predictions")


def test_manual_optimization_with_two_optimizers_equals_ddp(ranks, tmp_path):
    """Each optimizer clipped by ``self.clip_gradients`` before its ``step()`` (the clip must hold)."""
    results = ranks(_manual, 2, tmp_path)
    single = _manual_run("auto", 1, tmp_path)
    for name in STRATEGIES:
        for rank, result in enumerate(results):
            run, ddp = result[name], result["ddp"]
            assert_close(run["losses"], ddp["losses"], f"{name} rank {rank}: the losses")
            for key, value in ddp["state"].items():
                assert_close(run["state"][key], value, f"{name} rank {rank}: {key} against ddp's")
                assert_close(
                    run["state"][key], single["state"][key], f"{name} rank {rank}: {key} against one process's"
                )


def test_the_tuner_finds_what_it_finds_under_ddp(ranks, tmp_path):
    """lr_find runs its steps, saves a checkpoint of the strategy's kind and restores it."""
    results = ranks(_tuning, 2, tmp_path)
    ddp = results[0]["ddp"]
    assert len(ddp["lr_losses"]) == 20 and ddp["lr"] == ddp["suggestion"] != 3e-3, "the Tuner did not search"
    for name in STRATEGIES[1:]:
        for rank, result in enumerate(results):
            run = result[name]
            assert_close(run["lr_losses"], ddp["lr_losses"], f"{name} rank {rank}: lr_find's losses")
            assert_close(run["suggestion"], ddp["suggestion"], f"{name} rank {rank}: lr_find's suggestion")
            assert run["lr"] == run["suggestion"], f"{name} rank {rank}: the suggestion was not applied"

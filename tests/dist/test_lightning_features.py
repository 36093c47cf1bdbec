"""Lightning's features under zero1/zero2/zero3 (stage 3 really sharding: every unit gathered only when
used) as under ddp, on 2 ranks, and against one process seeing the same global batches.

- Callbacks on one Trainer, then ``test(ckpt_path="best")`` and ``predict`` on it: ModelCheckpoint
  (monitor, top-k, best), EarlyStopping, LearningRateMonitor (a SequentialLR of warm-up and cosine),
  GradientAccumulationScheduler, BackboneFinetuning (a frozen backbone whose parameter group is added to
  the optimizer at epoch 1): the losses, learning rates, weights, best checkpoint and predictions equal
  one process's (ddp cannot: see the test).
- The Tuner: ``lr_find`` (its losses and suggestion; it saves and restores a checkpoint of each strategy's
  kind) as under ddp; ``scale_batch_size`` refused by Lightning as under ddp (no distributed strategy).
- Manual optimization with two optimizers, each clipped and stepped by hand (and a OneCycleLR).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_zero import ZeroPrecision
from lightning_zero.cli import main
from tests.support.helpers import EquivalenceModule, make_trainer, relative_error, zero_strategy

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
GLOBAL_BATCH = 8
SAMPLES = 64  # 8 global batches an epoch


class Recorder(Logger):
    """A logger that keeps what it is given (LearningRateMonitor needs one)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, {k: float(v) for k, v in metrics.items()}))


class Features(pl.LightningModule):
    """A backbone and a head on fixed data that each rank splits explicitly (rank r of W takes samples r,
    r + W, ...: together exactly one process's global batch)."""

    def __init__(self, lr: float = 3e-3, batch_size: int = GLOBAL_BATCH, manual: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.batch_size = lr, batch_size
        self.automatic_optimization = not manual
        self.backbone = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, 3)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(SAMPLES, 12, generator=g)
        self.data = TensorDataset(x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long())
        self.losses: list[float] = []

    def forward(self, x):
        return self.head(self.backbone(x))

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        # Manual: the backbone and the head have their own optimizer, each stepped on its own loss.
        backbone_opt, head_opt = self.optimizers()
        backbone_sched, head_sched = self.lr_schedulers()
        for opt, sched, scale in ((backbone_opt, backbone_sched, 1.0), (head_opt, head_sched, 0.5)):
            self.toggle_optimizer(opt)
            self.manual_backward(scale * self._loss(batch))
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched.step()
            self.untoggle_optimizer(opt)
        return None

    def on_before_optimizer_step(self, optimizer):
        if self.automatic_optimization:  # the user's own "grad_norm", the head's (the strategy's: "zero/grad_norm")
            self.log("grad_norm", grad_norm(self.head, 2)["grad_2.0_norm_total"])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if not self.automatic_optimization:
            backbone = torch.optim.AdamW(self.backbone.parameters(), lr=self.lr)
            head = torch.optim.SGD(self.head.parameters(), lr=self.lr * 10, momentum=0.9)
            total = self.trainer.estimated_stepping_batches
            return [backbone, head], [
                torch.optim.lr_scheduler.OneCycleLR(backbone, max_lr=self.lr * 3, total_steps=total),
                torch.optim.lr_scheduler.StepLR(head, step_size=3, gamma=0.5),
            ]
        # BackboneFinetuning freezes the backbone before this runs: only what trains now is given.
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _loader(self, data):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(data, batch_size=max(1, self.batch_size // world), sampler=sampler)

    def train_dataloader(self):
        return self._loader(self.data)

    def val_dataloader(self):
        return self._loader(TensorDataset(*(t[:32] for t in self.data.tensors)))

    test_dataloader = val_dataloader

    def predict_dataloader(self):
        return self._loader(TensorDataset(self.data.tensors[0][:16]))


def _strategy(name):
    if not isinstance(name, str) or name in ("ddp", "auto", "ddp_find_unused_parameters_true"):
        return name
    return zero_strategy(int(name[-1]), param_persistence_threshold=0, reduce_bucket_size=100)


def _trainer(name: str, world: int, root, **kwargs) -> pl.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        strategy=_strategy(name),
        accelerator="cpu",
        devices=world,
        default_root_dir=root,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


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
    trainer = _trainer(
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
    fitted = _state(trainer)
    tested = trainer.test(module, ckpt_path="best", verbose=False)
    best = _state(trainer)
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
    trainer = _trainer(name, world, root / f"tune-{name}", max_epochs=3)
    finder = Tuner(trainer).lr_find(module, min_lr=1e-4, max_lr=1.0, num_training=20, early_stop_threshold=None)
    trainer = _trainer(name, world, root / f"scale-{name}", max_epochs=1)
    # Lightning refuses to tune the batch size under any distributed strategy, ddp included: the same here.
    with pytest.raises(ValueError, match="Tuning the batch size is currently not supported with distributed"):
        Tuner(trainer).scale_batch_size(module)
    return {"lr_losses": finder.results["loss"], "suggestion": finder.suggestion(), "lr": module.lr}


def _manual_run(name: str, world: int, root) -> dict:
    pl.seed_everything(0)
    module = Features(manual=True)
    # toggle_optimizer freezes the other optimizer's parameters: ddp must be told some go unused.
    name = "ddp_find_unused_parameters_true" if name == "ddp" else name
    trainer = _trainer(name, world, root, max_epochs=2)
    trainer.fit(module)
    return {"losses": module.losses, "state": _state(trainer)}


class Normed(Features):
    """A BatchNorm in the backbone: running statistics each rank updates on its own batch. (The linear layer
    before it has no bias, as usual: BatchNorm removes the mean, so that bias's true gradient is zero and
    Adam would turn rounding noise into full-size updates, under ddp too.)"""

    def __init__(self) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(24)
        self.backbone = nn.Sequential(nn.Linear(12, 24, bias=False), norm, nn.Tanh(), nn.Linear(24, 24), nn.Tanh())


class BufferTrace(pl.Callback):
    """Each rank's running mean after every training micro-batch (before the next one's broadcast, if any)."""

    def __init__(self) -> None:
        self.means: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.means.append(pl_module.backbone[1].running_mean.clone())


def _buffers_run(name: str, world: int, root, broadcast: bool) -> dict:
    pl.seed_everything(0)
    module = Normed()
    if name == "ddp":
        strategy = DDPStrategy(broadcast_buffers=broadcast)
    else:
        strategy = zero_strategy(int(name[-1]), param_persistence_threshold=0, broadcast_buffers=broadcast)
    logger, trace = Recorder(), BufferTrace()
    trainer = pl.Trainer(
        strategy=strategy,
        callbacks=[trace],
        accelerator="cpu",
        devices=world,
        default_root_dir=root,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_epochs=2,
        accumulate_grad_batches=2,
        logger=logger,
    )
    trainer.fit(module)
    val_losses = [m["val_loss"] for _, m in logger.metrics if "val_loss" in m]
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    return {"val_loss": val_losses, "state": _state(trainer), "buffers": buffers, "trace": torch.stack(trace.means)}


def _buffers(rank: int, world: int, root) -> dict:
    results = {(name, b): _buffers_run(name, world, root, b) for name in STRATEGIES for b in (True, False)}
    strategy = zero_strategy(2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, sync_batchnorm=True, logger=False)
    with pytest.raises(ValueError, match="sync_batchnorm=True: torch's SyncBatchNorm runs on CUDA only"):
        trainer.fit(Normed())
    return results


AVERAGING = {
    "ema": lambda: EMAWeightAveraging(decay=0.9),
    "swa": lambda: StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=1),
}


def _averaging_run(name: str, world: int, root, kind: str, epochs: int = 3, resume: str | None = None) -> dict:
    pl.seed_everything(0)
    module = Features()
    checkpoints = ModelCheckpoint(root / f"{kind}-{name}", save_top_k=-1, filename="{epoch}")
    logger = Recorder()
    callbacks = [AVERAGING[kind](), checkpoints]
    trainer = _trainer(
        name, world, root, max_epochs=epochs, callbacks=callbacks, logger=logger, enable_checkpointing=True
    )
    trainer.fit(module, ckpt_path=resume)
    val_losses = [m["val_loss"] for _, m in logger.metrics if "val_loss" in m]
    return {"val_loss": val_losses, "state": _state(trainer), "losses": module.losses}


def _averaging(rank: int, world: int, root) -> dict:
    out = {(kind, name): _averaging_run(name, world, root, kind) for kind in AVERAGING for name in STRATEGIES[:3]}
    for name in STRATEGIES[:3]:  # the EMA resumed from the end of epoch 1 (averaged weights saved, then loaded)
        resume = root / f"ema-{name}" / "epoch=1.ckpt"
        out[("ema-resumed", name)] = _averaging_run(name, world, root / "resumed", "ema", resume=str(resume))
    ddp_checkpoint = str(root / "ema-ddp" / "epoch=1.ckpt")  # a ddp EMA checkpoint resumed here (migration in)
    out[("ema-from-ddp", "zero2")] = _averaging_run("zero2", world, root / "from-ddp", "ema", resume=ddp_checkpoint)
    for name in STRATEGIES[:3]:  # an EMA checkpoint tested without the callback: the averaged weights, as ddp
        trainer = _trainer(name, world, root / "tested", logger=False)
        (tested,) = trainer.test(Features(), ckpt_path=str(root / f"ema-{name}" / "epoch=1.ckpt"), verbose=False)
        out[("ema-tested", name)] = tested["test_loss"]
    for kind in AVERAGING:
        with pytest.raises(ValueError, match="does not work here: it keeps a whole copy of the model"):
            _averaging_run("zero3", world, root, kind)
        strategy = zero_strategy(2)  # fp16 parameters with fp32 masters: the callback would write the copies only
        plugins = [ZeroPrecision("16-mixed")]  # (on the CPU Lightning would turn precision="16-mixed" into bf16)
        trainer = _trainer(strategy, world, root, max_epochs=1, callbacks=[AVERAGING[kind]()], plugins=plugins)
        with pytest.raises(ValueError, match="not into their separate fp32 master weights"):
            trainer.fit(Features())
    return out


def test_weight_averaging_equals_ddp_at_stages_1_and_2(ranks, tmp_path):
    """EMAWeightAveraging and StochasticWeightAveraging (the averaged weights swapped in for validation and
    copied in at the end) equal ddp's; an EMA checkpoint keeps the averaged weights: resuming from it equals
    the run that went on, under ddp and here (and a ddp EMA checkpoint resumed under zero2 equals ddp's run
    that went on), and ``consolidate`` exports the averaged weights, as ddp's
    checkpoint holds them. Stage 3 refuses them at set-up."""
    results = ranks(_averaging, 2, tmp_path)
    for rank, result in enumerate(results):
        migrated = result[("ema-from-ddp", "zero2")]
        for name in STRATEGIES[1:3]:
            _close(result[("ema-tested", name)], result[("ema-tested", "ddp")], f"{name}: test on the EMA checkpoint")
        for kind in ("ema", "swa", "ema-resumed"):
            ddp = result[(kind, "ddp")]
            for name in STRATEGIES[1:3]:
                run, where = result[(kind, name)], f"{kind} {name} rank {rank}"
                _close(run["val_loss"], ddp["val_loss"], f"{where}: the logged val_loss")
                for key, value in ddp["state"].items():
                    _close(run["state"][key], value, f"{where}: {key} at the end")
        for name, resumed in [*((n, result[("ema-resumed", n)]) for n in STRATEGIES[:3]), ("ddp", migrated)]:
            went_on = result[("ema", name)]
            _close(resumed["val_loss"], went_on["val_loss"][-1:], f"{name} rank {rank}: val_loss after the resume")
            for key, value in went_on["state"].items():
                _close(resumed["state"][key], value, f"{name} rank {rank}: {key} resumed against went on")
    ddp_saved = torch.load(tmp_path / "ema-ddp" / "epoch=1.ckpt", weights_only=True)
    assert "current_model_state" in ddp_saved  # (the swap this test is about)
    for name in STRATEGIES[1:3]:
        out = tmp_path / f"ema-{name}.pt"
        main(["consolidate", str(tmp_path / f"ema-{name}" / "epoch=1.ckpt"), str(out)])
        exported = torch.load(out, weights_only=True)
        for key, value in ddp_saved["state_dict"].items():
            _close(exported[key], value, f"{name}: the exported {key} against ddp's saved average")


class CompiledGPT(EquivalenceModule):
    """The GPT's blocks compiled one by one (as FSDP2 recommends; under stage 3 each block is a unit), with a
    backend that counts the graphs Dynamo hands it (and runs them as traced: the numbers are eager's)."""

    def __init__(self) -> None:
        super().__init__("gpt", steps=8)
        self.graphs = 0
        self.per_step: list[int] = []

    def configure_model(self):
        def counting(graph, inputs):
            self.graphs += 1
            return graph.forward

        blocks = self.net.blocks
        for i, block in enumerate(blocks):
            if not isinstance(block, torch._dynamo.eval_frame.OptimizedModule):
                blocks[i] = torch.compile(block, backend=counting)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.per_step.append(self.graphs)


def _compiled(rank: int, world: int) -> dict:
    out = {}
    for name in STRATEGIES:
        torch._dynamo.reset()
        pl.seed_everything(0)
        module = CompiledGPT()
        strategy = name if name == "ddp" else zero_strategy(int(name[-1]), param_persistence_threshold=0)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # (no silent fall back to eager)
            make_trainer(strategy, world, steps=8).fit(module)
        out[name] = {"per_step": module.per_step, "state": _state(module.trainer), "losses": module.losses}
    return out


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
            _trainer(name, world, root, max_steps=1).fit(BackwardAfterClip())
    return results


def _tuning(rank: int, world: int, root) -> dict:
    return {name: _tuner_run(name, world, root) for name in STRATEGIES}


def _close(a, b, what: str, tol: float = 1e-5) -> None:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
    assert a.numel() > 0, f"{what}: nothing to compare"
    err = relative_error(a, b)
    assert err <= tol, f"{what}: differs by {err:.2e} (relative)"


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
        _close(mean, single["losses"], f"{name}: the training losses")
        for rank, run in enumerate(runs):
            where = f"{name} rank {rank}"
            assert [s for s, _ in run["metrics"]] == [s for s, _ in single["metrics"]], f"{where}: logged steps"
            for (step, got), (_, want) in zip(run["metrics"], single["metrics"]):
                assert set(got) == set(want), f"{where}: logged keys at step {step}: {set(got) ^ set(want)}"
                for key in want:
                    _close(got[key], want[key], f"{where}: {key} logged at step {step}")
            for key, value in single["state"].items():
                _close(run["state"][key], value, f"{where}: {key} after fit")
                _close(run["best_state"][key], single["best_state"][key], f"{where}: {key} of the best checkpoint")
            assert (run["best"][0], run["top_k"]) == (single["best"][0], single["top_k"]), where
            _close(run["best"][1], single["best"][1], f"{where}: the best score")
            assert (run["stopped_epoch"], run["epochs"], run["groups"]) == (
                single["stopped_epoch"],
                single["epochs"],
                single["groups"],
            ), where
            _close(run["test"][0]["test_loss"], single["test"][0]["test_loss"], f"{where}: test_loss of the best")
            _close(run["predictions"], single["predictions"][rank::2], f"{where}: the predictions")


def test_manual_optimization_with_two_optimizers_equals_ddp(ranks, tmp_path):
    """Each optimizer clipped by ``self.clip_gradients`` before its ``step()`` (the clip must hold)."""
    results = ranks(_manual, 2, tmp_path)
    single = _manual_run("auto", 1, tmp_path)
    for name in STRATEGIES:
        for rank, result in enumerate(results):
            run, ddp = result[name], result["ddp"]
            _close(run["losses"], ddp["losses"], f"{name} rank {rank}: the losses")
            for key, value in ddp["state"].items():
                _close(run["state"][key], value, f"{name} rank {rank}: {key} against ddp's")
                _close(run["state"][key], single["state"][key], f"{name} rank {rank}: {key} against one process's")


def test_buffers_are_broadcast_as_ddp_broadcasts_them(ranks, tmp_path):
    """BatchNorm without SyncBN: with broadcast_buffers (ddp's default, and ours) every rank validates with rank
    0's running statistics, and without it with its own; either way each rank's buffers, the weights and the
    logged val_loss equal ddp's under the same setting. sync_batchnorm=True is refused at set-up on the CPU."""
    results = ranks(_buffers, 2, tmp_path)
    for broadcast in (True, False):
        for rank, result in enumerate(results):
            ddp = result[("ddp", broadcast)]
            for name in STRATEGIES[1:]:
                run, where = result[(name, broadcast)], f"{name} rank {rank} broadcast_buffers={broadcast}"
                _close(run["val_loss"], ddp["val_loss"], f"{where}: the logged val_loss")
                _close(run["trace"], ddp["trace"], f"{where}: the running mean after each micro-batch")
                for key, value in ddp["buffers"].items():
                    _close(run["buffers"][key], value, f"{where}: {key}")
                for key, value in ddp["state"].items():
                    _close(run["state"][key], value, f"{where}: {key}")
    # The setting matters here (else this test could not tell them apart):
    with_, without = results[1][("ddp", True)], results[1][("ddp", False)]
    assert relative_error(torch.tensor(with_["val_loss"]), torch.tensor(without["val_loss"])) > 1e-4


def test_compiled_models_compile_once(ranks):
    """torch.compile under every stage (stage 3 gathering every unit around its forward): as many graphs as
    under ddp (no graph break of ours inside a block), made in the first steps only, no frame gives up to
    eager, and the training equals ddp's compiled."""
    results = ranks(_compiled, 2)
    for rank, result in enumerate(results):
        for name in STRATEGIES:
            run, ddp, where = result[name], result["ddp"], f"{name} rank {rank}"
            counts = run["per_step"]
            assert counts[0] > 0 and counts[3:] == [counts[2]] * len(counts[3:]), f"{where}: graphs {counts}"
            assert counts[-1] == ddp["per_step"][-1], f"{where}: {counts[-1]} graphs, ddp {ddp['per_step'][-1]}"
            _close(run["losses"], ddp["losses"], f"{where}: the losses against ddp's")
            for key, value in ddp["state"].items():
                _close(run["state"][key], value, f"{where}: {key} against ddp's")


def test_the_tuner_finds_what_it_finds_under_ddp(ranks, tmp_path):
    """lr_find runs its steps, saves a checkpoint of the strategy's kind and restores it."""
    results = ranks(_tuning, 2, tmp_path)
    ddp = results[0]["ddp"]
    assert len(ddp["lr_losses"]) == 20 and ddp["lr"] == ddp["suggestion"] != 3e-3, "the Tuner did not search"
    for name in STRATEGIES[1:]:
        for rank, result in enumerate(results):
            run = result[name]
            _close(run["lr_losses"], ddp["lr_losses"], f"{name} rank {rank}: lr_find's losses")
            _close(run["suggestion"], ddp["suggestion"], f"{name} rank {rank}: lr_find's suggestion")
            assert run["lr"] == run["suggestion"], f"{name} rank {rank}: the suggestion was not applied"

"""What a model holds under zero1/zero2/zero3 as under ddp, on 2 ranks (stage 3 really sharding):

- BatchNorm's buffers broadcast from rank 0 where ddp broadcasts them (``broadcast_buffers``), or not;
  ``sync_batchnorm=True`` refused on the CPU;
- Lightning's weight averaging (EMAWeightAveraging, StochasticWeightAveraging) at every stage, its average
  sharded, with its checkpoints, resume, test and export, and over the fp32 masters of 16-bit parameters;
- torch.compile: as many graphs as under ddp, compiled once.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_zero import ZeroPrecision
from lightning_zero.cli.main import main
from tests.support.compare import assert_close, relative_error, whole_state
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy
from tests.support.lightning_features import STRATEGIES, Features, Recorder, feature_trainer


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
    kwargs = dict(max_epochs=2, accumulate_grad_batches=2, callbacks=[trace], logger=logger)
    trainer = feature_trainer(strategy, world, root, **kwargs)
    trainer.fit(module)
    val_losses = [m["val_loss"] for _, m in logger.metrics if "val_loss" in m]
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    return {
        "val_loss": val_losses,
        "state": whole_state(trainer),
        "buffers": buffers,
        "trace": torch.stack(trace.means),
    }


def _buffers(rank: int, world: int, root) -> dict:
    results = {(name, b): _buffers_run(name, world, root, b) for name in STRATEGIES for b in (True, False)}
    strategy = zero_strategy(2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, sync_batchnorm=True, logger=False)
    with pytest.raises(ValueError, match="sync_batchnorm=True: torch's SyncBatchNorm runs on CUDA only"):
        trainer.fit(Normed())
    return results


AVERAGING = {
    "ema": lambda: [EMAWeightAveraging(decay=0.9)],
    "swa": lambda: [StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=1)],
    "swa-bn": lambda: [StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=1)],
    # a parameter group added at epoch 1 (stages 1-2: parameters of no unit then move into new ones)
    "ema-finetune": lambda: [
        BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, backbone_initial_ratio_lr=0.5),
        EMAWeightAveraging(decay=0.9),
    ],
}


class Unscheduled(Features):
    """No LR scheduler of its own: SWA brings its SWALR (Lightning cannot resume SWA over a scheduler of the
    model's, under ddp too: the checkpoint holds SWALR's state, which the model's scheduler is then given)."""

    def configure_optimizers(self):  # (what trains now: BackboneFinetuning adds the backbone later)
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class NormedForSWA(Normed):
    """SWA recomputes BatchNorm's statistics in an extra epoch of forwards only (buffers replaced, then
    broadcast as ddp broadcasts them; no gradients, so none to log and the step applies none)."""

    def on_before_optimizer_step(self, optimizer):
        pass


class Scaled(Features):
    """With a non-persistent buffer: averaged as AveragedModel averages it, in no checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1), persistent=False)


def _averaging_run(
    name: str, world: int, root, kind: str, epochs: int = 3, resume: str | None = None, strategy=None, **kwargs
) -> dict:
    pl.seed_everything(0)
    module = Scaled() if kind.startswith("ema") and kind != "ema-finetune" else Unscheduled()
    module = NormedForSWA() if kind == "swa-bn" else module
    checkpoints = ModelCheckpoint(root / f"{kind}-{name}", save_top_k=-1, filename="{epoch}")
    logger = Recorder()
    callbacks = [*AVERAGING[kind.removesuffix("-midacc")](), checkpoints]
    trainer = feature_trainer(
        strategy or name,
        world,
        root,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=True,
        **kwargs,
    )
    trainer.fit(module, ckpt_path=resume)
    val_losses = [m["val_loss"] for _, m in logger.metrics if "val_loss" in m]
    return {"val_loss": val_losses, "state": whole_state(trainer), "losses": module.losses}


class ReferenceEMA(pl.Callback):
    """An EMA of the fp32 weights (the masters) kept whole from the strategy's full state dict after every step,
    by EMAWeightAveraging's rule: the reference for a run whose parameters train in 16 bits (no ddp to compare)."""

    def __init__(self, decay: float) -> None:
        self.decay, self.ema = decay, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        current = whole_state(trainer)
        if self.ema is None:
            self.ema = current
        else:
            self.ema = {k: self.decay * v + (1 - self.decay) * current[k] for k, v in self.ema.items()}


class AverageBytes(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        self.bytes = trainer.strategy.memory_bytes()["weight_average"]


def _averaging(rank: int, world: int, root) -> dict:
    out = {
        (kind, name): _averaging_run(name, world, root, kind)
        for kind in ("ema", "swa", "swa-bn")
        for name in STRATEGIES
    }
    offload = zero_strategy(3, param_persistence_threshold=0, offload_optimizer="cpu", offload_param="cpu")
    out[("ema", "zero3-offload")] = _averaging_run("zero3-offload", world, root, "ema", strategy=offload)
    for name in STRATEGIES:  # validation inside an accumulation window: ddp keeps the gradients accumulated so far
        midacc = dict(accumulate_grad_batches=2, val_check_interval=3)
        out[("ema-midacc", name)] = _averaging_run(name, world, root, "ema-midacc", **midacc)
    for name in STRATEGIES[1:]:
        out[("ema-finetune", name)] = _averaging_run(name, world, root, "ema-finetune")
    for name in STRATEGIES:  # the EMA resumed from the end of epoch 1 (averaged weights saved, then loaded)
        resume = root / f"ema-{name}" / "epoch=1.ckpt"
        out[("ema-resumed", name)] = _averaging_run(name, world, root / "resumed", "ema", resume=str(resume))
    for name in ("ddp", "zero3"):  # SWA resumed mid-average (its count, scheduler and average)
        resume = root / f"swa-{name}" / "epoch=1.ckpt"
        out[("swa-resumed", name)] = _averaging_run(name, world, root / "resumed", "swa", resume=str(resume))
    ddp_checkpoint = str(root / "ema-ddp" / "epoch=1.ckpt")  # a ddp EMA checkpoint resumed here (migration in)
    out[("ema-from-ddp", "zero3")] = _averaging_run("zero3", world, root / "from-ddp", "ema", resume=ddp_checkpoint)
    ddp_checkpoint = str(root / "swa-ddp" / "epoch=1.ckpt")  # SWA's whole average in its callback state
    out[("swa-from-ddp", "zero3")] = _averaging_run("zero3", world, root / "from-ddp", "swa", resume=ddp_checkpoint)
    for name in STRATEGIES:  # an EMA checkpoint tested without the callback: the averaged weights, as ddp
        trainer = feature_trainer(name, world, root / "tested", logger=False)
        (tested,) = trainer.test(Scaled(), ckpt_path=str(root / f"ema-{name}" / "epoch=1.ckpt"), verbose=False)
        out[("ema-tested", name)] = tested["test_loss"]
    for name in ("zero2", "zero3"):  # fp16 parameters with fp32 masters (the backbone frozen, then trained)
        pl.seed_everything(0)
        reference, size = ReferenceEMA(0.9), AverageBytes()
        plugins = [ZeroPrecision("16-mixed")]  # (on the CPU Lightning would turn precision="16-mixed" into bf16)
        callbacks = [*AVERAGING["ema-finetune"](), reference, size]
        trainer = feature_trainer(name, world, root / "fp16", max_epochs=3, callbacks=callbacks, plugins=plugins)
        trainer.fit(Unscheduled())
        out[("ema-16-mixed", name)] = {"state": whole_state(trainer), "reference": reference.ema, "bytes": size.bytes}
    return out


def _averaging_elsewhere(rank: int, world: int, root) -> dict:
    """The zero3 EMA checkpoint of 2 ranks resumed under zero1 on ``world`` ranks for an epoch with no update
    of the average: the average the callback copies in at the end is the one loaded, resharded."""
    pl.seed_everything(0)
    resume = str(root / "ema-zero3" / "epoch=1.ckpt")
    average = EMAWeightAveraging(decay=0.9, update_starting_at_step=10**6)
    trainer = feature_trainer("zero1", world, root / "elsewhere", max_epochs=3, callbacks=[average])
    trainer.fit(Features(), ckpt_path=resume)
    return whole_state(trainer)


def test_weight_averaging_equals_ddp(ranks, tmp_path):
    """EMAWeightAveraging and StochasticWeightAveraging at every stage (the averaged weights swapped in for
    validation and copied in at the end; SWA's BatchNorm epoch) equal ddp's; an EMA (or SWA) checkpoint keeps
    the average: resuming from it equals the run that went on, under ddp and here (and a ddp EMA checkpoint
    resumed under zero3 equals ddp's run that went on), testing it without the callback evaluates the average,
    and ``consolidate`` exports the averaged weights, as ddp's checkpoint holds them. With a parameter group
    added (BackboneFinetuning) the EMA equals one process's. With 16-bit parameters the fp32 masters are
    averaged (as ddp's fp32 parameters are); each rank keeps its share of the average (4Ψ/N bytes)."""
    results = ranks(_averaging, 2, tmp_path)
    single = _averaging_run("auto", 1, tmp_path / "single", "ema-finetune")  # (ddp trains the backbone apart)
    numel = sum(p.numel() for p in Features().parameters())
    for rank, result in enumerate(results):
        migrated = result[("ema-from-ddp", "zero3")]
        for name in STRATEGIES[1:]:
            assert_close(
                result[("ema-tested", name)], result[("ema-tested", "ddp")], f"{name}: test on the EMA checkpoint"
            )
        for kind in ("ema", "ema-midacc", "swa", "swa-bn", "ema-resumed", "swa-resumed"):
            ddp = result[(kind, "ddp")]
            names = {"swa-resumed": ["zero3"], "ema": [*STRATEGIES[1:], "zero3-offload"]}.get(kind, STRATEGIES[1:])
            for name in names:
                run, where = result[(kind, name)], f"{kind} {name} rank {rank}"
                assert_close(run["val_loss"], ddp["val_loss"], f"{where}: the logged val_loss")
                for key, value in ddp["state"].items():
                    assert_close(run["state"][key], value, f"{where}: {key} at the end")
        resumed = [(f"ema {n}", "ema", n) for n in STRATEGIES] + [(f"swa {n}", "swa", n) for n in ("ddp", "zero3")]
        migrated = {"ema ddp->zero3": migrated, "swa ddp->zero3": result[("swa-from-ddp", "zero3")]}
        for label, kind, name in [*resumed, ("ema ddp->zero3", "ema", "ddp"), ("swa ddp->zero3", "swa", "ddp")]:
            run = migrated[label] if label in migrated else result[(f"{kind}-resumed", name)]
            went_on = result[(kind, name)]
            assert_close(run["val_loss"], went_on["val_loss"][-1:], f"{label} rank {rank}: val_loss after resume")
            for key, value in went_on["state"].items():
                assert_close(run["state"][key], value, f"{label} rank {rank}: {key} resumed against went on")
        for name in STRATEGIES[1:]:
            run, where = result[("ema-finetune", name)], f"ema with BackboneFinetuning {name} rank {rank}"
            assert_close(run["val_loss"], single["val_loss"], f"{where}: the logged val_loss against one process")
            for key, value in single["state"].items():
                assert_close(run["state"][key], value, f"{where}: {key} against one process")
        for name in ("zero2", "zero3"):
            run, where = result[("ema-16-mixed", name)], f"16-mixed {name} rank {rank}"
            for key, value in run["reference"].items():
                assert_close(run["state"][key], value, f"{where}: {key}, the EMA of the fp32 masters", tol=1e-6)
            assert 4 * (numel // 2) <= run["bytes"] <= 4 * (numel // 2 + 64), f"{where}: {run['bytes']} bytes"
    ddp_saved = torch.load(tmp_path / "ema-ddp" / "epoch=1.ckpt", weights_only=True)
    assert "current_model_state" in ddp_saved  # (the swap this test is about)
    for rank, state in enumerate(ranks(_averaging_elsewhere, 3, tmp_path)):
        for key, value in ddp_saved["state_dict"].items():
            assert_close(
                state[key], value, f"zero3 on 2 ranks resumed under zero1 on 3, rank {rank}: the average {key}"
            )
    for name in STRATEGIES[1:]:
        out = tmp_path / f"ema-{name}.pt"
        main(["consolidate", str(tmp_path / f"ema-{name}" / "epoch=1.ckpt"), str(out)])
        exported = torch.load(out, weights_only=True)
        for key, value in ddp_saved["state_dict"].items():
            assert_close(exported[key], value, f"{name}: the exported {key} against ddp's saved average")


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
        out[name] = {"per_step": module.per_step, "state": whole_state(module.trainer), "losses": module.losses}
    return out


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
                assert_close(run["val_loss"], ddp["val_loss"], f"{where}: the logged val_loss")
                assert_close(run["trace"], ddp["trace"], f"{where}: the running mean after each micro-batch")
                for key, value in ddp["buffers"].items():
                    assert_close(run["buffers"][key], value, f"{where}: {key}")
                for key, value in ddp["state"].items():
                    assert_close(run["state"][key], value, f"{where}: {key}")
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
            assert_close(run["losses"], ddp["losses"], f"{where}: the losses against ddp's")
            for key, value in ddp["state"].items():
                assert_close(run["state"][key], value, f"{where}: {key} against ddp's")

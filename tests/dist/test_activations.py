"""The engine's activation checkpointing (activations/) as users combine it, on 2 ranks: dropout, whose masks the
recomputation must draw again exactly (bitwise equal to the same run without checkpointing, at stages 1-3, in fp16
and bf16, with offloaded parameters and optimizer, with ZeRO++'s quantized gathers and reductions), and a fit whose
validation gives the ranks different numbers of batches while experts that some ranks run are checkpointed blocks.
Exactness against one process at stages 1-3 on 2 and 4 ranks is in test_equivalence (the GPT), test_dynamic (a
branch one rank takes, experts, a block run twice) and test_hf (Llama, GPT-2, LoRA)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset

from lightning_zero import ZeroPrecision
from lightning_zero.models.data import SyntheticTextDataModule
from lightning_zero.models.gpt import GPTConfig, GPTModule
from lightning_zero.sharding import collectives
from tests.support.dynamic_models import DynamicModule, Indexed
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS = 3
MODES = {
    "none": {},
    "units": {"activation_checkpointing": "units"},
    "selective-offloaded": {"activation_checkpointing": "selective", "offload_activations": "cpu"},
}


class DropoutShare(pl.Callback):
    """The share of the GPT's embedding dropout output that is zero, at each training forward."""

    def on_fit_start(self, trainer, pl_module):
        self.shares = []
        pl_module.net.drop.register_forward_hook(
            lambda _m, _a, out: self.shares.append(float((out == 0).float().mean()))
        )


# (stage, precision, ZeroConfig fields): what users combine checkpointing with; each against itself without it
CASES = [
    (1, "32-true", {}),
    (2, "32-true", {}),
    (3, "32-true", {}),
    (2, "16-mixed", {}),
    (3, "bf16-mixed", {}),
    (3, "32-true", {"offload_optimizer": "cpu", "offload_param": "cpu"}),
    (3, "32-true", {"quantized_weights": True, "quantized_gradients": True}),
]


def _tag(case: int, name: str, rank: int) -> str:
    return f"{case}-{name}-{rank}.pt"


def _dropout_worker(rank: int, world: int, out_dir) -> None:
    for case, (stage, precision, options) in enumerate(CASES):
        for name, config in MODES.items():
            pl.seed_everything(0)
            module = EquivalenceModule("gpt", steps=STEPS, lazy=stage == 3, dropout=0.2)
            dropout = DropoutShare()
            config = {"param_persistence_threshold": 0, "reduce_bucket_size": 3000, **options, **config}
            plugins = [ZeroPrecision(precision)]  # (16-mixed: fp16 with loss scaling, which Lightning's CPU lacks)
            strategy = zero_strategy(stage, **config)
            trainer = make_trainer(strategy, world, steps=STEPS, callbacks=[dropout], plugins=plugins)
            trainer.fit(module)
            assert min(dropout.shares) > 0.1, dropout.shares  # (dropout is on: the runs' equality means something)
            state = trainer.strategy.gather_module().state_dict()
            torch.save({"state": state, "losses": module.losses}, out_dir / _tag(case, name, rank))


def test_checkpointing_is_bitwise_invisible_with_dropout_precisions_offload_and_zero_plus_plus(ranks, tmp_path):
    """At stages 1-3, in fp16 and bf16, with parameters and optimizer offloaded, with quantized gathers and
    reductions: every mode trains bitwise as the same run without checkpointing, dropout on."""
    ranks(_dropout_worker, 2, tmp_path)
    for case, (stage, precision, options) in enumerate(CASES):
        for rank in range(2):
            plain = torch.load(tmp_path / _tag(case, "none", rank))
            for name in MODES:
                run, where = torch.load(tmp_path / _tag(case, name, rank)), f"{stage} {precision} {options} {name}"
                assert run["losses"] == plain["losses"], (where, rank)
                for key, value in plain["state"].items():
                    assert torch.equal(run["state"][key], value), f"{where} rank {rank}: {key}"


def _uneven_validation_worker(rank: int, world: int, out_dir) -> None:
    """A fit validating twice on an explicit uneven split (3 and 2 batches), the experts checkpointed."""
    pl.seed_everything(0)
    module = DynamicModule("experts", steps=4)
    config = {"param_persistence_threshold": 0, "activation_checkpointing": "units", "offload_activations": "cpu"}
    mine = Subset(Indexed(module.data, 5), range(rank, 5, world))
    trainer = make_trainer(zero_strategy(3, **config), world, steps=4, val_check_interval=4, num_sanity_val_steps=0)
    with collectives.record() as log:
        trainer.fit(module, val_dataloaders=DataLoader(mine, batch_size=1))
    problem = collectives.first_divergence(collectives.all_gather_object(log))
    assert problem is None, problem
    torch.save(module.evaluated, out_dir / f"uneven-{rank}.pt")


def test_uneven_validation_during_a_checkpointed_fit(ranks, tmp_path):
    ranks(_uneven_validation_worker, 2, tmp_path)
    pl.seed_everything(0)
    module = DynamicModule("experts", steps=4)
    trainer = make_trainer("auto", 1, steps=4, val_check_interval=4, num_sanity_val_steps=0)
    trainer.fit(module, val_dataloaders=DataLoader(Indexed(module.data, 5), batch_size=1))
    reference = sorted(module.evaluated)
    evaluated = sorted(e for r in range(2) for e in torch.load(tmp_path / f"uneven-{r}.pt"))
    assert [i for i, _ in evaluated] == [i for i, _ in reference] and len(reference) == 10  # (5 samples, twice)
    for (i, loss), (_, ref) in zip(evaluated, reference):
        assert abs(loss - ref) <= 1e-5 * max(1.0, abs(ref)), (i, loss, ref)


def _gpt_fit(world: int, steps: int, root, checkpointing: str, ckpt_path=None) -> dict:
    pl.seed_everything(0)
    module = GPTModule(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1))
    data = SyntheticTextDataModule(block_size=16, batch_size=4, num_train=16, num_val=8, seed=0)
    config = {"activation_checkpointing": checkpointing, "param_persistence_threshold": 0}
    config["offload_activations"] = "cpu" if checkpointing != "none" else "none"
    trainer = make_trainer(zero_strategy(3, **config), world, steps=steps, accumulate=1, default_root_dir=root)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if ckpt_path is None:
        trainer.save_checkpoint(root / f"step{steps}.ckpt")
    return trainer.strategy.gather_module().state_dict()


def _resume_worker(rank: int, world: int, root) -> None:
    """The main job's GPTModule (a GPTConfig among its hyper-parameters, which safe loading rebuilds), saved with
    offloaded activation checkpoints, resumed by the Trainer with and without them: the same training."""
    _gpt_fit(world, 4, root, "units")
    resumed = {mode: _gpt_fit(world, 8, root, mode, ckpt_path=root / "step4.ckpt") for mode in ("units", "none")}
    assert list(resumed["units"]) == list(resumed["none"])
    for name, value in resumed["none"].items():
        assert torch.equal(value, resumed["units"][name]), name


def test_a_checkpointed_gpt_resumes_from_the_trainer(ranks, tmp_path):
    ranks(_resume_worker, 2, tmp_path)

"""`lightning-zero consolidate`: a plain fp32 state dict (.pt and .safetensors) equal to the gathered
parameters, loadable without lightning_zero, written with about one parameter of memory; a Lightning
checkpoint (.ckpt) that ``MyModule.load_from_checkpoint`` opens in a plain process, also written at every
save with ``ZeroConfig(save_consolidated=True)``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_zero import ZeroPrecision
from lightning_zero.cli.main import main
from tests.support.compare import full_state
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy
from tests.support.kill_target import Wide, trainer

STEPS = 4


def _fit_and_save(rank: int, world: int, root) -> None:
    pl.seed_everything(0)
    module = EquivalenceModule("blocks", steps=STEPS)
    callbacks = [ModelCheckpoint(root / "ckpts", every_n_train_steps=STEPS)]
    strategy = zero_strategy(3, param_persistence_threshold=0)
    trainer = make_trainer(strategy, world, steps=STEPS, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(module)
    state = full_state(trainer.strategy)  # gathered unit by unit: the last step's values
    if rank == 0:
        torch.save(state, root / "gathered.pt")


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_consolidated_state_dict_equals_the_gathered_parameters(ranks, tmp_path, capsys):
    ranks(_fit_and_save, 2, tmp_path)
    capsys.readouterr()  # (the ranks' output)
    (ckpt,) = (tmp_path / "ckpts").iterdir()
    gathered = torch.load(tmp_path / "gathered.pt")
    outputs = (tmp_path / "model.pt", tmp_path / "model.safetensors")
    for out in outputs:
        main(["consolidate", str(ckpt), str(out)])  # the console script's own behaviour: test_bad_input.py
        assert capsys.readouterr().out.strip() == f"wrote {out}"
        plain = load_file(out) if out.suffix == ".safetensors" else torch.load(out, weights_only=True)
        assert list(plain) == list(gathered)
        for key, value in gathered.items():
            assert plain[key].dtype == torch.float32 and torch.equal(plain[key], value.float()), key
        module = EquivalenceModule("blocks")
        module.load_state_dict(plain)  # strict: every key, tied ones included
    # Loadable by someone without lightning_zero:
    counts = _run(
        "import sys; sys.modules['lightning_zero'] = None; import torch; from safetensors.torch import load_file;"
        f" print(len(torch.load({str(outputs[0])!r}, weights_only=True)), len(load_file({str(outputs[1])!r})))"
    )
    assert counts.split() == [str(len(gathered))] * 2


class Inference(EquivalenceModule):
    """A module with hyper-parameters, as users write them for ``load_from_checkpoint``."""

    def __init__(self, lr: float = 1e-3, note: str = "") -> None:
        super().__init__("blocks", steps=STEPS, lr=lr)
        self.save_hyperparameters()


# (stage, precision): 16-mixed at stage 2 has 16-bit parameters with fp32 masters, in several buckets
RUNS = [(2, "32-true"), (3, "32-true"), (2, "16-mixed"), (3, "bf16-mixed")]


def _fit_and_save_consolidated(rank: int, world: int, root) -> None:
    for stage, precision in RUNS:
        pl.seed_everything(0)
        module = Inference(lr=2e-3, note=f"stage {stage}")
        callbacks = [ModelCheckpoint(root / f"{stage}-{precision}", every_n_train_steps=STEPS)]
        strategy = zero_strategy(stage, param_persistence_threshold=0, save_consolidated=True, reduce_bucket_size=300)
        # (on the CPU Lightning turns precision="16-mixed" into bf16: the plugin keeps fp16)
        kwargs = dict(callbacks=callbacks, enable_checkpointing=True, plugins=[ZeroPrecision(precision)])
        trainer = make_trainer(strategy, world, steps=STEPS, **kwargs)
        trainer.fit(module)
        state = full_state(trainer.strategy)
        if rank == 0:
            torch.save(state, root / f"gathered-{stage}-{precision}.pt")
        if stage < 3:
            torch.save(module.state_dict(), root / f"module-{stage}-{precision}-{rank}.pt")


def test_load_from_checkpoint_opens_the_consolidated_checkpoint(ranks, tmp_path, capsys):
    """Under mixed precision the weights are the fp32 masters, as ``full_state_dict()`` returns
    them (ddp's weights are fp32 too), not the 16-bit copies the forward reads."""
    ranks(_fit_and_save_consolidated, 2, tmp_path)
    capsys.readouterr()
    for stage, precision in RUNS:
        run = f"{stage}-{precision}"
        (ckpt,) = (tmp_path / run).iterdir()
        gathered = torch.load(tmp_path / f"gathered-{run}.pt")
        out = tmp_path / f"{run}.ckpt"
        main(["consolidate", str(ckpt), str(out)])
        for path in (ckpt / "consolidated.ckpt", out):  # written at save time, and afterwards
            module = Inference.load_from_checkpoint(path)  # a plain process: no strategy, no ranks
            assert dict(module.hparams) == {"lr": 2e-3, "note": f"stage {stage}"}, path
            state = module.state_dict()
            assert list(state) == list(gathered), path
            for key, value in gathered.items():
                assert state[key].dtype == torch.float32 and torch.equal(state[key], value), (path, key)
            raw = torch.load(path, weights_only=True)
            assert (raw["global_step"], raw["pytorch-lightning_version"]) == (STEPS, pl.__version__), path
            assert "optimizer_states" not in raw  # weights for inference; training resumes from the directory
        if precision != "32-true":
            half = torch.float16 if precision == "16-mixed" else torch.bfloat16
            weight = gathered["net.blocks.1.lin.weight"]
            assert not torch.equal(weight, weight.to(half).float()), f"{run}: the 16-bit copy, not the master"
        if stage < 3:  # the module's own parameters: the 16-bit copies of the same weights
            for r in range(2):
                own = torch.load(tmp_path / f"module-{run}-{r}.pt")
                for key, value in gathered.items():
                    assert torch.equal(own[key], value.to(own[key].dtype)), (run, r, key)


WIDTH, DEPTH = 512, 80  # 21M parameters, 84 MB in fp32; the largest is 1 MB


def _fit_wide(rank: int, world: int, root) -> None:
    pl.seed_everything(0)
    trainer(world, str(root / "ckpts"), steps=1).fit(Wide(WIDTH, DEPTH))


# Samples this process's resident memory while ``action`` runs; prints the growth over the start.
MEASURE = """
import threading, time
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.0005)
start = rss(); sampler = threading.Thread(target=sample); sampler.start()
action()
done.set(); sampler.join(); print(peak[0] - start)
"""


def test_consolidate_streams_with_about_one_parameter_of_memory(ranks, tmp_path):
    ranks(_fit_wide, 2, tmp_path)
    ckpt = tmp_path / "ckpts" / "last.ckpt"
    model_bytes = sum(p.numel() for p in Wide(WIDTH, DEPTH).parameters()) * 4
    imports = "import torch; from lightning_zero.checkpoint.consolidate import consolidate\n"
    # The measurement must see a whole model when one is held: loading every shard at once does.
    whole = f"action = lambda: [torch.load(p) for p in __import__('pathlib').Path({str(ckpt)!r}).glob('rank-*')]"
    held = int(_run(imports + whole + MEASURE).split()[-1])
    streamed = f"action = lambda: consolidate({str(ckpt)!r}, {str(tmp_path / 'wide.pt')!r})"
    growth = int(_run(imports + streamed + MEASURE).split()[-1])
    print(f"consolidate: resident memory grew {growth / 2**20:.1f} MiB for a {model_bytes / 2**20:.1f} MiB model")
    assert held > model_bytes, "the measurement does not see memory that is held"
    assert growth < model_bytes / 4, (growth, model_bytes)
    assert Path(tmp_path / "wide.pt").stat().st_size >= model_bytes

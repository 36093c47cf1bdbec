"""``load_pretrained``: pretrained (unsharded) weights from a state dict, a .pt file, a .safetensors file or a
Hugging Face directory of sharded safetensors, loaded into a model wherever its parameters live (whole under
stage 2, this rank's slices inside stage 3's ``configure_model``, this rank's unit pieces after stage-3
set-up), reading only what this rank keeps, one tensor at a time."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.support.compare import full_state
from tests.support.helpers import make_trainer, zero_strategy

pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.checkpoint import pretrained  # noqa: E402
from tests.support.hf_models import HFModule, build, pretrained_state  # noqa: E402


def _write_sources(root) -> dict:
    torch.manual_seed(123)
    model = build("llama")
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    model.save_pretrained(root / "hf", max_shard_size="40KB")  # several *.safetensors and an index
    save_file(state, root / "model.safetensors")
    torch.save(state, root / "model.pt")
    return {"dict": state, "pt": root / "model.pt", "safetensors": root / "model.safetensors", "hf": root / "hf"}


class Pretrained(HFModule):
    """Loads ``source`` in ``configure_model`` (``when="configure"``) or once set up (``when="start"``)."""

    def __init__(self, source, when: str) -> None:
        super().__init__("llama", lazy=True, steps=1)
        self.source, self.when = source, when

    def configure_model(self) -> None:
        super().configure_model()
        if self.when == "configure":
            lightning_zero.load_pretrained(self.model, self.source)

    def on_train_start(self) -> None:
        if self.when == "start":
            self.peak = _peak_allocated(lambda: lightning_zero.load_pretrained(self.model, self.source))
        self.loaded = {k: v.clone() for k, v in full_state(self.trainer.strategy).items()}


def _peak_allocated(run) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    current = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def _worker(rank: int, world: int, root) -> None:
    sources = {k: v if k != "dict" else pretrained_state() for k, v in _write_sources(root).items()}
    expected = pretrained_state()
    counted = []
    read = pretrained._Source.read

    def counting(self, name, lo, hi):
        counted.append(hi - lo)
        return read(self, name, lo, hi)

    pretrained._Source.read = counting
    psi = sum(v.numel() for v in expected.values())
    for stage, when in ((3, "configure"), (3, "start"), (2, "configure"), (2, "start")):
        for kind, source in sources.items():
            pl.seed_everything(0)
            module = Pretrained(source, when)
            counted.clear()
            config = {"param_persistence_threshold": 0} if stage == 3 else {}
            make_trainer(zero_strategy(stage, **config), world, steps=1).fit(module)
            for key, value in expected.items():
                assert torch.equal(module.loaded[f"model.{key}"], value), (stage, when, kind, key)
            if stage == 3:  # each rank read its own part only (up to padding of each tensor)
                assert sum(counted) <= psi / world + world * len(expected), (when, kind, sum(counted), psi)
            if when == "start" and stage == 3:
                largest = max(v.nbytes for v in expected.values())
                assert module.peak <= largest + 2**20, (kind, module.peak, largest)
    pretrained._Source.read = read


def test_load_pretrained_into_every_stage(ranks, tmp_path):
    ranks(_worker, 2, tmp_path)

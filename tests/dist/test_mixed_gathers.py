"""Stage 3 under bf16-mixed gathers units in bf16 from the fp32 master shards: half the all-gather bytes,
and autocast keeps no bf16 copy of every weight from forward to backward; gradients are reduced in fp32
by default (``reduce_dtype="bfloat16"`` halves those bytes too). Measured as bytes, per step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_zero.planning.memory import SavedBytes
from lightning_zero.sharding import collectives
from tests.support.compare import full_state
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

STEPS = 3
RUNS = {"bf16": {}, "fp32": {"gather_dtype": "float32"}, "bf16-reduce": {"reduce_dtype": "bfloat16"}}


class Measure(pl.Callback):
    """Bytes alive at the end of each forward (what backward holds) and bytes sent per optimizer step."""

    def __init__(self) -> None:
        self.alive: list[int] = []
        self.sent: list[dict[str, int]] = []
        self._saved = SavedBytes()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = trainer.strategy.traffic.copy()
        self._saved.start()

    def on_before_backward(self, trainer, pl_module, loss):
        self.alive.append(self._saved.stop())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.sent.append(trainer.strategy.traffic.since(self._before).bytes)

    def on_train_end(self, trainer, pl_module):
        self.memory = trainer.strategy.memory_bytes()
        self.partition = sum(u.layout.partition_numel for u in trainer.strategy.engine.units)


def _worker(rank: int, world: int, out_dir) -> None:
    results = {}
    for name, config in RUNS.items():
        pl.seed_everything(0)
        module = EquivalenceModule("gpt", steps=STEPS, lazy=True, n_layer=2)
        measure = Measure()
        strategy = zero_strategy(3, param_persistence_threshold=0, **config)
        trainer = make_trainer(strategy, world, steps=STEPS, accumulate=1, callbacks=[measure], precision="bf16-mixed")
        trainer.fit(module)
        state = full_state(trainer.strategy)
        flat = torch.cat([v.reshape(-1).float() for v in state.values()])
        assert all(torch.equal(flat, other) for other in collectives.all_gather_object(flat)), name
        matrices = sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
        results[name] = {
            "alive": measure.alive,
            "sent": measure.sent,
            "memory": measure.memory,
            "partition": measure.partition,
            "losses": module.losses,
            "matrices": matrices,
        }
    if rank == 0:
        torch.save(results, out_dir / "gathers.pt")


def test_bf16_gathers_halve_bytes_and_keep_no_weight_copies(ranks, tmp_path):
    ranks(_worker, 2, tmp_path)
    r = torch.load(tmp_path / "gathers.pt")
    bf16, fp32, reduce16 = r["bf16"], r["fp32"], r["bf16-reduce"]
    for step in range(STEPS):
        assert bf16["sent"][step]["all_gather"] * 2 == fp32["sent"][step]["all_gather"]
        assert bf16["sent"][step]["reduce_scatter"] == fp32["sent"][step]["reduce_scatter"]  # fp32 reduction
        assert reduce16["sent"][step]["reduce_scatter"] * 2 == bf16["sent"][step]["reduce_scatter"]
        # fp32 gathers: autocast's bf16 copy of every weight matrix stays alive for backward (2 bytes each)
        saved = fp32["alive"][step] - bf16["alive"][step]
        assert saved >= 2 * bf16["matrices"], (step, saved, bf16["matrices"])
    n = bf16["partition"]
    assert bf16["memory"]["parameters"] == 2 * n  # bf16 shards
    assert bf16["memory"]["master"] == 4 * n and bf16["memory"]["gradients"] == 4 * n
    assert reduce16["memory"]["gradients"] == 2 * n
    assert fp32["memory"]["parameters"] == 4 * n and fp32["memory"]["master"] == 0
    # The same training, rounded differently: the losses agree closely.
    for a, b in zip(bf16["losses"], fp32["losses"]):
        assert abs(a - b) <= 0.02 * abs(b), (bf16["losses"], fp32["losses"])

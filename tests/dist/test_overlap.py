"""What makes ZeRO as fast as DDP without changing a bit of the result.

- Host syncs: a step in fp32 and bf16 never reads a tensor back on the host; fp16 reads exactly one
  flag (the overflow decision). Counted by wrapping every Tensor method that syncs and keeping the
  calls made from lightning_zero's own code, but the loss scaler's: its state is a host tensor in this
  (the default) mode, and its host view a host copy when skipping on the device (test_skip_on_device.py
  checks that mode reads nothing).
- Stage 1 reduce-scatters during the backward of the step's last micro-batch and not before; stage 2
  reuses its bucket buffers (no allocation after the first step).
- The post-step all-gathers overlap the next forward: they are still running when the training step
  starts, a parameter read outside any module (BlocksNet reads block 3's weight in the root's
  forward; here a callback reads it first) waits for exactly its bucket, and the results equal
  gathering synchronously.
- Gloo's decomposed reduce-scatter and all-gather equal the native ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_zero
from lightning_zero import ZeroPrecision
from lightning_zero.sharding import collectives
from lightning_zero.sharding.backward_end import BackwardWork
from tests.support.helpers import HOST_READS, EquivalenceModule, make_trainer, zero_strategy

PACKAGE = str(Path(lightning_zero.__file__).parent)


def _caller() -> str:
    """The file of the code that called the Tensor method, past torch-function modes passing it on."""
    frame = sys._getframe(2)
    while frame.f_code.co_name == "__torch_function__" or frame.f_code.co_filename.endswith("torch/overrides.py"):
        frame = frame.f_back
    return frame.f_code.co_filename


class SyncCounter(pl.Callback):
    """Host syncs lightning_zero makes per optimizer step, from the second step on (the first agrees on
    the bucket order once, with one broadcast read back)."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.counting = False
        self.count = 0

    def setup(self, trainer, pl_module, stage):
        self._originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        for name, original in self._originals.items():

            def counted(tensor, *args, _original=original, **kwargs):
                caller = _caller()
                if self.counting and caller.startswith(PACKAGE) and not caller.endswith("loss_scaler.py"):
                    self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)

    def teardown(self, trainer, pl_module, stage):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.counting, self.count = trainer.global_step >= 1, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.counting and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.per_step.append(self.count)


def _sync_worker(rank: int, world: int) -> None:
    for stage in (1, 2, 3):
        for precision, expected in (("32-true", 0), ("bf16-mixed", 0), ("16-mixed", 1)):
            counter = SyncCounter()
            pl.seed_everything(0)
            module = EquivalenceModule("toy", steps=4)
            plugin = ZeroPrecision(precision)  # Lightning would turn 16-mixed on a CPU into bf16-mixed
            make_trainer(zero_strategy(stage), world, steps=4, plugins=[plugin], callbacks=[counter]).fit(module)
            assert len(counter.per_step) == 3, counter.per_step
            assert counter.per_step == [expected] * 3, (stage, precision, counter.per_step)


def test_host_syncs_per_step(ranks):
    ranks(_sync_worker, 2)


class Stage1Timing(pl.Callback):
    """Reduce-scatters issued before the end-of-backward callback, per micro-batch."""

    def __init__(self) -> None:
        self.inside_backward: list[int] = []
        self.buffers: list[int] = []

    def on_train_start(self, trainer, pl_module):
        def count():  # at the end of backward, before the reducer's own work there
            self.inside_backward.append(trainer.strategy.traffic.elements["reduce_scatter"] - self.before)

        trainer.strategy.engine.backward_end.register(BackwardWork.SCHEDULE, end=count)

    def on_before_backward(self, trainer, pl_module, loss):
        self.before = trainer.strategy.traffic.elements["reduce_scatter"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.buffers.append(trainer.strategy.engine.reducer.pool.allocated)


class TwoBackwards(EquivalenceModule):
    """Manual optimization with two backward calls per step, and one step (the second) with no backward."""

    def __init__(self) -> None:
        super().__init__("toy", steps=4)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        if batch_idx != 1:
            for half in (slice(0, len(x) // 2), slice(len(x) // 2, None)):
                self.manual_backward(F.cross_entropy(self.net(x[half], use_branch=True), y[half]))
        optimizer.step()
        optimizer.zero_grad()


def _reduce_worker(rank: int, world: int) -> None:
    for stage in (1, 2):
        timing = Stage1Timing()
        strategy = zero_strategy(stage, reduce_bucket_size=40)
        make_trainer(strategy, world, steps=4, accumulate=2, callbacks=[timing]).fit(EquivalenceModule("toy", steps=4))
        launched_early = timing.inside_backward[1::2]  # the last micro-batch of each step
        if stage == 1:
            assert timing.inside_backward[0::2] == [0] * 4, timing.inside_backward  # accumulating: nothing sent
            assert all(n > 0 for n in launched_early), timing.inside_backward
            assert timing.buffers == [0] * 8  # stage 1 reduces out of its flat gradient
        else:
            assert all(n > 0 for n in timing.inside_backward), timing.inside_backward
            assert timing.buffers[-1] == timing.buffers[1] > 0, timing.buffers  # allocated once, then reused

    # Manual optimization: stage 1 cannot know which backward is the step's last, so it reduces at the
    # step, once; a step without any backward still steps (with no gradients).
    timing = Stage1Timing()
    make_trainer(
        zero_strategy(1, reduce_bucket_size=40), world, steps=4, accumulate=1, clip=None, callbacks=[timing]
    ).fit(TwoBackwards())
    assert timing.inside_backward == [0] * 6, timing.inside_backward


def test_stage1_reduces_in_the_last_backward_and_stage2_reuses_buffers(ranks):
    ranks(_reduce_worker, 2)


class OverlapProbe(pl.Callback):
    """At each training step (after the first): how many buckets are still being gathered when it starts, and
    whether the read of block 3's weight by the root's forward waited for exactly that bucket."""

    def __init__(self) -> None:
        self.pending_at_start: list[int] = []
        self.read_ok: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        gathers = trainer.strategy.engine.gathers
        self.pending_at_start.append(len(gathers._pending))
        if gathers._pending:
            weight = pl_module.net.blocks[3].lin.weight
            key = gathers._key_of[id(weight)]
            others = len(gathers._pending) - 1
            F.linear(torch.zeros(1, 9), weight)  # read outside its module, as BlocksNet does
            self.read_ok.append(key not in gathers._pending and len(gathers._pending) == others)


def _overlap_worker(rank: int, world: int) -> None:
    for stage in (1, 2):
        results = {}
        for overlap in (True, False):
            probe = OverlapProbe()
            pl.seed_everything(0)
            module = EquivalenceModule("blocks", steps=6)
            strategy = zero_strategy(stage, reduce_bucket_size=40, overlap_param_gather=overlap)
            make_trainer(strategy, world, steps=6, accumulate=1, callbacks=[probe]).fit(module)
            results[overlap] = (module.losses, {k: v.clone() for k, v in module.state_dict().items()})
            if overlap:
                assert all(n > 1 for n in probe.pending_at_start[1:]), probe.pending_at_start
                assert probe.read_ok and all(probe.read_ok), probe.read_ok
            else:
                assert probe.pending_at_start == [0] * 6, probe.pending_at_start
        (losses_on, state_on), (losses_off, state_off) = results[True], results[False]
        assert losses_on == losses_off
        for name, value in state_on.items():
            assert torch.equal(value, state_off[name]), f"stage {stage}: {name} differs with overlapped gathers"


def test_gathers_overlap_the_forward_and_change_nothing(ranks):
    ranks(_overlap_worker, 2)


def _collectives_worker(rank: int, world: int) -> None:
    torch.manual_seed(rank)
    n = 6 * world
    x = torch.randn(n, dtype=torch.float64)
    native_rs = torch.empty(n // world, dtype=torch.float64)
    dist.reduce_scatter_single(native_rs, x.clone())
    ours = x.clone()
    collectives.wait(collectives.reduce_scatter(ours[rank * 6 : rank * 6 + 6], ours, async_op=True))  # in place
    torch.testing.assert_close(ours[rank * 6 : rank * 6 + 6], native_rs, rtol=1e-15, atol=0)
    out = torch.empty(6, dtype=torch.float64)
    collectives.reduce_scatter(out, x.clone(), async_op=False)  # into a separate output
    torch.testing.assert_close(out, native_rs, rtol=1e-15, atol=0)  # equal up to summation order
    shard = torch.full((6,), float(rank))
    native_ag, ours_ag = torch.empty(n), torch.empty(n)
    dist.all_gather_single(native_ag, shard)
    collectives.all_gather(ours_ag, shard, async_op=False)
    assert torch.equal(ours_ag, native_ag)
    assert collectives._decomposed(None)  # gloo


def test_gloo_collectives_equal_the_native_ones(ranks):
    ranks(_collectives_worker, 3)


class StepCollectives(pl.Callback):
    """The collectives issued from the optimizer step's start to the end of the batch."""

    def __init__(self) -> None:
        self.steps: list[list[tuple]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._recording = collectives.record()
        self._log = self._recording.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._recording.__exit__(None, None, None)
        self.steps.append(self._log)


def _persistent_worker(rank: int, world: int) -> None:
    states = {}
    for threshold in (100_000, 0):  # every unit of BlocksNet persistent, or none
        probe = StepCollectives()
        pl.seed_everything(0)
        module = EquivalenceModule("blocks", steps=4)
        strategy = zero_strategy(3, param_persistence_threshold=threshold)
        make_trainer(strategy, world, steps=4, accumulate=1, callbacks=[probe]).fit(module)
        gathers = [[op for op in step if op[0] == "all_gather"] for step in probe.steps]
        if threshold:
            runtime = strategy.engine.stage3
            units = [u for k in sorted(runtime.schedule.persistent) for u in runtime.scheduled[k]]
            persistent = [u for u in units if u.trainable]  # frozen ones do not change: not gathered again
            assert len(persistent) > 2
            expected = sum(u.layout.total_numel for u in persistent)
            assert all(len(g) == 1 and g[0][2] == expected for g in gathers), (gathers, expected)
        else:
            assert all(not g for g in gathers), gathers
        states[threshold] = strategy.gather_module().state_dict()
    for name, value in states[0].items():
        assert torch.equal(value, states[100_000][name]), name


def test_stage3_regathers_persistent_units_in_one_collective(ranks):
    ranks(_persistent_worker, 2)


class StepReductions(pl.Callback):
    """The element counts of the reduce-scatters issued in each training step (forward, backward, step)."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._recording = collectives.record()
        self._log = self._recording.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._recording.__exit__(None, None, None)
        self.steps.append([numel for op, _, numel, _ in self._log if op == "reduce_scatter"])


def _coalesce_worker(rank: int, world: int) -> None:
    results = {}
    for bucket in (1, 150, 10**9):  # every unit alone; a few together; everything at once
        probe = StepReductions()
        pl.seed_everything(0)
        module = EquivalenceModule("blocks", steps=6)
        strategy = zero_strategy(3, reduce_bucket_size=bucket, param_persistence_threshold=0)
        make_trainer(strategy, world, steps=6, accumulate=1, callbacks=[probe]).fit(module)
        sizes = [u.layout.total_numel for u in strategy.engine.stage3.units if u.trainable]
        assert all(sum(step) == sum(sizes) for step in probe.steps), (probe.steps, sizes)  # every unit, once
        if bucket == 1:
            assert all(sorted(step) == sorted(sizes) for step in probe.steps), (probe.steps, sizes)
        elif bucket == 150:
            assert all(1 < len(step) < len(sizes) for step in probe.steps), (probe.steps, sizes)
            # a group is launched once it holds 150 elements, or early when a unit that large comes next
            assert all(n >= 150 or after >= 150 for step in probe.steps for n, after in zip(step, step[1:]))
        else:
            assert all(len(step) == 1 for step in probe.steps), probe.steps
        results[bucket] = (module.losses, strategy.gather_module().state_dict())
    losses, state = results[1]
    for bucket, (other_losses, other_state) in results.items():
        assert other_losses == losses, bucket
        for name, value in state.items():
            assert torch.equal(value, other_state[name]), f"reduce_bucket_size={bucket}: {name} differs"


def test_stage3_reductions_fill_buckets_of_reduce_bucket_size_and_change_nothing(ranks):
    ranks(_coalesce_worker, 2)

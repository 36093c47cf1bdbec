"""Sequence parallelism (sequence/): Ulysses attention on 2 and 4 ranks, each holding a slice of the sequence (the
output slice and the gradients of its q, k and v slices equal those of attention over the whole sequence in one
process, causal and not, with grouped-query attention whose key/value heads are split or repeated; head counts that
do not split are refused in one line), and the GPT trained sequence-parallel under ZeRO (SP=2 on 2 ranks at stages
1-3; SP=4 and 2 replicas x SP=2 on 4; activation checkpointing and tiled MLP and loss at stage 3), through Fabric and
the plain script's door, and with a loss over real tokens only, against one process."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

import lightning_zero
from lightning_zero import ZeroConfig, ZeroFabricStrategy
from lightning_zero.models.gpt import GPT
from lightning_zero.sequence.parallel import sequence_parallel, token_mean
from lightning_zero.sequence.ulysses import check_heads, ulysses_attention
from lightning_zero.sharding import collectives
from tests.support.compare import relative_error
from tests.support.helpers import EquivalenceModule, make_trainer, zero_strategy

B, S, D = 2, 16, 8
# (query heads, key/value heads): plain, GQA split (K divides 2 at K=2), GQA repeated (K=4 a multiple of 2)
HEADS = [(4, 4), (8, 2)]


def _inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(B, heads, S, D, generator=g)
    k, v = (torch.randn(B, kv_heads, S, D, generator=g) for _ in range(2))
    weight = torch.randn(B, heads, S, D, generator=g)  # (a loss that weighs every output element differently)
    return q, k, v, weight


def _attention(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kwargs)


def _whole(heads: int, kv_heads: int, causal: bool) -> dict[str, torch.Tensor]:
    q, k, v, weight = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(heads, kv_heads)))
    out = _attention(q, k, v, is_causal=causal)
    (out * weight).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _worker(rank: int, world: int) -> dict:
    results = {}
    part = slice(rank * S // world, (rank + 1) * S // world)
    for heads, kv_heads in HEADS:
        for causal in (False, True):
            q, k, v, weight = (
                t[:, :, part].clone().requires_grad_(i < 3) for i, t in enumerate(_inputs(heads, kv_heads))
            )
            with collectives.record() as log:
                out = ulysses_attention(q, k, v, _attention, is_causal=causal)
                (out * weight).sum().backward()
            assert [entry[0] for entry in log] == ["all_to_all"] * 8  # q, k, v, out; and their backward
            results[heads, kv_heads, causal] = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_attention_equals_attention_over_the_whole_sequence(ranks, world):
    results = ranks(_worker, world)
    for (heads, kv_heads, causal), _ in results[0].items():
        whole = _whole(heads, kv_heads, causal)
        for rank, result in enumerate(results):
            part = slice(rank * S // world, (rank + 1) * S // world)
            for name, value in result[heads, kv_heads, causal].items():
                err = relative_error(value, whole[name][:, :, part])
                assert err <= 1e-6, f"{heads}/{kv_heads} heads, causal {causal}, rank {rank}: {name} off by {err:.1e}"


def test_heads_the_sequence_parallel_size_cannot_split_are_refused():
    with pytest.raises(ValueError, match="sequence_parallel_size 4 must divide the attention heads, 6"):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match="must divide the key/value heads, 3, or be a multiple of them"):
        check_heads(12, 3, 2)
    check_heads(8, 2, 4)  # (a multiple of them: each key/value head repeated)
    check_heads(8, 4, 2)


STEPS = 6


class SequenceGPT(EquivalenceModule):
    """The equivalence GPT, each sample's sequence split over the ``size`` ranks of a sequence-parallel group; the
    groups are the data-parallel replicas (rank r of a replica takes tokens r*S/K to (r+1)*S/K of its samples);
    with ``tiles``, its MLP and loss computed over that many tiles of each slice (activations/tiled.py)."""

    def __init__(self, tiles: int = 1, heads: int = 2, masked: bool = False) -> None:
        super().__init__("gpt", steps=STEPS, lazy=True)
        self.masked = masked  # (targets left out as _masked does: the GPT's loss is its group's real tokens' mean)
        self.gpt_config = dataclasses.replace(self.gpt_config, mlp_tiles=tiles, loss_tiles=tiles, n_head=heads)
        self.samples: list[list[int]] = []

    def configure_model(self):
        if self.net is None:  # (ZeroConfig(sequence_parallel_size=K)'s groups)
            self.sequence = self.trainer.strategy.sequence_parallel
            self.net = GPT(self.gpt_config, sequence=self.sequence)

    def training_step(self, batch, batch_idx):
        self.samples.append(batch[0].sum(1).tolist())  # (which samples this rank read: its group's, its replica's)
        x, y = batch[0], _masked(*batch) if self.masked else batch[1]
        x, y = self.sequence.split(x), self.sequence.split(y)
        self.losses.append(float(loss := self.net(x, y)))  # (the GPT's own loss, tiled or not)
        return loss

    def train_dataloader(self):  # (the strategy's sampler arguments, as Lightning's own sampler takes them)
        sampler = DistributedSampler(self.data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(self.data, batch_size=self.global_batch // sampler.num_replicas, sampler=sampler)


CHECKPOINTED = {"activation_checkpointing": "units", "param_persistence_threshold": 0}
# world -> (stage, sequence_parallel_size, ZeroConfig fields, tiles, masked): SP=2 on 2 ranks at every stage; on 4
# ranks SP=4 (one replica) and 2 replicas x SP=2, with optimizer and parameter offload, hybrid sharding and ZeRO++'s
# secondary partition; the last stage 3 runs with MLP and loss in 2 tiles of each slice, on 2 ranks with targets
# left out (the HF Llama's runs in test_sequence_hf.py take SP=4 at stage 2 and 2 x SP=2 at
# stage 1)
OFFLOADED = {"offload_optimizer": "cpu"}
HYBRID = {"shard_group_size": 2}  # (shards over each pair, replicas across them)
HPZ = {**CHECKPOINTED, "secondary_partition": True, "node_size": 2}  # (ZeRO++'s exact part)
# all of ZeRO++: int8 weights and gradients on the wire, so within quantization's error of one process
ZERO_PLUS_PLUS = {**HPZ, "quantized_weights": True, "quantized_gradients": True}
RUNS = {
    2: [(1, 2, {}, 1, False), (2, 2, {}, 1, False), (3, 2, CHECKPOINTED, 2, True)],
    4: [
        (1, 4, OFFLOADED, 1, False),
        (2, 2, HYBRID, 1, False),
        (3, 2, HPZ, 1, False),
        (3, 4, {**CHECKPOINTED, **OFFLOADED, "offload_param": "cpu"}, 2, False),
        (3, 2, ZERO_PLUS_PLUS, 1, False),
    ],
}


def _train_worker(rank: int, world: int) -> dict:
    out = []
    for stage, size, config, tiles, masked in RUNS[world]:
        pl.seed_everything(0)
        module = SequenceGPT(tiles=tiles, heads=max(size, 2), masked=masked)
        strategy = zero_strategy(stage, reduce_bucket_size=3000, sequence_parallel_size=size, **config)
        make_trainer(strategy, world, steps=STEPS).fit(module)
        assert module.sequence.size == size and module.sequence.data_size == world // size
        state = module.trainer.strategy.gather_module().state_dict()
        out.append({"state": state, "norms": module.grad_norms, "samples": module.samples, "losses": module.losses})
    return out


@functools.cache
def _reference(heads: int = 2, masked: bool = False):
    pl.seed_everything(0)
    module = MaskedGPT() if masked else EquivalenceModule("gpt", steps=STEPS)
    module.gpt_config = dataclasses.replace(module.gpt_config, n_head=heads)  # (the same parameters)
    module.net = GPT(module.gpt_config)
    make_trainer("auto", 1, steps=STEPS).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}, module.grad_norms, module.losses


@pytest.mark.parametrize("world", [2, 4])
def test_the_gpt_trained_sequence_parallel_equals_one_process(ranks, world):
    """Against the untiled, unsplit run of one process; the ranks of a group read the same samples."""
    results = ranks(_train_worker, world)
    for index, (stage, size, config, _, masked) in enumerate(RUNS[world]):
        samples = [result[index]["samples"] for result in results]  # a group's ranks read the same samples
        assert all(samples[rank] == samples[rank // size * size] for rank in range(world)), (stage, size)
        assert world == size or samples[0] != samples[size], (stage, size)  # and the replicas other ones
        reference, norms, losses = _reference(max(size, 2), masked)  # (as many heads as the run, at least 2)
        # ZeRO++'s int8 weights and gradients: the losses within 1% of one process's (as in test_zero_plus_plus.py)
        tolerance, loss_tolerance = (5e-2, 1e-2) if config is ZERO_PLUS_PLUS else (1e-5, 1e-5)
        for rank, result in enumerate(results):
            where, run = f"world {world} SP {size} stage {stage} {sorted(config)} rank {rank}", result[index]
            logged = torch.tensor([r[index]["losses"] for r in results]).mean(0)  # (the sync_dist mean)
            assert relative_error(logged, torch.tensor(losses)) <= loss_tolerance, where
            assert relative_error(torch.tensor(run["norms"]), torch.tensor(norms)) <= tolerance, where
            errors = {name: relative_error(run["state"][name], value) for name, value in reference.items()}
            assert max(errors.values()) <= tolerance, f"{where}: {errors}"
            assert config is not ZERO_PLUS_PLUS or max(errors.values()) > 1e-4, where  # (int8 on the wire indeed)


def _fabric_loop(engine, model, optimizer, data, sequence) -> list[float]:
    losses = []
    for x, y in data:
        if sequence is not None:
            x, y = sequence.split(x), sequence.split(y)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        engine.backward(loss) if engine is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _fabric_worker(rank: int, world: int) -> dict:
    """Fabric's door (the strategy's groups and sampler arguments), then the plain script's (``init_distributed``'s
    session, then ``initialize``): the same loop as one process's."""
    config = ZeroConfig(stage=3, sequence_parallel_size=world, param_persistence_threshold=0, timeout=120)
    fabric = Fabric(strategy=ZeroFabricStrategy(config), accelerator="cpu", devices=world)
    fabric.launch()
    pl.seed_everything(0)
    module = EquivalenceModule("gpt", steps=STEPS)
    sequence = fabric.strategy.sequence_parallel
    model = GPT(module.gpt_config, sequence=sequence)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sampler = DistributedSampler(module.data, shuffle=False, **fabric.strategy.distributed_sampler_kwargs)
    losses = _fabric_loop(fabric, model, optimizer, DataLoader(module.data, batch_size=8, sampler=sampler), sequence)
    out = {"fabric": {"losses": losses, "state": fabric.strategy.get_module_state_dict(model)}}

    session = lightning_zero.init_distributed(dataclasses.replace(config, stage=2))
    pl.seed_everything(0)
    model = GPT(module.gpt_config, sequence=session.sequence_parallel)
    engine = session.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sampler = DistributedSampler(module.data, shuffle=False, **session.sampler_kwargs)
    loader = DataLoader(module.data, batch_size=8, sampler=sampler)
    losses = _fabric_loop(engine, engine, engine.optimizer, loader, session.sequence_parallel)
    out["script"] = {"losses": losses, "state": engine.state_dict()}
    unsplit = GPT(module.gpt_config, sequence=session.sequence_parallel)  # the whole sequence on every rank: refused
    with pytest.raises(ValueError, match="ranks of a sequence-parallel group got the same tokens"):
        unsplit(next(iter(loader))[0][:, :8])  # (as long as a slice, the same on both ranks)
    return out


def test_fabric_and_the_plain_script_train_sequence_parallel_as_one_process(ranks):
    pl.seed_everything(0)
    module = EquivalenceModule("gpt", steps=STEPS)
    model = GPT(module.gpt_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _fabric_loop(None, model, optimizer, DataLoader(module.data, batch_size=8), None)
    results = ranks(_fabric_worker, 2)
    for door in ("fabric", "script"):
        halves = torch.tensor([r[door]["losses"] for r in results]).mean(0)  # (each rank's loss: its half's mean)
        assert relative_error(halves, torch.tensor(losses)) <= 1e-5, door
        for rank, result in enumerate(results):
            for name, value in model.state_dict().items():
                assert relative_error(result[door]["state"][name], value) <= 1e-5, (door, rank, name)


def _masked(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Targets left out (-100) in the first 5 positions of the samples whose first token is even: the ranks'
    slices, and the replicas, hold different numbers of real tokens."""
    y = y.clone()
    y[x[:, 0] % 2 == 0, :5] = -100
    return y


class MaskedGPT(EquivalenceModule):
    """One process: the mean over the real tokens (cross_entropy's ignore_index)."""

    def __init__(self) -> None:
        super().__init__("gpt", steps=STEPS)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x, _masked(x, y)), batch_idx)


class MaskedSequenceGPT(SequenceGPT):
    """Sequence-parallel: each rank's losses over its slice, normalized by the real tokens of every rank."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x, y = (self.sequence.split(t) for t in (x, _masked(x, y)))
        losses = F.cross_entropy(self.net(x).flatten(0, 1).float(), y.flatten(), reduction="none")
        loss = token_mean(losses, y.flatten() != -100, world_size=self.trainer.world_size)
        self.losses.append(float(loss))
        return loss


def _masked_worker(rank: int, world: int) -> dict:
    pl.seed_everything(0)
    module = MaskedSequenceGPT()
    strategy = zero_strategy(2, reduce_bucket_size=3000, sequence_parallel_size=2)
    make_trainer(strategy, world, steps=STEPS).fit(module)
    return {"state": module.trainer.strategy.gather_module().state_dict(), "losses": module.losses}


def test_a_loss_over_the_real_tokens_of_uneven_slices_equals_one_process(ranks):
    """2 replicas x SP=2: both the slices and the replicas hold different numbers of real tokens."""
    world = 4
    reference, _, losses = _reference(2, masked=True)
    results = ranks(_masked_worker, world)
    logged = torch.tensor([r["losses"] for r in results]).mean(0)  # (a sync_dist mean of the ranks' values)
    assert relative_error(logged, torch.tensor(losses)) <= 1e-5
    for rank, result in enumerate(results):
        for name, value in reference.items():
            assert relative_error(result["state"][name], value) <= 1e-5, (world, rank, name)


def _lengths_worker(rank: int, world: int) -> None:
    """Two groups whose samples have other lengths: ZeroConfig.check_collectives compares the world's collectives,
    a group's all-to-alls only inside the group (no false alarm)."""
    sequence = sequence_parallel(2)
    with contextlib.ExitStack() as stack:
        check = collectives.SequenceCheck(stack)
        length = 8 * (sequence.data_rank + 1)  # 8 tokens a sample in one group, 16 in the other
        q, k, v = (torch.randn(1, 2, length // 2, 4) for _ in range(3))
        ulysses_attention(q, k, v, F.scaled_dot_product_attention, group=sequence.group)
        check.check("after attention")


def test_groups_running_other_lengths_pass_the_collective_check(ranks):
    ranks(_lengths_worker, 4)

"""Sequence parallelism in the planning models, in one process: comm_model's ``Ulysses`` all-to-all bytes by hand
(grouped-query heads split and repeated, each checkpointing mode), in ``step_collectives`` and by link, the time
model's compute and exposure, the longest sequence a group splits, and ``lightning-zero estimate --seq-len --sp``.
What a real run's all-to-alls cover and a real rank saves are compared with these models in
tests/dist/test_sequence_traffic.py."""

from __future__ import annotations

import pytest

from lightning_zero.planning.activations import ActivationProfile, longest_fitting
from lightning_zero.planning.comm_model import Ulysses, link_bytes, step_collectives
from lightning_zero.planning.estimate_model import activation_profiler
from lightning_zero.planning.time_model import Hardware, flops_per_token, predict_step
from tests.support.helpers import run_cli


@pytest.mark.parametrize("mode", ["none", "units", "selective"])
def test_all_to_all_bytes_by_hand(mode):
    passes = 3 if mode != "none" else 2  # forward, backward, and the checkpoint's recomputation
    # 4 ranks, 8 query heads of 16 elements, 2 bytes: 2 key/value heads are repeated to 4, one per rank
    repeated = Ulysses(2, 64, 8, 2, 16, 4, 2, mode)
    assert repeated.layer_bytes() == passes * 2 * 16 * 16 * (8 + 8 + 4 + 4) * 2  # B x S/K x D x heads x e
    split = Ulysses(2, 64, 8, 4, 16, 2, 2, mode)  # 2 ranks: the 4 key/value heads split
    assert split.layer_bytes() == passes * 2 * 32 * 16 * (8 + 8 + 4 + 4) * 2


def test_the_exchanges_join_every_strategy_and_cross_nodes_directly():
    ulysses = Ulysses(1, 1024, 4, 4, 8, 4, layers=3)  # fp32: 256 positions x 8 x 16 heads x 4 bytes per pass
    per_step = 3 * 2 * 256 * 8 * 16 * 4
    for strategy in ("ddp", "zero2", "zero3"):
        ops = step_collectives(strategy, 1000, world_size=8, micro_batches=2, sequence=ulysses)
        assert ops["sequence", "all_to_all"] == 2 * per_step, strategy
    alone = {("sequence", "all_to_all"): per_step}
    # a group of 4 on nodes of 2: 3/4 of the buffer leaves the rank, to 1 peer on its node and 2 on the other
    assert link_bytes(alone, world_size=8, per_node=2, sequence_size=4) == pytest.approx((per_step / 4, per_step / 2))
    assert link_bytes(alone, world_size=8, per_node=4, sequence_size=4) == pytest.approx((3 * per_step / 4, 0))
    assert "sequence" not in str(step_collectives("zero2", 1000, world_size=8, sequence=Ulysses(1, 8, 4, 4, 8, 1)))


def test_a_rank_computes_its_slices_and_waits_for_its_exchanges():
    hw = Hardware(tflops=1.0, intra_gbs=1.0, inter_gbs=1.0)
    ulysses = Ulysses(2, 4096, 8, 8, 64, 2, layers=4)
    psi, tokens = 10_000_000, 2 * 4096 // 2  # a rank's slices: B S / K
    alone = predict_step("zero2", psi, hw, tokens=tokens, world_size=2, per_node=2)
    step = predict_step("zero2", psi, hw, tokens=tokens, world_size=2, per_node=2, sequence=ulysses)
    # attention over the whole sequence for the rank's H / K heads: 12 n_layer S d per token of its slices
    assert step.compute == pytest.approx(flops_per_token(psi, (4, 4096, 512)) * tokens / 1e12)
    exchanges = 4 * ulysses.layer_bytes() / 2 / 1e9  # half of every buffer goes to the other rank
    assert step.intra == pytest.approx(alone.intra + exchanges)
    assert step.exposed == pytest.approx(exchanges)  # never hidden: attention waits for them
    # each of the 32 exchanges (4 layers: q, k, v, output, forward and backward) also pays a small all-to-all's time
    slow = Hardware(tflops=1.0, intra_gbs=1.0, inter_gbs=1.0, all_to_all_us=100.0)
    step = predict_step("zero2", psi, slow, tokens=tokens, world_size=2, per_node=2, sequence=ulysses, micro_batches=2)
    assert ulysses.exchanges() == 32 and step.exposed == pytest.approx(2 * exchanges + 2 * 32 * 100e-6)


def test_the_longest_sequence_is_one_a_group_splits():
    def linear(seq_len: int) -> ActivationProfile:  # 100 bytes per token in each of 4 blocks, 10 of them its input
        return ActivationProfile(0, 0, [100 * seq_len] * 4, [10 * seq_len] * 4, [0] * 4, [0] * 4)

    budget = 1_000_000  # none: 410 bytes per token (the gradient of a block's input too): 2439 tokens
    assert longest_fitting(linear, budget, "none", False, multiple=4) == 2436
    assert longest_fitting(linear, 1000, "none", False, multiple=4) == 0  # not even 4 tokens


def test_estimate_with_sequence_parallelism(capsys):
    args = ("--model", "configs/gpt.yaml", "--devices", "2", "--seq-len", "2048", "--sp", "2")
    code, out, err = run_cli(capsys, "estimate", *args, "--tflops", "1", "--intra-bw", "1", "--inter-bw", "1")
    assert code == 0, err
    # configs/gpt.yaml: 16 samples, 4 layers of 4 heads of 32; fp32, no checkpointing: 2 passes
    per_layer = Ulysses(16, 2048, 4, 4, 32, 2).layer_bytes()
    assert f"all-to-alls cover {per_layer / 2**20:.2f} MiB per rank per micro-batch" in out
    zero2 = [line.split() for line in out.splitlines() if line.startswith("zero2")]
    psi = int(out.split()[0].replace(",", ""))  # (zero2's reduce-scatter and all-gather of 4 psi bytes, and the
    sent = (2 * 4 * psi + 4 * per_layer) / 2 / 1e9  # exchanges: half of every buffer goes to the other rank)
    assert float(zero2[1][1]) == pytest.approx(sent, abs=1e-3)
    assert float(zero2[2][4]) == pytest.approx(4 * per_layer / 2 / 1e9, abs=1e-3)  # exposed: the exchanges
    table = out.split("each rank 1024 tokens of each (--sp 2) (zero.activation_checkpointing), GiB:")[1]
    sliced = {line.split()[0]: float(line.split()[1]) for line in table.splitlines()[2:7]}
    profile, _ = activation_profiler("configs/gpt.yaml")  # (one process: every token of each sample)
    for mode in ("none", "units", "selective"):
        whole = profile(2048).held(mode)[0] / 2**30
        assert 0.4 * whole < sliced[mode] < 0.6 * whole, mode  # about half: a slice, and half of the heads

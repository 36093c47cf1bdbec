"""The communication model (comm_model.py) and ``lightning-zero estimate``'s hybrid and traffic output.

What the collectives of a real run carry per group is checked against ``step_collectives`` in
test_hybrid.py; here: the ring's split by link on hand-counted cases, and the CLI."""

from __future__ import annotations

import pytest

from lightning_zero.planning.comm_model import link_bytes, ring_inter_fraction, step_collectives
from tests.support.helpers import run_cli


def test_ring_hops_between_nodes():
    assert ring_inter_fraction(list(range(8)), per_node=4) == 2 / 8  # 3 -> 4 and 7 -> 0
    assert ring_inter_fraction([0, 4], per_node=4) == 1.0
    assert ring_inter_fraction([0, 1], per_node=4) == 0.0
    assert ring_inter_fraction([0, 2, 4, 6], per_node=4) == 2 / 4


@pytest.mark.parametrize("micro", [1, 4])
def test_flat_and_hybrid_zero2_by_hand(micro):
    total = 1000  # fp32 elements, 4 ranks on 2 nodes
    flat = step_collectives("zero2", total, world_size=4, micro_batches=micro)
    assert flat == {("world", "reduce_scatter"): 4000 * micro, ("world", "all_gather"): 4000}
    # a ring over 4 ranks sends 3/4 of each buffer per rank; half of its hops join the two nodes
    sent = 0.75 * 4000 * (micro + 1)
    assert link_bytes(flat, world_size=4, per_node=2) == (sent / 2, sent / 2)
    hybrid = step_collectives("zero2", total, world_size=4, shard_size=2, micro_batches=micro)
    assert hybrid[("replicate", "all_reduce")] == 2000  # the fp32 partition of 500 elements, once per step
    # inside the node: half of each buffer per rank; across: the all-reduce over 2 replicas sends it once
    assert link_bytes(hybrid, world_size=4, per_node=2, shard_size=2) == (0.5 * 4000 * (micro + 1), 2000)


def test_zero3_gathers_twice_per_micro_batch_at_most():
    ops = step_collectives("zero3", 100, world_size=8, grad_bytes=2, param_bytes=2, micro_batches=3)
    assert ops == {("world", "reduce_scatter"): 600, ("world", "all_gather"): 1200}


def test_estimate_reports_hybrid_memory_and_traffic_by_link(capsys):
    args = ("estimate", "--params", "7.5e9", "--devices", "8")
    code, out, err = run_cli(capsys, *args, "--nodes", "8", "--precision", "16-mixed", "--shard-group-size", "node")
    assert code == 0, err
    assert "sharded in groups of 8 ranks (hybrid)" in out
    zero3 = [line.split() for line in out.splitlines() if line.startswith("zero3")]
    assert zero3[0][4] == "13.970"  # memory: 16 Psi / 8 in GiB, the states sharded over the 8 ranks of a node
    # every stage sends only its partition's all-reduce between nodes: 2 (8-1)/8 x 2 bytes x 7.5e9 / 8
    inter = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("zero")][-3:]
    assert inter == [3.281, 3.281, 3.281], inter
    code, out, err = run_cli(capsys, *args, "--nodes", "2", "--shard-group-size", "3")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].endswith("zero.shard_group_size must divide the world size 16, got 3")


def test_zero_plus_plus_bytes_by_hand():
    total, block = 1024, 256  # fp32, 4 ranks on 2 nodes; q = 1 + 4 / 256 bytes per quantized element
    q = (1 + 4 / block) * total
    ops = step_collectives("zero3", total, world_size=4, zero_plus_plus=("qwZ", "hpZ", "qgZ"), block=block)
    assert ops == {
        ("world", "all_gather"): q,  # the forward's, int8
        ("node", "all_gather"): 4 * total,  # the backward's, inside the node
        ("node", "reduce_scatter"): 4 * total,
        ("cross", "all_to_all"): q / 2,  # the node's partial sums of this rank's half, int8
    }
    # our gloo collectives send each peer its part directly: 2 of a rank's 3 world peers are on the other node
    intra, inter = link_bytes(ops, world_size=4, per_node=2, algorithm="direct")
    assert inter == pytest.approx(0.75 * q * 2 / 3 + 0.5 * q / 2)
    assert intra == pytest.approx(0.75 * q / 3 + 0.5 * 4 * total * 2)
    plain = step_collectives("zero3", total, world_size=4)
    assert link_bytes(plain, world_size=4, per_node=2, algorithm="direct")[1] == pytest.approx(
        0.75 * 12 * total * 2 / 3
    )
    with pytest.raises(ValueError, match="zero_plus_plus must hold some of qwZ, hpZ, qgZ, got"):
        step_collectives("zero3", total, world_size=4, zero_plus_plus=("qwz",))


def test_estimate_adds_zero_plus_plus_across_nodes(capsys):
    code, out, err = run_cli(
        capsys, "estimate", "--params", "1.3e9", "--devices", "8", "--nodes", "4", "--cluster", "dgx-a100"
    )
    assert code == 0, err
    assert "secondary partition per node (ZeRO++'s hpZ, zero.secondary_partition): up to 0.61 GiB" in out
    sent = out.split("sent per rank per step")[1].split("predicted step")[0].splitlines()
    traffic = {line[:56].strip(): line.split()[-1] for line in sent if line.startswith("zero3")}
    assert float(traffic["zero3 + qwZ + hpZ + qgZ (ZeRO++)"]) < 0.3 * float(traffic["zero3"])
    predicted = out.split("predicted step per rank")[1].splitlines()
    steps = {
        line.split()[0]: float(line.split()[5]) for line in predicted if line.startswith("zero3") and ":" not in line
    }
    assert steps["zero3++"] < steps["zero3"]

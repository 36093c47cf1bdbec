"""The step-time model (time_model.py) and ``lightning-zero estimate``'s step-time output.

- Exposure by hand: what compute hides and what it does not (hybrid's replica all-reduce never hides).
- The largest model per configuration follows the memory formulas.
- The check against measured steps on this machine is a benchmark, not a test (timings are never
  asserted): benchmarks/time_model_check.py.
"""

from __future__ import annotations

import pytest

from lightning_zero.planning.time_model import CLUSTERS, Hardware, largest_psi, predict_step
from tests.support.helpers import run_cli

HW = Hardware(tflops=1.0, intra_gbs=1.0, inter_gbs=0.5)


def test_what_compute_hides():
    # 1e6 parameters x 6 flops x 1e5 tokens = 0.6 s of compute at 1 TFLOP/s
    flat = predict_step("zero2", 1_000_000, HW, tokens=100_000, world_size=4, per_node=2)
    assert flat.compute == pytest.approx(0.6)
    # 4 MB buffers, a ring over 4 ranks on 2 nodes: 3 MB sent per collective, half of the hops between nodes
    assert flat.intra == pytest.approx(2 * 1.5e6 / 1e9) and flat.inter == pytest.approx(2 * 1.5e6 / 0.5e9)
    assert flat.exposed == 0.0  # 4.5 ms per collective under 0.4 s of backward and 0.2 s of forward
    slow = predict_step("zero2", 1_000_000, Hardware(1.0, 1e-3, 1e-3), tokens=100_000, world_size=4, per_node=2)
    assert slow.exposed == pytest.approx(2 * 3e6 / 1e6 - 0.6)  # 3 s each, minus the 0.4 s and 0.2 s windows
    # stage 3's gathers (6 MB sent: 0.6 s) and reduce-scatter (3 MB: 0.3 s) share the 0.6 s of compute
    zero3 = predict_step("zero3", 1_000_000, Hardware(1.0, 0.01, 0.01), tokens=100_000, world_size=4, per_node=2)
    assert zero3.exposed == pytest.approx(0.3)
    hybrid = predict_step("zero2", 1_000_000, HW, tokens=100_000, world_size=4, per_node=2, shard_size=2)
    # the replica all-reduce of the 2 MB partition over 2 replicas sends 2 MB between nodes, once, not hidden
    assert hybrid.exposed == pytest.approx(2e6 / 0.5e9)


def test_largest_model_per_configuration():
    gib80 = 80 * 10**9
    assert largest_psi("ddp", gib80, shard_size=64, param_bytes=2) == 5 * 10**9  # 16 bytes per parameter
    assert largest_psi("zero3", gib80, shard_size=64, param_bytes=2) == 320 * 10**9  # 16 / 64
    with pytest.raises(ValueError, match="tflops must be a number > 0, got 0"):
        Hardware(tflops=0, intra_gbs=1, inter_gbs=1)


def test_estimate_predicts_with_a_preset_and_refuses_half_a_machine(capsys):
    args = ("--params", "7.5e9", "--devices", "8", "--nodes", "8", "--cluster", "dgx-a100", "--tokens", "4096")
    code, out, err = run_cli(capsys, "estimate", *args)
    assert code == 0, err
    assert f"{CLUSTERS['dgx-a100'].tflops:.3g} TFLOP/s" in out and "zero3" in out.splitlines()[-1]
    code, _, err = run_cli(capsys, "estimate", "--params", "1e9", "--tflops", "100")
    assert code == 2 and "the step time needs --intra-bw, --inter-bw too" in err
    code, _, err = run_cli(capsys, "estimate", "--params", "1e9", "--measure")
    assert code == 2 and "argument --measure: needs --model" in err

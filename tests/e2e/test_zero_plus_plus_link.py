"""ZeRO++ across a real link: two network namespaces joined by a veth pair, made and removed here by
benchmarks/zero_plus_plus_link.py's harness (addresses only inside them), 2 ranks in each under torchrun.
The bytes that cross are the kernel's count on the veth interface: with quantized weights, a secondary
partition and quantized gradients at most 0.3x plain stage 3's, and the namespaces are gone afterwards."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess

import pytest

from tests.support.helpers import REPO

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (network namespaces)"
)


def _harness():
    spec = importlib.util.spec_from_file_location("zero_plus_plus_link", REPO / "benchmarks" / "zero_plus_plus_link.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_all_three_send_at_most_0_3x_of_plain_stage_3_across_nodes(tmp_path):
    link = _harness()
    args = argparse.Namespace(steps=5, warmup=2, n_layer=2, n_embd=64, batch=2, timeout=300)
    with link.two_nodes(None):
        assert all(ns in _namespaces() for ns in link.NAMESPACES)
        plain = link.run("plain", args, tmp_path / "plain.json")
        plus = link.run("all", args, tmp_path / "all.json")
    assert not any(ns in _namespaces() for ns in link.NAMESPACES)
    crossed = plain["link_bytes_per_step"]
    assert crossed >= plain["psi"] * 4  # the stage's gathers and reductions really crossed the veth link
    assert plus["link_bytes_per_step"] <= 0.3 * crossed, (plus["link_bytes_per_step"], crossed)

"""`lightning-zero estimate`'s numbers are the bytes the strategies allocate, rank by rank, for the same model
and world size; a model given by its config is built on the meta device."""

from __future__ import annotations

import pytest

from lightning_zero.config import ZeroConfig
from lightning_zero.planning.estimate import OFFLOADED, STRATEGIES, ModelShape, estimate, shape_of_count
from lightning_zero.planning.estimate_model import shape_of_config
from lightning_zero.planning.memory import formula_bytes
from tests.support.helpers import run_cli


def test_count_only_estimate_follows_the_formulas():
    psi, n = 10_000_003, 8
    table = estimate(shape_of_count(psi), n, "16-mixed", ZeroConfig())
    padded = psi + (-psi % (2 * n))
    assert table["zero2"][0].parameters == 2 * padded and table["zero2"][0].gradients == 2 * padded // n
    assert table["zero3"][0].total == pytest.approx(16 * psi / n, rel=1e-5)  # plus padding and a step counter
    assert table["ddp"][0].total == pytest.approx(16 * psi, rel=1e-5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("strategy", STRATEGIES + OFFLOADED)
def test_estimate_equals_the_formulas(strategy, precision):
    """`lightning-zero estimate`, `memory.formula_bytes` and the README's tables (which they are) agree: with
    no padding (Psi a multiple of 2N, one bucket) they differ only by Adam's step counter, 4 bytes per tensor."""
    psi, n = 1_000_000, 8
    rows = estimate(shape_of_count(psi), n, precision, ZeroConfig(), offload="cpu")[strategy]
    formula = formula_bytes(strategy, psi, n, param_bytes=2 if precision == "16-mixed" else 4)
    step = 4 if strategy in STRATEGIES else 0
    for row in rows:
        assert (row.parameters, row.gradients) == (formula["parameters"], formula["gradients"])
        assert row.optimizer_state == formula["optimizer_state"] + step
        if strategy in OFFLOADED:
            assert (row.host_parameters, row.host_gradients) == (formula["host_parameters"], formula["host_gradients"])
            assert row.host_optimizer_state == formula["host_optimizer_state"] + 4


def test_ddp_keeps_fp32_weights_under_16_mixed():
    """Lightning's ddp runs 16-mixed as autocast: frozen weights stay fp32 too, unlike ZeroPrecision's."""
    table = estimate(ModelShape([[1000]], [[1000]], 24), 2, "16-mixed", ZeroConfig())
    assert table["ddp"][0].parameters == 4 * 1024 and table["zero2"][0].parameters == 2 * 1024


def test_model_from_a_config_is_built_on_the_meta_device(capsys):
    shape, config = shape_of_config("configs/gpt.yaml")
    assert shape.psi == 805_632 and config.stage == 2 and config.reduce_bucket_size == 200_000
    assert [len(u) for u in shape.units] == [12] * 4 + [4]  # four blocks and the root (embeddings, final norm)
    code, out, err = run_cli(capsys, "estimate", "--model", "configs/gpt.yaml", "--devices", "4")
    assert code == 0, err
    assert "805,632 trainable parameters on 4 ranks" in out


def test_the_zero_paper_memory_figures():
    """ZeRO (Rajbhandari et al., 2020), Figure 1: a 7.5B-parameter model on 64 devices, Adam in mixed precision
    (K = 12 bytes of optimizer state per parameter): 120 GB per device for data parallelism, 31.4 GB with the
    optimizer state sharded (P_os), 16.6 GB with the gradients too (P_os+g), 1.9 GB with the parameters too."""
    table = estimate(shape_of_count(7_500_000_000), 64, "16-mixed", ZeroConfig())
    per_device_gb = {name: round(max(row.total for row in rows) / 1e9, 1) for name, rows in table.items()}
    assert per_device_gb == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}, per_device_gb


def test_nvme_rows_and_their_io_per_step(capsys):
    """``--offload nvme``: the configurations with the optimizer state (and zero3's shards) on NVMe, their disk bytes
    per rank (16 bytes a parameter: master, moments and the mapped fp32 gradient partition; and the shards' own), the
    host's (step counts and the ring of chunks) and the I/O of a step at ``--nvme-bw``, the node's ranks sharing the
    drives."""
    psi, n = 1 << 24, 2  # (whole chunks: no rounding)
    config = ZeroConfig(nvme_buffer_numel=1 << 22, nvme_buffer_count=3)
    table = estimate(shape_of_count(psi), n, "32-true", config, offload="nvme")
    row, with_params = table["zero3+nvme"][0], table["zero3+nvme_param"][0]
    assert row.nvme == 16 * psi // n and row.host_gradients == 0
    assert row.host_optimizer_state == 4 + 3 * 12 * (1 << 22)  # a step count and the ring
    assert (with_params.parameters, with_params.nvme) == (0, 20 * psi // n)
    code, out, _ = run_cli(capsys, "estimate", "--params", str(psi), "--devices", "2", "--offload", "nvme",
                           "--nvme-bw", "2", "--micro-batches", "2")  # fmt: skip
    assert code == 0 and "zero3+nvme_param" in out and "NVMe GiB" in out
    state = 16 * (1 << 24) // 2 / 2**30
    expected = f"{state:.3f} GiB of optimizer state and gradients read and written"
    assert expected in out and f"at 2 GB/s per node: >= {2 * state * 2**30 * 2 / 2e9:.3f} s" in out, out
    code, _, err = run_cli(capsys, "estimate", "--params", "1e6", "--nvme-bw", "2")
    assert code == 2 and "argument --nvme-bw: needs --offload nvme" in err

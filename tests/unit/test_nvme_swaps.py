"""A unit's optimizer state and parameter shard in swap files (nvme/optimizer_swap.py, nvme/param_swap.py): what is
written reads back, in whole, by the master runs alone, one parameter's chunks at a time; the step's records are
aligned, chunk by chunk; a shard's writes in flight are waited for by its next read."""

from __future__ import annotations

import torch

from lightning_zero.config import NvmeSwap
from lightning_zero.nvme.optimizer_swap import UnitSwap, record_bytes, split
from lightning_zero.nvme.param_swap import ParamSwap
from lightning_zero.nvme.swap_file import ALIGN, aligned_buffer, stream


def _settings(tmp_path, chunk: int = 2048) -> NvmeSwap:
    return NvmeSwap(tmp_path, chunk, 3, 1 << 13, 4)


def test_a_units_state_reads_back_whole_by_master_and_by_piece(tmp_path):
    numel = 5000  # chunks of 2048, 2048 and 904 elements (the last rounded up to 1024 in its record)
    swap = UnitSwap(_settings(tmp_path), numel)
    assert swap.chunks == [(0, 2048), (2048, 4096), (4096, 5000)]
    assert [nbytes for _, _, nbytes in swap.regions()] == [record_bytes(2048)] * 2 + [12 * 1024]
    assert all(offset % ALIGN == 0 for _, offset, _ in swap.regions())
    assert swap.file.nbytes == 2 * record_bytes(2048) + 12 * 1024
    master, exp_avg, exp_avg_sq = (torch.randn(numel) for _ in range(3))
    swap.write(master, exp_avg, exp_avg_sq)
    assert all(torch.equal(a, b) for a, b in zip(swap.read(), (master, exp_avg, exp_avg_sq)))
    swap.write(master)  # moments None: zeros
    assert torch.equal(swap.read()[1], torch.zeros(numel))
    swap.write(master, exp_avg, exp_avg_sq)
    changed = master.clone()
    changed[2000:2100] = 7.0  # (across the first two chunks)
    swap.update_master(2000, changed[2000:2100])
    assert torch.equal(swap.read_master(), changed) and torch.equal(swap.read()[2], exp_avg_sq)
    swap.write_master(master)  # the master runs only: the moments stay
    assert all(torch.equal(a, b) for a, b in zip(swap.read(), (master, exp_avg, exp_avg_sq)))


def test_the_steps_stream_sees_each_chunk_as_master_and_moments_runs(tmp_path):
    numel = 5000
    swap = UnitSwap(_settings(tmp_path), numel)
    master, exp_avg, exp_avg_sq = (torch.randn(numel) for _ in range(3))
    swap.write(master, exp_avg, exp_avg_sq)
    ring = [aligned_buffer(swap.buffer_bytes) for _ in range(3)]
    for record, (lo, hi) in zip(stream(swap.regions(), ring), swap.chunks):  # (the stream first: it is run to its end)
        runs = split(record, hi - lo)
        assert all(torch.equal(run, whole[lo:hi]) for run, whole in zip(runs, (master, exp_avg, exp_avg_sq)))
        runs[1].add_(1.0)  # written behind
    assert torch.equal(swap.read()[1], exp_avg + 1.0)


def test_a_shard_reads_back_after_its_writes_and_updates_in_place(tmp_path):
    numel = 6000
    swap = ParamSwap(_settings(tmp_path), numel, torch.bfloat16)
    values = torch.randn(numel)
    swap.write(0, values[:4096])
    swap.write(4096, values[4096:])  # (in flight: the read below waits for both)
    assert torch.equal(swap.read(), values.to(torch.bfloat16))
    swap.update(100, torch.full((10,), 3.0))  # (one block read and written)
    expected = values.to(torch.bfloat16)
    expected[100:110] = 3.0
    assert torch.equal(swap.start_read()(), expected)
    try:
        swap.write(100, values[:10])
    except ValueError as error:
        assert "4096-byte boundary" in str(error)
    else:
        raise AssertionError("an unaligned write was taken")

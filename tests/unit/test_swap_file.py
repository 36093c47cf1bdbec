"""The NVMe tier's swap files (nvme/swap_file.py): aligned buffers, direct I/O really on, reads and writes in
pieces in flight at once giving back what was written, the file made whole up front and removed at close, a bad
path or a full disk refused in one line before anything is written, and a stream of chunks through a few buffers
(read ahead, written behind)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest
import torch

from lightning_zero.nvme.swap_file import ALIGN, SwapFile, aligned_buffer, check_nvme_path, scratch_host, stream_chunks


def test_buffers_start_on_the_alignment_and_round_up_to_it():
    for nbytes in (1, ALIGN, 3 * ALIGN + 5):
        buffer = aligned_buffer(nbytes)
        assert buffer.data_ptr() % ALIGN == 0 and buffer.numel() == -(-nbytes // ALIGN) * ALIGN


def test_what_is_written_in_pieces_in_flight_reads_back_and_the_file_goes_at_close(tmp_path):
    swap = SwapFile(check_nvme_path(tmp_path), "rank0", 5 * 2**20 + 1, queue_depth=4, block_size=2**20)
    assert fcntl.fcntl(swap.fd, fcntl.F_GETFL) & os.O_DIRECT  # (the page cache bypassed)
    assert swap.path.stat().st_size == swap.nbytes == 5 * 2**20 + ALIGN  # (made whole up front)
    data = aligned_buffer(3 * 2**20 + 3 * ALIGN)  # (3 whole pieces and a short one)
    data.copy_(torch.randint(256, (data.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    writes = swap.write(2 * ALIGN, data)
    assert len(writes.pieces) == 4
    writes.wait()
    back = aligned_buffer(data.numel())
    swap.read(2 * ALIGN, back).wait()
    assert torch.equal(back, data)
    with pytest.raises(ValueError, match="aligned to 4096 bytes"):
        swap.read(100, back)
    with pytest.raises(ValueError, match="lie past the swap file"):
        swap.read(4 * 2**20, back)
    swap.close()
    assert not swap.path.exists() and list(tmp_path.iterdir()) == []


def test_a_path_that_is_no_directory_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="nvme_path '.*absent' is not a directory"):
        check_nvme_path(tmp_path / "absent")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
def test_a_disk_too_small_or_read_only_is_one_line_and_leaves_nothing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(OSError, match="cannot make a 4,194,304-byte swap file in .*: No space left on device"):
            SwapFile(check_nvme_path(disk), "rank0", 4 * 2**20)
        assert list(disk.iterdir()) == []
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)  # (root writes anywhere writable)
        with pytest.raises(ValueError, match="nvme_path '.*disk': cannot make a file there \\(Read-only file system"):
            check_nvme_path(disk)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_stream_reads_ahead_writes_behind_and_holds_only_its_buffers(tmp_path):
    swap = SwapFile(tmp_path, "rank0", 10 * ALIGN, queue_depth=2, block_size=ALIGN)
    start = aligned_buffer(9 * ALIGN)
    start.copy_(torch.randint(256, (start.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    swap.write(ALIGN, start).wait()
    seen = []
    for chunk in stream_chunks(swap, ALIGN, 9 * ALIGN, 2 * ALIGN, buffers=3):  # (5 chunks, the last one short)
        seen.append((chunk.numel(), chunk.data_ptr()))
        chunk.add_(1)  # (uint8: wraps)
    assert [n for n, _ in seen] == [2 * ALIGN] * 4 + [ALIGN]
    assert len({pointer for _, pointer in seen}) == 3  # three buffers, reused in turn
    back = aligned_buffer(9 * ALIGN)
    swap.read(ALIGN, back).wait()
    assert torch.equal(back, start + 1)  # every chunk written back, changed
    with pytest.raises(ValueError, match="a stream needs >= 3 buffers"):
        next(stream_chunks(swap, 0, ALIGN, ALIGN, buffers=2))
    swap.close()


def test_what_a_killed_process_of_this_host_left_is_removed_at_the_next_check(tmp_path):
    """A kill -9 skips the removal at exit; the next run's ``check_nvme_path`` removes what processes of this host
    that are gone left, never another host's files (a shared directory) or a live process's."""
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])  # (a process that has ended: its pid is free now)
    dead_pid.wait()
    host = scratch_host()
    left = tmp_path / f"lightning_zero_optimizer_{host}_{dead_pid.pid}_0123456789ab.swap"
    live = tmp_path / f"lightning_zero_params_{host}_{os.getpid()}_0123456789ab.swap"
    other = tmp_path / f"lightning_zero_optimizer_elsewhere_{dead_pid.pid}_0123456789ab.swap"
    for path in (left, live, other):
        path.write_bytes(b"x")
    assert check_nvme_path(tmp_path) == tmp_path
    assert not left.exists() and live.exists() and other.exists()

"""A rank that loses its peers stops at once with one line, so a launcher with restarts can start again.

When a rank dies (kill -9, a lost node) or stops answering, each collective the others are in (or reach
next) fails: at once when the connection closes, after ``ZeroConfig.timeout`` when the peer is silent.
Raised through Lightning, that failure would print a page of gloo or NCCL traceback and then tear down,
and tearing down a process group whose peers are gone can itself hang. ``exit_if_peer_failed`` (called by
the strategy's ``on_exception``) recognizes the failure, writes one line to stderr naming it and this
rank, and ends the process with ``EXIT_CODE`` without running teardown or exit handlers: nothing is
pending that the newest complete checkpoint needs (see checkpoint/save.py: a save that did not finish
is never visible).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

from lightning_zero.checkpoint.format import CheckpointError

EXIT_CODE = 1

# What gloo's, the TCP store's and NCCL's errors say when a peer closed the connection or stopped
# answering; nothing that a rank's own mistake (a size mismatch, invalid usage, out of memory) says.
_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Timed out waiting",
    "Application timeout caused pair closure",
    "connectFullMesh failed",
    "remote process exit",  # NCCL: "...or a remote process exiting prematurely"
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)


def peer_failure(error: BaseException) -> str | None:
    """The failure's own words (one line) when ``error`` is, or was caused by, a lost peer; else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, RuntimeError) and any(m in text for m in _MARKERS):  # DistError is a RuntimeError
            return _first_sentence(text)
        error = error.__cause__ or error.__context__
    return None


def _first_sentence(text: str) -> str:
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.strip())  # gloo's "[.../pair.cc:537] " prefix
    line = text.splitlines()[0] if text else "no message"
    sentence = re.split(r"(?<=[a-z0-9\)])\. ", line, maxsplit=1)[0]
    return sentence[:300]


def exit_if_peer_failed(error: BaseException, *, rank: int, world_size: int, loggers: Sequence = ()) -> None:
    """Ends the process with one line when ``error`` is a lost peer (see the module docstring), after the
    ``loggers`` have written what they hold."""
    what = peer_failure(error)
    if what is None or world_size < 2 or isinstance(error, CheckpointError):
        return  # CheckpointError: a save's or load's own problem, agreed by every rank (checkpoint/)
    for logger in loggers:
        try:
            logger.finalize("failed")
        except Exception:  # noqa: BLE001 - the line below matters more than a logger's last rows
            pass
    line = (
        f"lightning_zero: rank {rank} of {world_size} stops: a collective failed because another rank died"
        f" or stopped answering ({what}); exit code {EXIT_CODE}\n"
    )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.write(2, line.encode())
    os._exit(EXIT_CODE)

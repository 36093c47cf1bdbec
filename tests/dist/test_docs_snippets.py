"""The README's and the docs' blocks that need 2 ranks (``<!-- snippet: ranks=2 -->``) run on the test pool, a
page's blocks in order as one session (tests/support/docs.py's Note), in one scratch directory the ranks share
as nodes share a filesystem."""

from __future__ import annotations

import pytest

from tests.support import docs

SESSIONS = docs.sessions(2)


@pytest.mark.parametrize("session", SESSIONS, ids=lambda s: s.id)
def test_blocks_of_two_ranks_run(session, ranks, tmp_path, stage2_checkpoint):
    docs.prepare(tmp_path, session.blocks, stage2_checkpoint)
    ranks(docs.run_session, 2, session.blocks, str(tmp_path))
